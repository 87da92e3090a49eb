"""Decode speed and resident memory of a quantized model vs the same model in fp32/bf16,
same run, same thread count: what `mg-serve --load` holds and computes per token.

A Llama-shaped model (`--hidden`, `--layers`, `--ffn`, `--vocab`; random weights, or
`--load CKPT`) is saved once in float, then quantized by `mg-quantize` (`int8_wo`,
`int4_wo` g128). Each variant is then loaded by core's `load_model` (mg-serve's and
mg-eval's loader) in a fresh process, one after the other so they never share the CPU;
the child reports its resident memory after loading minus its resident memory before
(torch imported), and greedy batch-1 decode tokens/s with the KV cache (a 16-token
prompt, `--tokens` new tokens, best of `--repeats`). Ratios are against bf16.

    uv run --frozen python bench/bench_quantize.py                    # ~110M parameters
    uv run --frozen python bench/bench_quantize.py --hidden 512 --layers 4 --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import ctypes, gc, json, os, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
def rss():
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the OS before reading RSS
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
def tensor_bytes(model):
    # parameters, buffers and the int4 kernel's tiles: what the weights occupy
    total = 0
    for module in model.modules():
        held = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
        held += [t for t in (getattr(module, "_packed", None),) if t is not None]
        total += sum(t.numel() * t.element_size() for t in held)
    return total
from mg.core.checkpoint import load_model
from mg.core.models.kv_cache import KVCache
from mg.core.quantization import kernel_paths
# warm up the CPU matmul libraries on tiny tensors, so their one-time allocations are
# not counted as the model's
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(2, 64, dtype=dtype)
    torch.nn.functional.linear(x, torch.randn(64, 64, dtype=dtype))
    torch._weight_int8pack_mm(x, torch.ones(64, 64, dtype=torch.int8), torch.ones(64, dtype=dtype))
    tiles = torch._convert_weight_to_int4pack_for_cpu(torch.ones(64, 64, dtype=torch.int32), 1)
    torch._weight_int4pack_mm_for_cpu(x, tiles, 32, torch.ones(2, 64, 2, dtype=dtype))
# and the loader and forward once on a tiny checkpoint (lazy imports, first-call caches)
warm, _, _, _ = load_model(sys.argv[6])
with torch.no_grad():
    cache = KVCache.for_model(warm, num_slots=1, max_length=8)
    cache.bind(torch.tensor([0]), torch.tensor([0]))
    warm(torch.arange(1, 5)[None], torch.arange(4)[None], inference_cache=cache)
del warm, cache
before = rss()
model, config, _, _ = load_model(sys.argv[1])
if sys.argv[2] == "bf16":
    model = model.to(torch.bfloat16)
tokens, repeats = int(sys.argv[4]), int(sys.argv[5])
best = 0.0
with torch.no_grad():
    for _ in range(repeats):
        cache = KVCache.for_model(model, num_slots=1, max_length=16 + tokens)
        ids = torch.arange(1, 17)[None]
        cache.bind(torch.tensor([0]), torch.tensor([0]))
        logits = model(ids, torch.arange(16)[None], inference_cache=cache)
        start = time.perf_counter()
        for step in range(tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            cache.bind(torch.tensor([0]), torch.tensor([16 + step]))
            logits = model(nxt, torch.tensor([[16 + step]]), inference_cache=cache)
        best = max(best, tokens / (time.perf_counter() - start))
        del cache
after = rss()  # the weights as served, with any kernel-layout copies made on first use
print(json.dumps({"model_bytes": after - before, "tensor_bytes": tensor_bytes(model),
                  "tokens_per_s": best,
                  "kernels": [p for _, p in kernel_paths()]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load", help="an mg checkpoint (else a random Llama-shaped model)")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 2)))
    parser.add_argument(
        "--quantize-output-layer", action="store_true",
        help="mg-quantize --quantize-output-layer: the output layer in int8/int4 too",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, help="also write the markdown table here")
    args = parser.parse_args()

    import torch

    from mg.core.checkpoint import save_model
    from mg.core.models import GPTModel
    from mg.core.models.presets import tiny_llama
    from mg.quantize_export import cli

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        source = args.load
        if source is None:
            torch.manual_seed(0)
            config = tiny_llama(
                hidden_size=args.hidden, num_layers=args.layers, ffn_hidden_size=args.ffn,
                num_attention_heads=args.hidden // 64, num_query_groups=args.hidden // 128,
                vocab_size=args.vocab, seq_length=512, max_position_embeddings=512,
            )  # fmt: skip
            model = GPTModel(config).eval()
            params = sum(p.numel() for p in model.parameters())
            save_model(tmp / "float", model, config, None)
            del model
            source = str(tmp / "float")
        else:
            params = None
        warm_config = tiny_llama(vocab_size=256)
        save_model(tmp / "warmup", GPTModel(warm_config), warm_config, None)
        variants = [("fp32", source, "fp32"), ("bf16", source, "bf16")]
        for recipe in ("int8_wo", "int4_wo"):
            out = tmp / recipe
            extra = ["--quantize-output-layer"] if args.quantize_output_layer else []
            cli.main(
                ["--no-progress", "--load", source, "--save", str(out), "--recipe", recipe,
                 *extra]
            )  # fmt: skip
            variants += [(f"{recipe} (fp32 act.)", str(out), "fp32")]
            variants += [(f"{recipe} (bf16 act.)", str(out), "bf16")]
        rows = {}
        for name, path, mode in variants:
            result = subprocess.run(
                [sys.executable, "-c", CHILD, path, mode, str(args.threads), str(args.tokens),
                 str(args.repeats), str(tmp / "warmup")],
                capture_output=True, text=True, check=True,
                env={**os.environ, "OMP_NUM_THREADS": str(args.threads)},
            )  # fmt: skip
            rows[name] = json.loads(result.stdout.strip().splitlines()[-1])
            print(name, rows[name], file=sys.stderr)
    base = rows["bf16"]
    lines = [
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, {args.threads} threads per side;"
        f" model: {params or 'from --load'} parameters"
        f" (hidden {args.hidden}, {args.layers} layers, ffn {args.ffn}, vocab {args.vocab});"
        f" output layer {'quantized' if args.quantize_output_layer else 'kept in float'};"
        f" batch 1, {args.tokens} new tokens, best of {args.repeats}",
        "",
        "| weights | resident memory (RSS growth) | vs bf16 | weight tensors | vs bf16 "
        "| decode tokens/s | vs bf16 | matmul |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['model_bytes'] / 2**20:.0f} MiB | "
            f"{row['model_bytes'] / base['model_bytes']:.2f}x | "
            f"{row['tensor_bytes'] / 2**20:.0f} MiB | "
            f"{row['tensor_bytes'] / base['tensor_bytes']:.2f}x | {row['tokens_per_s']:.1f} | "
            f"{row['tokens_per_s'] / base['tokens_per_s']:.2f}x | {', '.join(row['kernels'])} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")


if __name__ == "__main__":
    main()
