"""What the workflow scripts share: an `mg-serve` started for a few requests, then stopped.

with Server(["bin/mg-serve", "--load", "ckpt", "--port", "0"], log="serve.log") as url:
    print(chat(url, "What is the capital of France?"))
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any


class Server:
    """`mg-serve ... --port 0` as a child: its URL once /health answers; SIGINT on exit."""

    def __init__(self, argv: list[str], log: Path, start_timeout: float = 3600.0) -> None:
        self.argv, self.log, self.start_timeout = argv, log, start_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> str:
        with self.log.open("w") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                sys.exit(f"mg-serve stopped before serving:\n{self.log.read_text()}")
            found = re.search(r"http://[0-9.]+:[0-9]+", self.log.read_text())
            if found:
                try:
                    urllib.request.urlopen(f"{found.group(0)}/health", timeout=5).close()
                    return found.group(0)
                except OSError:
                    pass
            time.sleep(0.5)
        self.stop()
        sys.exit(f"mg-serve did not answer /health within {self.start_timeout:.0f} s: {self.log}")

    def __exit__(
        self, kind: type | None, value: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=3600) as response:  # a busy machine is slow
        return json.load(response)


def chat(url: str, question: str, max_tokens: int = 40) -> str:
    """One greedy answer, through the checkpoint's own chat template."""
    body = {
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    return post(f"{url}/v1/chat/completions", body)["choices"][0]["message"]["content"]


def complete(
    url: str, prompts: list[str], max_tokens: int, seed: int, **sampling: Any
) -> list[str]:
    """Sampled continuations of `prompts`, one request (the server batches them)."""
    body = {"prompt": prompts, "max_tokens": max_tokens, "seed": seed, **sampling}
    choices = post(f"{url}/v1/completions", body)["choices"]
    return [c["text"] for c in sorted(choices, key=lambda c: c["index"])]
