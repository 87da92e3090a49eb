"""Mamba-2 on CPU: our SSD scan vs transformers' torch fallback, a hybrid vs a GPT of the
same size in training and in decoding, every pair measured in the same run.

    uv run --frozen python bench/bench_mamba.py            # the figures in bench/results
    uv run --frozen python bench/bench_mamba.py --quick    # small shapes, a smoke run

1. scan: `mg.core.models.mamba.ssd_chunked_scan` vs transformers' `mamba2_chunk_scan`
   (Mamba2Mixer's torch path when mamba_ssm is absent) on the same inputs, forward
   and forward + backward; the two results are checked equal first.
2. training: tokens/s of one optimizer step (AdamW, fp32, mock tokens) of a ~50M
   hybrid (`MambaModel`, Megatron's 8B allocation: 8% attention, 50% MLP) and of a
   ~50M GPT (`GPTModel`, RoPE, SwiGLU, RMSNorm), same hidden size and vocabulary.
3. decoding: tokens/s of one-token steps at a context of 1k and 8k tokens. The
   caches are filled synthetically (random keys/values and states; a step's cost
   depends on the context length, not on the values), so no 8k-token prefill is
   timed. The GPT's attention reads its whole KV cache every step; the hybrid's
   Mamba layers read a constant-size state and only its few attention layers a
   KV cache.

Both sides of each pair run in this process with the same `torch.get_num_threads()`,
alternating, and the median of the repeats is reported. Written to
`bench/results/mamba-cpu.md` with the machine, its load and the thread count.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _pair(fn_a, fn_b, repeats: int) -> tuple[float, float]:
    """Alternate a and b (one warm-up each), so a change in load hits both alike."""
    fn_a(), fn_b()
    a, b = [], []
    for _ in range(repeats):
        a.append(_median_time(fn_a, 1))
        b.append(_median_time(fn_b, 1))
    return statistics.median(a), statistics.median(b)


def bench_scan(quick: bool, repeats: int) -> list[str]:
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    from mg.core.models.mamba import ssd_chunked_scan

    b, length, heads, p, groups, n, chunk = (
        (1, 256, 8, 32, 1, 32, 64) if quick else (2, 2048, 16, 64, 1, 128, 128)
    )
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, length, heads, p, generator=g)
    # as in a Mamba-2 layer at init: softplus(dt_bias) log-uniform in [0.001, 0.1], A in -[1, 16]
    dt_raw = torch.randn(b, length, heads, generator=g)
    dt0 = torch.exp(torch.rand(heads, generator=g) * (math.log(0.1) - math.log(0.001)))
    dt0 = dt0 * 0.001
    dt_bias = dt0 + torch.log(-torch.expm1(-dt0))
    A = -(torch.rand(heads, generator=g) * 15 + 1)
    B = torch.randn(b, length, groups, n, generator=g)
    C = torch.randn(b, length, groups, n, generator=g)
    D = torch.randn(heads, generator=g)

    def ours(grad: bool = False):
        inputs = [t.clone().requires_grad_(grad) for t in (x, dt_raw, B, C)]
        dt = torch.nn.functional.softplus(inputs[1] + dt_bias)
        y, _ = ssd_chunked_scan(inputs[0], dt, A, inputs[2], inputs[3], chunk, D=D)
        if grad:
            y.sum().backward()
        return y

    def theirs(grad: bool = False):
        inputs = [t.clone().requires_grad_(grad) for t in (x, dt_raw, B, C)]
        y = mamba2_chunk_scan(
            inputs[0],
            inputs[1],
            A,
            inputs[2],
            inputs[3],
            chunk,
            D=D,
            dt_bias=dt_bias,
            dt_softplus=True,
        )
        if grad:
            y.sum().backward()
        return y

    with torch.no_grad():
        expected = theirs()
        diff = ((ours() - expected).abs().max() / expected.abs().max()).item()
    assert diff < 1e-4, f"the scans disagree: max |diff| / max |y| = {diff}"
    lines = [
        f"scan: batch {b}, length {length}, {heads} heads x {p}, {groups} group(s), "
        f"state {n}, chunk {chunk}; dt and A as a Mamba-2 layer initialises them "
        f"(max |ours - transformers| / max |y| = {diff:.1e})",
        "",
        "| pass | ours (ms) | transformers (ms) | speed-up |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, grad in (("forward", False), ("forward + backward", True)):
        with torch.set_grad_enabled(grad):
            a, t = _pair(lambda g=grad: ours(g), lambda g=grad: theirs(g), repeats)
        lines.append(f"| {name} | {a * 1e3:.1f} | {t * 1e3:.1f} | {t / a:.2f}x |")
    return lines


def _configs(quick: bool):
    from mg.core.models import TransformerConfig
    from mg.core.models.mamba import MambaConfig

    hidden, layers, vocab, seq = (128, 4, 1024, 128) if quick else (512, 8, 32000, 1024)
    common = dict(
        hidden_size=hidden,
        num_attention_heads=8,
        num_query_groups=8,
        vocab_size=vocab,
        seq_length=8192 + 64,
        normalization="RMSNorm",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    gpt = TransformerConfig(
        num_layers=layers, activation="swiglu", position_embedding_type="rope", **common
    )
    hybrid = MambaConfig(
        num_layers=2 * layers,  # one layer type each: attention+MLP pairs become M/*/- layers
        activation="squared_relu",
        ffn_hidden_size=4 * hidden,
        position_embedding_type="none",
        mamba_head_dim=32 if quick else 64,
        mamba_num_groups=8,
        mamba_state_dim=64,
        hybrid_attention_ratio=0.08,
        hybrid_mlp_ratio=0.5,
        **common,
    )
    return gpt, hybrid, seq


def bench_training(quick: bool, repeats: int) -> list[str]:
    from mg.core.models import GPTModel
    from mg.core.models.mamba import MambaModel

    gpt_config, hybrid_config, seq = _configs(quick)
    torch.manual_seed(0)
    models = {"GPT": GPTModel(gpt_config), "hybrid": MambaModel(hybrid_config)}
    batch = 1 if not quick else 2
    ids = torch.randint(0, gpt_config.vocab_size, (batch, seq))
    labels = torch.roll(ids, -1, 1)
    steps = {}
    for name, model in models.items():
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=True)
            model(ids, labels=labels).mean().backward()
            optimizer.step()

        steps[name] = step
    t_gpt, t_hybrid = _pair(steps["GPT"], steps["hybrid"], repeats)
    params = {k: sum(p.numel() for p in m.parameters()) / 1e6 for k, m in models.items()}
    tokens = batch * seq
    return [
        f"training: one AdamW step, fp32, micro-batch {batch} x {seq} tokens; GPT "
        f"{gpt_config.num_layers} layers ({params['GPT']:.1f}M parameters), hybrid "
        f"{hybrid_config.layer_pattern} ({params['hybrid']:.1f}M parameters), "
        f"hidden {gpt_config.hidden_size}, vocabulary {gpt_config.vocab_size}",
        "",
        "| model | s/step | tokens/s | vs GPT |",
        "| --- | ---: | ---: | ---: |",
        f"| GPT | {t_gpt:.2f} | {tokens / t_gpt:.0f} | 1.00x |",
        f"| hybrid | {t_hybrid:.2f} | {tokens / t_hybrid:.0f} | {t_gpt / t_hybrid:.2f}x |",
    ]


def _decode_step(model, cache, slots, starts, ids) -> None:
    cache.bind(slots, starts)
    model(ids, starts[:, None], inference_cache=cache)


@torch.no_grad()
def bench_decode(quick: bool, repeats: int) -> list[str]:
    from mg.core.models import GPTModel
    from mg.core.models.kv_cache import KVCache
    from mg.core.models.mamba import HybridCache, MambaModel

    gpt_config, hybrid_config, _ = _configs(quick)
    torch.manual_seed(0)
    gpt, hybrid = GPTModel(gpt_config).eval(), MambaModel(hybrid_config).eval()
    rows = 4
    lines = [
        f"decoding: {rows} sequences per step, one new token each, synthetic caches",
        "",
        "| context | GPT tokens/s | hybrid tokens/s | hybrid vs GPT | KV+state MB GPT | hybrid |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for context in (1024, 8192):
        caches = {
            "GPT": KVCache.for_model(gpt, num_slots=rows, max_length=context + 1),
            "hybrid": HybridCache.for_model(hybrid, num_slots=rows, max_length=context + 1),
        }
        for cache in caches.values():
            kv = cache if isinstance(cache, KVCache) else cache.kv
            kv.keys.normal_()
            kv.values.normal_()
            if isinstance(cache, HybridCache):
                cache.conv_states.normal_()
                cache.ssm_states.normal_()
        slots = torch.arange(rows)
        starts = torch.full((rows,), context)
        ids = torch.randint(0, gpt_config.vocab_size, (rows, 1))

        step = functools.partial(_decode_step, slots=slots, starts=starts, ids=ids)
        t_gpt, t_hybrid = _pair(
            functools.partial(step, gpt, caches["GPT"]),
            functools.partial(step, hybrid, caches["hybrid"]),
            repeats,
        )
        mb = {
            k: sum(
                t.numel() * t.element_size()
                for t in (
                    [c.keys, c.values]
                    if isinstance(c, KVCache)
                    else [c.kv.keys, c.kv.values, c.conv_states, c.ssm_states]
                )
            )
            / 2**20
            for k, c in caches.items()
        }
        lines.append(
            f"| {context} | {rows / t_gpt:.0f} | {rows / t_hybrid:.0f} | "
            f"{t_gpt / t_hybrid:.2f}x | {mb['GPT']:.0f} | {mb['hybrid']:.0f} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "mamba-cpu.md"))
    args = parser.parse_args()
    load = os.getloadavg()
    header = [
        "# Mamba-2 on CPU: SSD scan, training and decoding (bench/bench_mamba.py)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads on both sides of every pair; load average "
        f"before the run {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (a shared box: "
        "absolute times are contended, the ratios are measured in the same run).",
        "",
    ]
    body = []
    for part in (bench_scan, bench_training, bench_decode):
        body += part(args.quick, args.repeats) + [""]
        print("\n".join(body[-8:]), flush=True)
    text = "\n".join(header + body)
    if not args.quick:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
