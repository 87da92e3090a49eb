"""Serving throughput and latency of `mg-serve` vs transformers' `generate()`, same model, same run.

A small GPT-2-shaped model (real GPT-2 BPE vocabulary, a few M parameters) is
saved as an mg checkpoint and exported to Hugging Face format (mg-convert's
export). Then, one after the other so they never share the CPU:

1. reference: transformers' `generate()` answering the same requests one at a
   time (greedy, `--max-tokens` new tokens each), for `--seconds`;
2. `mg-serve` in its own process on loopback, with `--clients` concurrent HTTP
   clients sending `POST /v1/completions` back to back for `--seconds`.

Both generate exactly `--max-tokens` tokens per request (end-of-document is
suppressed: `logit_bias` on our side, no eos on theirs). Reported: completed
requests, errors, p50/p99 latency, generated tokens/s, the ratio, and the
server's resident memory after warm-up and at the end (growth = leak check).

    uv run --frozen python bench/bench_serve.py                 # 8 clients, 30 s per phase
    uv run --frozen python bench/bench_serve.py --clients 4 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from mg.ckpt_convert.export_hf import export_hf
from mg.core.checkpoint import save_model
from mg.core.fixtures import fixture_path
from mg.core.models import GPTModel, presets
from mg.core.models.flops import num_parameters
from mg.core.tokenizers import TokenizerConfig, build_tokenizer


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


def run_reference(hf_dir: Path, texts: list[str], max_tokens: int, seconds: float) -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    tok = build_tokenizer(
        TokenizerConfig(
            "GPT2BPETokenizer",
            vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
            merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
        )
    )
    gen_kwargs = dict(
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
    )
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        model.generate(torch.tensor([tok.tokenize(texts[0])]), **gen_kwargs)  # warm-up
    latencies, tokens, i = [], 0, 0
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        ids = torch.tensor([tok.tokenize(texts[i % len(texts)])])
        t0 = time.monotonic()
        with torch.no_grad():
            out = model.generate(ids, **gen_kwargs)
        latencies.append(time.monotonic() - t0)
        tokens += out.shape[1] - ids.shape[1]
        i += 1
    elapsed = time.monotonic() - started
    return {
        "requests": len(latencies),
        "errors": 0,
        "latencies": latencies,
        "tokens": tokens,
        "elapsed": elapsed,
    }


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--max-tokens", type=int, default=64)
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
            f"{args.max_tokens} new tokens per request, prompts of {args.prompt_words} words"
        )
        reference = run_reference(folder / "hf", texts, args.max_tokens, args.seconds)

        server = subprocess.Popen(
            [
                str(Path(sys.executable).with_name("mg-serve")),
                "--load",
                str(folder / "ckpt"),
                "--port",
                "0",
                "--inference-max-requests",
                str(args.clients),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            line = server.stdout.readline()
            match = re.search(r"listening on (http://\S+)", line)
            if not match:
                sys.exit(f"mg-serve did not start: {line}{server.stdout.read()}")
            url = match.group(1)
            asyncio.run(load_test(url, texts, args.clients, args.max_tokens, 3.0))  # warm-up
            rss_start = rss_mb(server.pid)
            ours = asyncio.run(load_test(url, texts, args.clients, args.max_tokens, args.seconds))
            rss_end = rss_mb(server.pid)
        finally:
            server.terminate()
            server.wait(timeout=30)

    ref_tps = report("transformers generate(), 1 at a time", reference)
    our_tps = report(f"mg-serve, {args.clients} clients", ours)
    print(f"throughput ratio mg-serve / transformers generate(): {our_tps / ref_tps:.2f}x")
    one, five, fifteen = os.getloadavg()
    print(f"machine load average at the end: {one:.1f} (1 min), {five:.1f} (5 min), {fifteen:.1f}")
    print(
        f"mg-serve resident memory: {rss_start:.0f} MB after warm-up, {rss_end:.0f} MB at the end "
        f"(growth {rss_end - rss_start:+.0f} MB)"
    )


if __name__ == "__main__":
    main()
