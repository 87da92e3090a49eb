"""`mg-serve cli HOST:PORT`: Megatron's interactive client (`tools/text_generation_cli.py`).

Loops asking for a prompt and a number of tokens, sends
`PUT {"prompts": [prompt], "tokens_to_generate": n}` to `http://HOST:PORT/api`
and prints `text[0]`; on an error status it prints the status and the
server's message, as Megatron's client does. Ctrl-D or Ctrl-C ends it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable


def _put(url: str, body: dict, api_key: str | None, timeout: float) -> tuple[int, dict]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="PUT",
        headers={"Content-Type": "application/json"},
    )
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read())
        except ValueError:
            return err.code, {"message": err.reason}


def run_client(
    address: str,
    api_key: str | None = None,
    timeout: float = 600.0,
    read: Callable[[str], str] = input,
    write: Callable[[str], None] = print,
) -> int:
    """The prompt loop; returns the exit status."""
    url = address if address.startswith("http") else f"http://{address}"
    url = url.rstrip("/") + "/api"
    api_key = api_key or os.environ.get("MG_SERVE_API_KEY")
    while True:
        try:
            prompt = read("Enter prompt: ")
            count = read("Enter number of tokens to generate: ")
        except (EOFError, KeyboardInterrupt):
            write("")
            return 0
        try:
            tokens = int(count)
        except ValueError:
            write(f"not a number of tokens: {count!r}")
            continue
        try:
            status, body = _put(
                url, {"prompts": [prompt], "tokens_to_generate": tokens}, api_key, timeout
            )
        except (urllib.error.URLError, OSError) as err:
            write(f"cannot reach {url}: {err}")
            return 1
        if status != 200:
            write(f"Error {status}: {body.get('message', body)}")
            continue
        write("Megatron Response: ")
        write(body["text"][0])
