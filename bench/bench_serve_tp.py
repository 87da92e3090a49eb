"""Tensor-parallel `mg-serve` (torchrun, 2 ranks) vs the same checkpoint served by one process.

A small GPT-2-shaped checkpoint (real GPT-2 BPE vocabulary) and a back-to-back
load test. One after the other, so they never share the CPU:

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
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

from mg.ckpt_convert.export_hf import export_hf
from mg.core.checkpoint import save_model
from mg.core.fixtures import fixture_path
from mg.core.models import GPTModel, presets
from mg.core.models.flops import num_parameters
from mg.core.tokenizers import TokenizerConfig

BIN = Path(sys.executable).parent


# The GPT-2-shaped checkpoint and the back-to-back load test (bench_serve.py's before it
# became the comparison with transformers' batched generate()).
def build_checkpoint(folder: Path, layers: int, hidden: int, positions: int) -> int:
    torch.manual_seed(0)
    config = presets.tiny_gpt2(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=max(1, hidden // 64),
        vocab_size=50304,
        seq_length=positions,
        max_position_embeddings=positions,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config)
    tokenizer = TokenizerConfig(
        "GPT2BPETokenizer",
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    )
    save_model(folder / "ckpt", model, config, tokenizer)
    export_hf(folder / "ckpt", folder / "hf", progress=False)
    return num_parameters(config)


def prompts(count: int, words: int) -> list[str]:
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")[20000:].split()
    return [" ".join(text[i * words : (i + 1) * words]) for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


async def load_test(
    url: str, texts: list[str], clients: int, max_tokens: int, seconds: float
) -> dict:
    latencies: list[float] = []
    errors = 0
    tokens = 0
    stop_at = time.monotonic() + seconds

    async def client(index: int, http: httpx.AsyncClient) -> None:
        nonlocal errors, tokens
        i = index
        while time.monotonic() < stop_at:
            body = {
                "prompt": texts[i % len(texts)],
                "max_tokens": max_tokens,
                "temperature": 0,
                "logit_bias": {"50256": -100},
            }
            t0 = time.monotonic()
            try:
                r = await http.post(url + "/v1/completions", json=body)
                if r.status_code != 200:
                    errors += 1
                else:
                    tokens += r.json()["usage"]["completion_tokens"]
                    latencies.append(time.monotonic() - t0)
            except httpx.HTTPError:
                errors += 1
            i += clients

    started = time.monotonic()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as http:
        await asyncio.gather(*(client(k, http) for k in range(clients)))
    return {
        "requests": len(latencies),
        "errors": errors,
        "latencies": latencies,
        "tokens": tokens,
        "elapsed": time.monotonic() - started,
    }


def report(name: str, result: dict) -> float:
    lat = result["latencies"] or [float("nan")]
    tps = result["tokens"] / result["elapsed"]
    print(
        f"{name:<28} requests {result['requests']:5d}  errors {result['errors']:3d}  "
        f"p50 {statistics.median(lat) * 1000:8.1f} ms  p99 {percentile(lat, 0.99) * 1000:8.1f} ms  "
        f"{tps:9.1f} tokens/s"
    )
    return tps


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
