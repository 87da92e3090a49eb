"""Tensor-parallel `mg-serve` (torchrun, 2 ranks) vs the same checkpoint served by one process.

The checkpoint and load test are bench_serve.py's (GPT-2 shape, real GPT-2 BPE
vocabulary). One after the other, so they never share the CPU:

1. reference: `mg-serve --load ckpt` in one process (torch's default threads:
   all cores);
2. `torchrun --nproc-per-node 2 --no-python mg-serve --load ckpt` (torchrun's
   default of one thread per rank).

Before timing, both answer the same greedy requests and the generated tokens
are checked to be identical. Each phase: a warm-up, then `--clients` concurrent
clients sending `POST /v1/completions` back to back for `--seconds`. Reported:
requests, p50/p99 latency, generated tokens/s and the ratio TP / one process.

On a CPU box tensor parallelism does not pay: the ranks split the same cores,
and every layer adds two all-reduces over loopback (gloo) and DTensor dispatch.
The figure says what that overhead costs; on GPUs, TP is how a model that does
not fit one device is served at all.

    uv run --frozen python bench/bench_serve_tp.py                   # 4 clients, 20 s per phase
    uv run --frozen python bench/bench_serve_tp.py --clients 8 --seconds 30
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import re
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_serve import build_checkpoint, load_test, prompts, report  # noqa: E402

BIN = Path(sys.executable).parent


def start(command: list[str]) -> tuple[subprocess.Popen, str]:
    """Start a server command; return it and rank 0's URL (other output is drained)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()

    def drain() -> None:
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    threading.Thread(target=drain, daemon=True).start()
    seen = []
    while True:
        line = lines.get(timeout=300)
        seen.append(line)
        match = re.search(r"listening on (http://\S+)", line)
        if match:
            return proc, match.group(1)
        if not line:
            sys.exit("server did not start:\n" + "".join(seen))


def greedy(url: str, texts: list[str], max_tokens: int) -> list[str]:
    body = {"prompt": texts, "max_tokens": max_tokens, "temperature": 0}
    body["logit_bias"] = {"50256": -100}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=300).json()
    return [choice["text"] for choice in sorted(reply["choices"], key=lambda c: c["index"])]


def phase(command: list[str], args: argparse.Namespace, texts: list[str]) -> tuple[dict, list]:
    proc, url = start(command)
    try:
        answers = greedy(url, texts[:4], args.max_tokens)
        asyncio.run(load_test(url, texts, args.clients, args.max_tokens, 3.0))  # warm-up
        result = asyncio.run(load_test(url, texts, args.clients, args.max_tokens, args.seconds))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return result, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-words", type=int, default=24)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--positions", type=int, default=256)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        params = build_checkpoint(folder, args.layers, args.hidden, args.positions)
        texts = prompts(64, args.prompt_words)
        print(
            f"model: GPT-2 shape, {args.layers} layers, hidden {args.hidden}, "
            f"{params / 1e6:.1f}M parameters, fp32, {torch.get_num_threads()} threads; "
            f"{args.max_tokens} new tokens per request, {args.clients} clients"
        )
        serve = [
            *("--load", str(folder / "ckpt"), "--port", "0", "--log-level", "warning"),
            *("--inference-max-requests", str(args.clients)),
        ]
        one, one_answers = phase([str(BIN / "mg-serve"), *serve], args, texts)
        torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node=2", "--no-python"]
        tp, tp_answers = phase([*torchrun, str(BIN / "mg-serve"), *serve], args, texts)

    same = one_answers == tp_answers
    print(f"greedy answers of 4 prompts identical across layouts: {same}")
    one_tps = report("mg-serve, 1 process", one)
    tp_tps = report("mg-serve, torchrun TP=2", tp)
    print(f"throughput ratio TP=2 / 1 process: {tp_tps / one_tps:.2f}x")
    load = os.getloadavg()
    print(f"machine load average at the end: {load[0]:.1f} (1 min), {load[1]:.1f} (5 min)")
    if not same:
        sys.exit("the layouts answered differently")


if __name__ == "__main__":
    main()
