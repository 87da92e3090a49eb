"""mg-serve vs transformers' batched `generate()`: same model, prompts and threads, in one run.

A Llama-shaped model (SmolLM-135M's shape: 30 layers, hidden 576, 9 heads in 3
query groups, SwiGLU 1536, tied embeddings; GPT-2 BPE vocabulary padded to
50304: 135M parameters) is built with random weights, saved as an mg
checkpoint and exported to Hugging Face format (mg-convert's export). Then, one
phase after the other so that they never share the CPU, each in a fresh
process with `--threads` torch threads:

1. transformers: `generate()` on batches of 8 prompts (left-padded, greedy,
   `--new-tokens` each, a streamer timestamps every step);
2. mg-serve (`--num-threads` the same) with 8 and then 32 concurrent clients
   streaming `POST /v1/completions` (token-id prompts, greedy), two requests
   per client;
3. memory: 8 clients with ~1000-token prompts; the server's peak resident
   memory against the weights plus the keys/values of the tokens cached;
4. long context: 7 clients decoding, alone and while an 8th sends an
   8000-token prompt (chunked prefill keeps their inter-token latency down);
5. with `--llama-cpp` (llama-cpp-python installed apart): at each of
   `--llama-cpp-types` (F32, BF16, Q8_0: GGUF files from mg-quantize's exporter),
   mg-serve with 1 client at the matching precision, then llama.cpp on the same
   requests one at a time (bench/llama_cpp_phase.py).

Prompts are Botchan text of mixed lengths (the same token ids on both sides;
end-of-document can never stop a request early: no eos on theirs, a logit bias
on ours). Reported per phase: generated tokens/s, time to first token and
inter-token latency p50/p99 (ours: between streamed chunks, as a client sees
them; theirs: between generate() steps), peak resident memory (ours: while
serving, the mark reset after the warm-up; theirs: the whole process),
threads; the ratios; the machine's load, and its GEMM and memory speed read before
each throughput phase and after the last (bench/machine_probe.py: a run whose readings
spread more than 10% says it is not a result).

    .venv/bin/python bench/bench_serve.py                       # the full run (~10 min quiet)
    .venv/bin/python bench/bench_serve.py --layers 4 --skip-long --new-tokens 32   # a smoke run
    .venv/bin/python bench/bench_serve.py --bf16 --serve-args=--enable-torch-compile
    .venv/bin/python bench/bench_serve.py --isa avx2 --bf16 --transformers-fp32  # no AMX/AVX-512
    python bench/bench_serve.py --device cuda --bf16 --serve-args=--enable-cuda-graph

With `--device cuda` both sides run on the GPU (transformers' `generate()` and
`mg-serve --device cuda`); the memory phase, which measures resident memory on
the CPU, is left out there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import isa_cap
import machine_probe
import torch

from mg.generate_server.cpu_isa import check, describe

BENCH = Path(__file__).resolve()
MG_SERVE_MODULE = "mg.generate_server.cli"  # where no `mg-serve` script sits beside python


def smollm_135m_shape(layers: int, positions: int, untied: bool = False):
    """SmolLM-135M's shape (hidden 576, 9 heads in 3 groups, SwiGLU 1536, vocabulary
    50304) with `layers` layers, no dropout."""
    from mg.core.models import presets

    return presets.tiny_llama(
        num_layers=layers,
        hidden_size=576,
        num_attention_heads=9,
        num_query_groups=3,
        ffn_hidden_size=1536,
        vocab_size=50304,
        seq_length=positions,
        max_position_embeddings=positions,
        untie_embeddings_and_output_weights=untied,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def build_checkpoint(folder: Path, layers: int, positions: int) -> tuple[int, int, int]:
    """Save the model; (parameters, bytes of weights, bytes of keys+values per token)."""
    from mg.ckpt_convert.export_hf import export_hf
    from mg.core.checkpoint import save_model
    from mg.core.models import GPTModel
    from mg.core.models.flops import num_parameters

    torch.manual_seed(0)
    config = smollm_135m_shape(layers, positions)
    model = GPTModel(config)
    save_model(folder / "ckpt", model, config, tokenizer_config())
    export_hf(folder / "ckpt", folder / "hf", progress=False)
    params = num_parameters(config)
    kv_per_token = 2 * layers * config.num_query_groups * config.kv_channels * 4
    return params, params * 4, kv_per_token


def tokenizer_config():
    from mg.core.fixtures import fixture_path
    from mg.core.tokenizers import TokenizerConfig

    return TokenizerConfig(
        "GPT2BPETokenizer",
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    )


def prompt_ids(count: int, lengths: tuple[int, int], offset: int = 0) -> list[list[int]]:
    """`count` token-id prompts of Botchan text, lengths spread evenly over [lo, hi]."""
    from mg.core.fixtures import fixture_path
    from mg.core.tokenizers import build_tokenizer

    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")
    ids = build_tokenizer(tokenizer_config()).tokenize(text[20000:])
    lo, hi = lengths
    out, at = [], offset
    for i in range(count):
        n = lo + (hi - lo) * i // max(1, count - 1)
        out.append(ids[at : at + n])
        at += n
    if at > len(ids):
        raise SystemExit(f"{count} prompts of {lo}-{hi} tokens from {offset} run past the text")
    return out


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def peak_rss_mb(pid: int | str = "self", field: str = "VmHWM") -> float:
    """The process's peak resident memory (or, with field="VmRSS", its current one)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


# What a server process holds before it loads any model: torch, inductor's code cache (the
# CPU kernels are built and loaded through it) and the server's modules.
RUNTIME_IMPORTS = (
    "import torch, torch._inductor.codecache, uvicorn\n"
    "import mg.generate_server.app, mg.generate_server.cli, mg.generate_server.engine\n"
    "import mg.generate_server.loading, mg.generate_server.runner\n"
    "import mg.generate_server.tensor_parallel\n"
    "print(open('/proc/self/status').read())"
)


def runtime_rss_mb() -> float:
    """Resident memory of a process that imports what mg-serve imports and loads nothing."""
    out = subprocess.run(
        [sys.executable, "-c", RUNTIME_IMPORTS], capture_output=True, text=True, check=True
    ).stdout
    return next(int(x.split()[1]) / 1024 for x in out.splitlines() if x.startswith("VmRSS:"))


# --- transformers, in its own process -------------------------------------------


def transformers_phase(
    hf_dir: str, prompts: list[list[int]], new_tokens: int, batch: int, bf16: bool, device: str
) -> dict:
    import transformers
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.monotonic())

        def end(self) -> None:
            pass

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval().to(device)
    if bf16:
        model = model.to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(group: list[list[int]], clock: StepClock | None) -> int:
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=device)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, streamer=clock, **kwargs)
        return (out.shape[1] - width) * len(group)

    run(prompts[:batch], None)  # warm-up
    ttft, itl, tokens = [], [], 0
    started = time.monotonic()
    for i in range(0, len(prompts), batch):
        clock = StepClock()
        t0 = time.monotonic()
        tokens += run(prompts[i : i + batch], clock)
        steps = clock.times[1:]  # the first put() is the prompt
        ttft += [steps[0] - t0] * batch
        itl += [b - a for a, b in zip(steps, steps[1:], strict=False)] * batch
    return {
        "tokens": tokens,
        "elapsed": time.monotonic() - started,
        "ttft": ttft,
        "itl": itl,
        "peak_mb": peak_rss_mb(),
        "threads": torch.get_num_threads(),
    }


# --- mg-serve, in its own process, driven over HTTP ------------------------------


class Server:
    def __init__(self, ckpt: Path, threads: int, max_requests: int, *extra: str) -> None:
        script = Path(sys.executable).with_name("mg-serve")
        launcher = [str(script)] if script.exists() else [sys.executable, "-m", MG_SERVE_MODULE]
        command = [
            *launcher,
            *("--load", str(ckpt), "--port", "0", "--log-level", "warning"),
            *("--num-threads", str(threads), "--inference-max-requests", str(max_requests)),
            *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        self.proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        started, before = time.monotonic(), []
        for line in self.proc.stdout:  # start-up log lines (warnings) come before the banner
            if "listening on" in line:
                break
            before.append(line)
        else:
            line = ""
        self.banner = line
        self.startup_s = time.monotonic() - started
        """Seconds from launch to listening (loading, and compiling with
        --enable-torch-compile)."""
        match = re.search(r"listening on (http://\S+)", self.banner)
        if not match:
            self.proc.kill()
            sys.exit(f"mg-serve did not start: {''.join(before)}{self.proc.stdout.read()}")
        for line in before:
            print("mg-serve:", line.rstrip(), flush=True)
        self.url = match.group(1)
        self.idle_mb = peak_rss_mb(self.proc.pid, "VmRSS")
        """Resident memory once listening: the weights, torch, the server; no request yet."""
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def reset_peak(self) -> None:
        """Start the peak-RSS mark afresh (Linux: clear_refs 5), so the load's transient
        copies of the checkpoint do not count as serving memory."""
        with contextlib.suppress(OSError):
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")

    def close(self) -> float:
        peak = peak_rss_mb(self.proc.pid)
        self.proc.terminate()
        self.proc.wait(timeout=60)
        return peak


async def stream_one(http: httpx.AsyncClient, url: str, prompt: list[int], tokens: int) -> dict:
    """One streamed completion: when it was sent, when each chunk arrived, tokens generated."""
    body = {
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "logit_bias": {"50256": -100},
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.monotonic()
    arrivals, generated = [], 0
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {await r.aread()}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                generated = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.monotonic())
    return {"sent": sent, "arrivals": arrivals, "tokens": generated}


async def drive(url: str, prompts: list[list[int]], clients: int, tokens: int) -> list[dict]:
    """`clients` concurrent clients taking the prompts in turn, back to back."""
    queue = list(reversed(prompts))
    results: list[dict] = []

    async def client(http: httpx.AsyncClient) -> None:
        while queue:
            results.append(await stream_one(http, url, queue.pop(), tokens))

    limits = httpx.Limits(max_connections=clients + 2)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return results


def summarise(results: list[dict], elapsed: float) -> dict:
    ttft = [r["arrivals"][0] - r["sent"] for r in results if r["arrivals"]]
    itl = [b - a for r in results for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False)]
    return {
        "tokens": sum(r["tokens"] for r in results),
        "elapsed": elapsed,
        "ttft": ttft,
        "itl": itl,
    }


def serve_phase(ckpt: Path, threads: int, clients: int, prompts, tokens, *extra) -> dict:
    server = Server(ckpt, threads, clients, *extra)
    try:
        asyncio.run(drive(server.url, prompts[:clients], clients, 4))  # warm-up
        server.reset_peak()
        started = time.monotonic()
        results = asyncio.run(drive(server.url, prompts, clients, tokens))
        out = summarise(results, time.monotonic() - started)
    finally:
        out_peak = server.close()
    return {
        **out,
        "peak_mb": out_peak,
        "idle_mb": server.idle_mb,
        "threads": threads,
        "banner": server.banner.strip(),
        "startup_s": server.startup_s,
    }


def long_context_phase(ckpt: Path, threads: int, args, *extra: str) -> dict:
    """7 clients decode; ITL of theirs alone, then while an 8th sends a long prompt."""
    short = prompt_ids(7, (32, 96), offset=50000)
    budget = ("--max-num-batched-tokens", str(args.long_chunk))
    server = Server(ckpt, threads, 8, *budget, *extra)
    try:
        asyncio.run(drive(server.url, short, 7, 4))  # warm-up
        server.reset_peak()
        started = time.monotonic()
        alone = summarise(
            asyncio.run(drive(server.url, short, 7, args.long_decode_tokens)),
            time.monotonic() - started,
        )
        # text no other phase sends (the memory phase's ends at 38,000, the short ones
        # start at 50,000): an 8,000-token prompt from 40,000 is all new to the cache
        (long_prompt,) = prompt_ids(1, (args.long_tokens, args.long_tokens), offset=40000)

        async def together() -> tuple[list[dict], dict]:
            limits = httpx.Limits(max_connections=10)
            async with httpx.AsyncClient(timeout=7200, limits=limits) as http:
                long_task = asyncio.create_task(stream_one(http, server.url, long_prompt, 8))
                decoding: list[dict] = []

                async def client(prompt: list[int]) -> None:
                    while not long_task.done():
                        decoding.append(
                            await stream_one(http, server.url, prompt, args.long_decode_tokens)
                        )

                await asyncio.gather(*(client(p) for p in short))
                return decoding, await long_task

        started = time.monotonic()
        decoding, long_result = asyncio.run(together())
        during = summarise(decoding, time.monotonic() - started)
    finally:
        peak = server.close()
    return {
        "alone": alone,
        "during": during,
        "long_ttft": long_result["arrivals"][0] - long_result["sent"],
        "peak_mb": peak,
        "chunk": args.long_chunk,
        "long_tokens": len(long_prompt),
    }


def llama_cpp_contender(folder: Path, ckpt: Path, prompts: list[list[int]], args) -> list[str]:
    """--llama-cpp: at each --llama-cpp-types, mg-serve with one client at the matching
    precision, then llama.cpp single-stream on the same requests (bench/llama_cpp_phase.py);
    the summary's lines."""
    import llama_cpp_phase  # beside this script; only with --llama-cpp

    if not llama_cpp_phase.installed():
        print(llama_cpp_phase.SKIPPED, flush=True)
        return []
    if args.device != "cpu":
        print("llama.cpp: skipped (CPU only: --device cuda)", flush=True)
        return []
    requests = prompts[: args.llama_cpp_requests]
    flags = ["--device", args.device, "--cpu-isa", args.cpu_isa, *shlex.split(args.serve_args)]
    rows, ratios = [], []
    for kind in args.llama_cpp_types:
        pair = llama_cpp_phase.prepare(kind, folder, ckpt)
        ours = serve_phase(
            pair.ckpt, args.threads, 1, requests, args.new_tokens, *pair.serve_flags, *flags
        )
        theirs = llama_cpp_phase.measure(pair.gguf, requests, args.new_tokens, args.threads)
        for name, r in (
            (f"mg-serve, 1 client, {pair.label} ({len(requests)} requests)", ours),
            (f"llama.cpp {kind}, 1 stream ({len(requests)} requests)", theirs),
        ):
            rows.append(row(name, r))
            print(rows[-1], flush=True)
        tps = [r["tokens"] / r["elapsed"] for r in (ours, theirs)]
        decode = [llama_cpp_phase.decode_tps(r) for r in (ours, theirs)]
        ratios.append(
            f"- {kind}: mg-serve 1 client ({pair.label}) {tps[0]:.1f} tokens/s, llama.cpp "
            f"{kind} {tps[1]:.1f}: {tps[0] / tps[1]:.2f}x; decode only {decode[0]:.1f} and "
            f"{decode[1]:.1f}: {decode[0] / decode[1]:.2f}x"
            + (f" (llama.cpp: {theirs['note']})" if theirs["note"] else "")
        )
    return [
        f"llama.cpp (llama-cpp-python {theirs['version']}, n_threads = n_threads_batch = "
        f"{args.threads}, greedy, one sequence at a time): {theirs['system_info']}"
        + (
            ""
            if args.isa == "native"
            else f" (not capped by --isa {args.isa}: its build runs what this CPU has)"
        ),
        "",
        "| run | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| peak RSS MB | threads |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        *ratios,
    ]


def row(name: str, r: dict) -> str:
    ms = 1000.0
    return (
        f"| {name} | {r['tokens'] / r['elapsed']:.1f} | {statistics.median(r['ttft']) * ms:.0f} | "
        f"{percentile(r['ttft'], 0.99) * ms:.0f} | {statistics.median(r['itl']) * ms:.0f} | "
        f"{percentile(r['itl'], 0.99) * ms:.0f} | {r['peak_mb']:.0f} | {r['threads']} |"
    )


BASELINE = "transformers generate(), batch 8 (16 requests)"
BASELINE_AGAIN = "transformers generate(), batch 8, again after the server"
BASELINES = (BASELINE, BASELINE_AGAIN)
BATCH_32 = "transformers generate(), batch 32 (64 requests)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2, help="torch threads on both sides")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--skip-long", action="store_true", help="no long-context phase")
    parser.add_argument("--skip-memory", action="store_true", help="no 8 x 1k memory phase")
    parser.add_argument("--long-tokens", type=int, default=8000)
    parser.add_argument("--long-chunk", type=int, default=64, help="--max-num-batched-tokens")
    parser.add_argument("--long-decode-tokens", type=int, default=32)
    parser.add_argument("--bf16", action="store_true", help="both sides in bfloat16")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="both sides")
    parser.add_argument(
        "--serve-args",
        default="",
        help="more mg-serve flags for every server, one string "
        "(--serve-args=--enable-torch-compile)",
    )
    parser.add_argument(
        "--cpu-isa",
        choices=("auto", "amx", "avx512", "avx2", "none"),
        default="auto",
        help="mg-serve --cpu-isa: the instruction set its CPU kernels may use (a forced one "
        "runs another machine's code path here); named with the CPU's flags in the results",
    )
    parser.add_argument(
        "--batch-32", action="store_true", help="also transformers at batch 32 (64 requests)"
    )
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="also llama.cpp (llama-cpp-python, installed apart) one sequence at a time, "
        "beside mg-serve with 1 client at the matching precision",
    )
    parser.add_argument(
        "--llama-cpp-types", nargs="+", choices=("F32", "BF16", "Q8_0"),
        default=["F32", "BF16", "Q8_0"],
        help="GGUF types (mg-serve beside them: fp32, --bf16, an int8_wo checkpoint with --bf16)",
    )  # fmt: skip
    parser.add_argument(
        "--llama-cpp-requests", type=int, default=16, help="requests in each 1-stream phase"
    )
    parser.add_argument(
        "--isa",
        choices=isa_cap.CHOICES,
        default="native",
        help="run every side as a CPU with only this instruction set would (bench/isa_cap.py: "
        "PyTorch's, MKL's, oneDNN's and mg's kernels capped; --cpu-isa follows)",
    )
    parser.add_argument(
        "--transformers-fp32",
        action="store_true",
        help="transformers in fp32 even with --bf16: its best on a CPU without bf16 "
        "instructions, where torch's bf16 matmuls crawl",
    )
    parser.add_argument("--_transformers", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    isa_cap.apply(args.isa)
    if args.isa != "native" and args.cpu_isa == "auto":
        args.cpu_isa = isa_cap.CAPS[args.isa]["MG_CPU_ISA"]
    torch.set_num_threads(args.threads)
    if args._transformers:  # the child process of phase 1
        hf_dir, prompts_file, new_tokens, batch = args._transformers
        prompts = json.loads(Path(prompts_file).read_text())
        result = transformers_phase(
            hf_dir, prompts, int(new_tokens), int(batch), args.bf16, args.device
        )
        print(json.dumps(result))
        return

    positions = max(2048, args.long_tokens + 256)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        params, weight_bytes, kv_per_token = build_checkpoint(folder, args.layers, positions)
        ckpt = folder / "ckpt"
        prompts = prompt_ids(64, tuple(args.prompt_tokens))
        print(
            f"model: Llama shape, {args.layers} layers, hidden 576, {params / 1e6:.1f}M "
            f"parameters, {'bf16' if args.bf16 else 'fp32'}, {args.device}; {args.threads} "
            "threads on both "
            f"sides; prompts of "
            f"{args.prompt_tokens[0]}-{args.prompt_tokens[1]} tokens, {args.new_tokens} new "
            f"tokens each; mg-serve flags: {' '.join(['--bf16'] * args.bf16) or 'none'} "
            f"{args.serve_args} --cpu-isa {args.cpu_isa}; CPU kernels: "
            f"{describe(check(args.cpu_isa))}"
            + ("; transformers in fp32" if args.bf16 and args.transformers_fp32 else "")
            + f"\n{isa_cap.describe(args.isa)}",
            flush=True,
        )
        results: dict[str, dict] = {}
        bf16 = ["--bf16"] if args.bf16 else []
        theirs = [] if args.transformers_fp32 else bf16
        device = ["--device", args.device]
        serve_flags = [*bf16, *device, "--cpu-isa", args.cpu_isa, *shlex.split(args.serve_args)]

        readings: list[machine_probe.Reading] = []

        def transformers_run(name: str, batch: int = 8) -> None:
            machine_probe.read_into(readings, args.threads, f"before {name}")
            prompts_file = folder / f"prompts{2 * batch}.json"
            prompts_file.write_text(json.dumps(prompts[: 2 * batch]))
            child = subprocess.run(
                [sys.executable, str(BENCH), "--threads", str(args.threads), *theirs, *device,
                 "--_transformers", str(folder / "hf"), str(prompts_file), str(args.new_tokens),
                 str(batch)],
                capture_output=True, text=True,
                env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
            )  # fmt: skip
            if child.returncode != 0:
                sys.exit(f"transformers' generate() failed:\n{child.stderr[-3000:]}")
            results[name] = json.loads(child.stdout.strip().splitlines()[-1])
            print(row(name, results[name]), flush=True)

        transformers_run(BASELINE)
        if args.batch_32:
            transformers_run(BATCH_32, 32)
        for clients in (8, 32):
            name = f"mg-serve, {clients} clients ({2 * clients} requests)"
            machine_probe.read_into(readings, args.threads, f"before {name}")
            results[name] = serve_phase(
                ckpt, args.threads, clients, prompts[: 2 * clients], args.new_tokens, *serve_flags
            )
            print(
                row(name, results[name]),
                results[name]["banner"],
                f"(listening {results[name]['startup_s']:.0f} s after launch)",
                flush=True,
            )
        # the baseline again after the server's throughput phases: a VM whose speed
        # drifts during the run shows as two different baselines
        transformers_run(BASELINE_AGAIN)
        machine_probe.read_into(readings, args.threads, "after the last phase")
        if not args.skip_memory and args.device == "cpu":
            long_prompts = prompt_ids(8, (1000, 1000), offset=30000)
            memory = serve_phase(ckpt, args.threads, 8, long_prompts, 24, *serve_flags)
            cached = 8 * (1000 + 24) * kv_per_token
            if args.bf16:
                weight_bytes, cached = weight_bytes // 2, cached // 2
            memory["bound_mb"] = (1.2 * weight_bytes + cached) / 2**20
            memory["weights_mb"] = weight_bytes / 2**20
            memory["cached_mb"] = cached / 2**20
            memory["runtime_mb"] = runtime_rss_mb()
            results["memory"] = memory
            print(row("mg-serve 8 x 1k", memory), f"bound {memory['bound_mb']:.0f} MB", flush=True)
        if not args.skip_long:
            results["long"] = long_context_phase(ckpt, args.threads, args, *serve_flags)
        contender = llama_cpp_contender(folder, ckpt, prompts, args) if args.llama_cpp else []

    first, again = (results[name]["tokens"] / results[name]["elapsed"] for name in BASELINES)
    base_tps = (first + again) / 2
    print()
    print(
        "| run | tokens/s | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| peak RSS MB | threads |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, r in results.items():
        if name in ("memory", "long"):
            continue
        print(row(name, r))
    print()
    for name, r in results.items():
        if name.startswith("mg-serve"):
            tps = r["tokens"] / r["elapsed"]
            print(
                f"- {name}: {tps / base_tps:.2f}x transformers batch 8 (the mean of its two "
                f"runs; {tps / first:.2f}x the first, {tps / again:.2f}x the second)"
            )
            if BATCH_32 in results and "32 clients" in name:
                b32 = results[BATCH_32]["tokens"] / results[BATCH_32]["elapsed"]
                print(f"- {name}: {tps / b32:.2f}x transformers batch 32")
    drift = abs(first - again) / min(first, again)
    print(
        f"- transformers batch 8 before and after the server's phases: {first:.1f} and "
        f"{again:.1f} tokens/s ({drift:.0%} apart)"
        + (machine_probe.NOT_A_RESULT if drift > machine_probe.TOLERANCE else "")
    )
    print(machine_probe.verdict(readings))
    if "memory" in results:
        m = results["memory"]
        print(
            f"- 8 x 1k-token sequences: server peak {m['peak_mb']:.0f} MB; weights "
            f"{m['weights_mb']:.0f} MB, keys/values of the cached tokens {m['cached_mb']:.0f} MB; "
            f"1.2 x weights + cached = {m['bound_mb']:.0f} MB "
            f"({m['peak_mb'] / (m['weights_mb'] + m['cached_mb']):.2f}x weights + cached); "
            f"resident once listening {m['idle_mb']:.0f} MB (weights and the process: torch, "
            f"the server), growth while serving {m['peak_mb'] - m['idle_mb']:.0f} MB "
            f"({(m['peak_mb'] - m['idle_mb']) / m['cached_mb']:.2f}x the cached keys/values)"
        )
        own, needed = m["peak_mb"] - m["runtime_mb"], m["weights_mb"] + m["cached_mb"]
        print(
            f"- the same, above the runtime (a process importing what mg-serve imports, no "
            f"model: {m['runtime_mb']:.0f} MB): {own:.0f} MB, {own / needed:.2f}x weights + "
            f"cached; 1.2 x weights + cached = {m['bound_mb']:.0f} MB "
            f"({'within' if own <= m['bound_mb'] else 'over'}), 1.2 x (weights + cached) = "
            f"{1.2 * needed:.0f} MB ({'within' if own <= 1.2 * needed else 'over'})"
        )
    if "long" in results:
        lc = results["long"]
        alone, during = lc["alone"], lc["during"]
        ratio = percentile(during["itl"], 0.99) / percentile(alone["itl"], 0.99)
        p50, p99 = statistics.median, lambda v: percentile(v, 0.99)
        print(
            f"- long context: 7 clients decoding, ITL p50/p99 {p50(alone['itl']) * 1e3:.0f}/"
            f"{p99(alone['itl']) * 1e3:.0f} ms alone, {p50(during['itl']) * 1e3:.0f}/"
            f"{p99(during['itl']) * 1e3:.0f} ms while a {lc['long_tokens']}-token prompt is "
            f"prefilled in chunks of {lc['chunk']} (p99 ratio {ratio:.2f}x; the long prompt's "
            f"TTFT {lc['long_ttft']:.1f} s)"
        )
    if contender:
        print()
        print("\n".join(contender))
    one, five, fifteen = os.getloadavg()
    print(
        f"- machine: {os.cpu_count()} CPUs, load average at the end "
        f"{one:.1f} / {five:.1f} / {fifteen:.1f} (1 / 5 / 15 min)"
    )


if __name__ == "__main__":
    main()
