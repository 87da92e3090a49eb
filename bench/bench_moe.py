"""Mixture of Experts on CPU: our MoE layer (sequential and grouped-GEMM experts) vs
transformers' Mixtral sparse block on the same weights and tokens, and an MoE GPT's
training throughput, every pair measured in the same run.

    uv run --frozen python bench/bench_moe.py            # the figures in bench/results
    uv run --frozen python bench/bench_moe.py --quick    # small shapes, a smoke run

1. layer: tokens/s of `mg.core.models.moe.MoELayer` with `SequentialMLP` and with
   `GroupedMLP` (`torch._grouped_mm`) and of transformers' `MixtralSparseMoeBlock`
   (fused 3-D expert weights, a loop over the experts hit), forward and forward +
   backward, Mixtral's routing (softmax, top-2 renormalised, SwiGLU experts). The
   three outputs are checked equal first.
2. training: tokens/s of one AdamW step (fp32, mock tokens) of an MoE GPT, and the
   model FLOP/s by Megatron's formula with top-k experts (i.e. counting the active
   parameters only); on a CPU there is no peak to divide by, so it is given as
   GFLOP/s rather than MFU.

All sides run in this process with the same `torch.get_num_threads()`, alternating,
and the median of the repeats is reported. Written to `bench/results/moe-cpu.md` with
the machine, its load and the thread count.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _alternate(fns: list, repeats: int) -> list[float]:
    """Median seconds of each function, run in turn (one warm-up each) so load hits all alike."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            times[i].append(_timed(fn))
    return [statistics.median(t) for t in times]


def _layers(hidden: int, ffn: int, experts: int, topk: int):
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from mg.core.models import TransformerConfig
    from mg.core.models.moe import MoELayer

    hf = MixtralSparseMoeBlock(
        MixtralConfig(
            hidden_size=hidden,
            intermediate_size=ffn,
            num_local_experts=experts,
            num_experts_per_tok=topk,
            num_attention_heads=8,
            router_jitter_noise=0.0,
        )
    )
    torch.manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.02)
    ours = {}
    for grouped in (False, True):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=hidden,
            num_attention_heads=8,
            vocab_size=128,
            activation="swiglu",
            add_bias_linear=False,
            num_moe_experts=experts,
            moe_ffn_hidden_size=ffn,
            moe_router_topk=topk,
            moe_grouped_gemm=grouped,
        )
        layer = MoELayer(config)
        with torch.no_grad():
            layer.router.weight.copy_(hf.gate.weight)
            for e in range(experts):
                up, down = hf.experts.gate_up_proj[e], hf.experts.down_proj[e]
                if grouped:
                    layer.experts.linear_fc1.get_parameter(f"weight{e}").copy_(up)
                    layer.experts.linear_fc2.get_parameter(f"weight{e}").copy_(down)
                else:
                    layer.experts.local_experts[e].linear_fc1.weight.copy_(up)
                    layer.experts.local_experts[e].linear_fc2.weight.copy_(down)
        ours["grouped" if grouped else "sequential"] = layer
    return ours["sequential"], ours["grouped"], hf


def bench_layer(quick: bool, repeats: int, dtype: torch.dtype = torch.float32) -> list[str]:
    hidden, ffn, experts, topk = (256, 512, 8, 2) if quick else (1024, 3584, 8, 2)
    batch, seq = (2, 128) if quick else (4, 512)
    sequential, grouped, hf = _layers(hidden, ffn, experts, topk)
    x = torch.randn(batch, seq, hidden)
    with torch.no_grad():
        ref = hf(x)
        for layer in (sequential, grouped):
            torch.testing.assert_close(layer(x), ref, rtol=1e-4, atol=1e-5)
    if dtype != torch.float32:  # checked in fp32 above; then every side in `dtype`
        x = x.to(dtype)
        for layer in (sequential, grouped, hf):
            layer.to(dtype)
    tokens = batch * seq
    sides = {
        "ours, sequential experts": sequential,
        "ours, grouped GEMM": grouped,
        "transformers": hf,
    }
    rows = [
        f"Shapes: hidden {hidden}, expert ffn {ffn}, {experts} experts, top-{topk}, "
        f"{batch}x{seq} = {tokens} tokens, {_name(dtype)}; outputs checked equal (fp32, 1e-4) "
        "first.",
        "",
        "| pass | ours, sequential | ours, grouped GEMM | transformers Mixtral | "
        "grouped / transformers | sequential / transformers |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]

    def forward(layer):
        def run():
            with torch.no_grad():
                layer(x)

        return run

    def train(layer):
        xg = x.clone().requires_grad_()

        def run():
            layer(xg).square().mean().backward()

        return run

    for name, make in (("forward", forward), ("forward + backward", train)):
        seconds = _alternate([make(m) for m in sides.values()], repeats)
        rate = [tokens / s for s in seconds]
        rows.append(
            f"| {name} | {rate[0]:,.0f} tok/s | {rate[1]:,.0f} tok/s | {rate[2]:,.0f} tok/s | "
            f"{rate[1] / rate[2]:.2f}x | {rate[0] / rate[2]:.2f}x |"
        )
    return rows


def _moe_gpt(layers: int, hidden: int, seq: int, vocab: int, grouped: bool):
    from mg.core.models import TransformerConfig

    return TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=8,
        vocab_size=vocab,
        ffn_hidden_size=4 * hidden,
        seq_length=seq,
        activation="swiglu",
        normalization="RMSNorm",
        position_embedding_type="rope",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        num_moe_experts=8,
        moe_ffn_hidden_size=2 * hidden,
        moe_router_topk=2,
        moe_aux_loss_coeff=1e-2,
        moe_grouped_gemm=grouped,
    )


def _name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def _train_step(config, batch: int, seq: int, dtype: torch.dtype):
    from mg.core.models import GPTModel

    torch.manual_seed(0)
    model = GPTModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (batch, seq))
    bf16 = dtype == torch.bfloat16

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):  # as mg-train --bf16
            loss = model(ids, labels=ids).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def bench_training(quick: bool, repeats: int, dtype: torch.dtype = torch.float32) -> list[str]:
    from mg.core.models.flops import num_floating_point_operations, num_parameters

    layers, hidden, vocab = (2, 128, 1024) if quick else (4, 512, 32000)
    batch, seq = (2, 64) if quick else (4, 256)
    configs = [_moe_gpt(layers, hidden, seq, vocab, grouped) for grouped in (False, True)]
    seconds = _alternate([_train_step(c, batch, seq, dtype) for c in configs], repeats)
    rows = [
        "| model | total params | active params | tokens/s | model GFLOP/s (top-k) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for config, secs in zip(configs, seconds, strict=True):
        flops = num_floating_point_operations(config, batch, seq)
        kind = "grouped" if config.moe_grouped_gemm else "sequential"
        rows.append(
            f"| {layers} layers, h {hidden}, 8 experts top-2, {kind} | "
            f"{num_parameters(config) / 1e6:.1f} M | "
            f"{num_parameters(config, active=True) / 1e6:.1f} M | {batch * seq / secs:,.0f} | "
            f"{flops / secs / 1e9:.1f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--bf16", action="store_true",
        help="also the bf16 sections (every side in bf16; training under bf16 autocast)",
    )  # fmt: skip
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "moe-cpu.md"))
    args = parser.parse_args()
    load = os.getloadavg()
    header = [
        "# MoE layer and MoE GPT training on CPU",
        "",
        f"Machine: {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads on every side; "
        f"load average at start {load[0]:.1f}, {load[1]:.1f}, {load[2]:.1f} (a shared box: "
        "compare the ratios, which are measured side by side, not the absolute rates).",
        f"Median of {args.repeats} alternating repeats.",
        "",
        "## MoE layer: ours vs transformers' MixtralSparseMoeBlock",
        "",
    ]
    lines = header + bench_layer(args.quick, args.repeats)
    lines += ["", "## MoE GPT, one AdamW step (fp32)", ""]
    lines += bench_training(args.quick, args.repeats)
    if args.bf16:
        lines += ["", "## MoE layer in bf16: ours vs transformers' MixtralSparseMoeBlock", ""]
        lines += bench_layer(args.quick, args.repeats, torch.bfloat16)
        lines += ["", "## MoE GPT, one AdamW step (bf16 autocast)", ""]
        lines += bench_training(args.quick, args.repeats, torch.bfloat16)
    text = "\n".join(lines)
    print(text)
    if not args.quick:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
