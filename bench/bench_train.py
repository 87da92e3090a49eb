"""Training tokens/s of our GPT (mg-train's step) vs HF transformers' GPT2LMHeadModel.

Same process, same shapes, same random batches, same optimizer settings
(AdamW lr 1e-4, betas 0.9/0.999, eps 1e-8, wd 0.01, clip 1.0), dropout 0 in
both, same thread count. For each dtype (bf16 = torch.autocast(bfloat16) as
mg-train does, fp32 = no autocast) it times `--steps` steps after `--warmup`
steps, alternating ours/HF in `--rounds` rounds so that load from other jobs on
the machine hits both, and reports the median step time of each. Before each round and
after the last it reads the machine's GEMM and memory speed (bench/machine_probe.py):
readings more than 10% apart mark the run as not a result.

Ours is the trainer's own step, piece by piece (`Trainer.train_step` needs a
whole `Trainer` with datasets, so its body is replayed with the trainer's
functions): zero_grad → autocast(`gpt_loss_terms`) → masked mean → backward →
`clip_grad_norm` (a NaN norm skips the step; no per-gradient inf scan without fp16)
→ `build_optimizer`'s AdamW step.

    uv run --frozen python bench/bench_train.py                      # ~50M params, seq 512
    uv run --frozen python bench/bench_train.py --layers 4 --hidden 256 --seq 256 --steps 5
    uv run --frozen python bench/bench_train.py --profile            # + top ops of each

HF's AdamW is fused as ours (`fused=True`: transformers' `adamw_torch_fused`). `--isa avx2`
runs both sides as a CPU with AVX2 only would (`isa_cap.py`: MKL, oneDNN and PyTorch's
kernels capped), and the first line names the CPU and the cap.

Ours runs as plain `mg-train` and with `--cross-entropy-loss-fusion`; `--compile` adds
a run with `--torch-compile` too (the compilation is in the warmup, not timed).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import isa_cap
import machine_probe
import torch
from torch import nn

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.compile import compile_layers
from mg.core.models.flops import num_floating_point_operations, num_parameters
from mg.core.models.fused_cross_entropy import apply_cross_entropy_fusion
from mg.trainer.arguments import OptimizerArgs
from mg.trainer.families import gpt_loss_terms
from mg.trainer.optimizer import build_optimizer, clip_grad_norm, param_groups
from mg.trainer.training import _autocast

LR, BETAS, EPS, WD, CLIP = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0


def make_batch(b: int, s: int, vocab: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, vocab, (b, s + 1), generator=gen)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": torch.ones(b, s),
        "position_ids": torch.arange(s).expand(b, s),
    }


class Ours:
    """mg-train's step: `Trainer.train_step` with one micro-batch, scale 1 (bf16/fp32);
    `fused_loss` as `--cross-entropy-loss-fusion`, `compiled` as `--torch-compile`."""

    def __init__(
        self,
        config: TransformerConfig,
        dtype: torch.dtype | None,
        fused_loss: bool = False,
        compiled: bool = False,
    ) -> None:
        torch.manual_seed(0)
        self.name = "ours" + ("+fused-ce" if fused_loss else "") + ("+compile" if compiled else "")
        self.model = GPTModel(config)
        if fused_loss:
            apply_cross_entropy_fusion(self.model)
        if compiled:
            compile_layers(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(
            self.model,
            OptimizerArgs(
                lr=LR,
                weight_decay=WD,
                clip_grad=CLIP,
                adam_beta1=BETAS[0],
                adam_beta2=BETAS[1],
                adam_eps=EPS,
            ),
        )
        self.dtype = dtype
        self.device = torch.device("cpu")

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with _autocast(self.device, self.dtype):
            micro_sum, micro_tokens = gpt_loss_terms(self.model, batch)
        loss = micro_sum / micro_tokens.clamp(min=1)
        loss.backward()
        if math.isfinite(clip_grad_norm(self.model, CLIP)):  # no inf scan without fp16
            self.optimizer.step()
        return float(loss.detach())


class HF:
    """A plain PyTorch loop around transformers' GPT2LMHeadModel (sdpa attention)."""

    name = "HF"

    def __init__(self, config: TransformerConfig, dtype: torch.dtype | None) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        torch.manual_seed(0)
        hf_config = GPT2Config(
            n_layer=config.num_layers,
            n_embd=config.hidden_size,
            n_head=config.num_attention_heads,
            n_positions=config.max_position_embeddings,
            vocab_size=config.vocab_size,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
        )
        self.model = GPT2LMHeadModel(hf_config)
        assert self.model.config._attn_implementation == "sdpa"
        # Same AdamW and decay groups as ours (the groups do not change the cost), fused as
        # ours is: transformers' own best, `optim="adamw_torch_fused"`.
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, WD), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True
        )
        self.dtype = dtype

    def step(self, batch: dict[str, torch.Tensor]) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        with _autocast(torch.device("cpu"), self.dtype):
            # HF shifts labels itself: pass the inputs as labels.
            loss = self.model(input_ids=batch["tokens"], labels=batch["tokens"]).loss
        loss.backward()
        nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        return float(loss.detach())


def n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def time_steps(runner, batches: list[dict[str, torch.Tensor]]) -> list[float]:
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        runner.step(batch)
        times.append(time.perf_counter() - t0)
    return times


def profile(runner, batch: dict[str, torch.Tensor], rows: int) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    runner.step(batch)
    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step(batch)
    print(f"\n--- {runner.name} ({runner.dtype}): top ops by self CPU time, one step ---")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="ours/HF alternations per dtype")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--compile", action="store_true", help="also time ours with --torch-compile")
    p.add_argument("--profile", action="store_true", help="print top ops of one step of each")
    p.add_argument("--profile-rows", type=int, default=15)
    p.add_argument(
        "--isa",
        choices=isa_cap.CHOICES,
        default="native",
        help="run both sides as a CPU with only this instruction set would (bench/isa_cap.py)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="on both sides")
    args = p.parse_args()
    isa_cap.apply(args.isa)

    torch.set_num_threads(args.threads)
    print(isa_cap.describe(args.isa))
    config = TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        num_attention_heads=args.heads,
        vocab_size=args.vocab,
        seq_length=args.seq,
        max_position_embeddings=args.seq,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    b, s = args.micro_batch, args.seq
    flops = num_floating_point_operations(config, b, s)
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"cpu_count {os.cpu_count()}\n"
        f"config: layers {args.layers}, hidden {args.hidden}, heads {args.heads}, "
        f"seq {s}, micro-batch {b}, vocab {args.vocab}\n"
        f"parameters (num_parameters): {num_parameters(config):,} "
        f"({num_parameters(config, include_embeddings=False):,} non-embedding)\n"
        f"model FLOPs per step (Megatron formula): {flops / 1e9:.1f} GFLOP\n"
        f"warmup {args.warmup}, timed {args.steps} x {args.rounds} rounds per model"
    )
    gen = torch.Generator().manual_seed(1234)
    batches = [make_batch(b, s, args.vocab, gen) for _ in range(args.steps)]
    rows = []
    readings: list[machine_probe.Reading] = []
    for name in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp32": None}[name.strip()]
        runners = [Ours(config, dtype), Ours(config, dtype, fused_loss=True), HF(config, dtype)]
        if args.compile:
            runners.insert(2, Ours(config, dtype, fused_loss=True, compiled=True))
        assert n_params(runners[0].model) == num_parameters(config), "num_parameters mismatch"
        print(
            f"\n[{name}] params ours {n_params(runners[0].model):,}, "
            f"HF {n_params(runners[-1].model):,}"
        )
        for r in runners:
            t0 = time.perf_counter()
            time_steps(r, batches[: args.warmup] if args.warmup <= args.steps else batches)
            print(f"  warmup {r.name}: {time.perf_counter() - t0:.1f}s (compilation included)")
        times: dict[str, list[float]] = {r.name: [] for r in runners}
        for rnd in range(args.rounds):
            machine_probe.read_into(readings, args.threads, f"before round {rnd}")
            for r in runners if rnd % 2 == 0 else runners[::-1]:
                t = time_steps(r, batches)
                times[r.name] += t
                print(f"  round {rnd} {r.name:>4}: " + " ".join(f"{x:.2f}s" for x in t))
        machine_probe.read_into(readings, args.threads, "after the rounds")
        med = {k: statistics.median(v) for k, v in times.items()}
        tps = {k: b * s / v for k, v in med.items()}
        for who in [r.name for r in runners if r.name != "HF"]:
            rows.append((name, who, tps[who], tps["HF"], flops / med[who] / 1e12, med))
        if args.profile:
            for r in runners:
                profile(r, batches[0], args.profile_rows)
        del runners

    print("\n| dtype | ours | ours tok/s | HF tok/s | ours/HF | ours TFLOP/s | MFU |")
    print("| --- | --- | ---: | ---: | ---: | ---: | --- |")
    for name, who, ours, hf, tflops, _med in rows:
        print(
            f"| {name} | {who} | {ours:,.0f} | {hf:,.0f} | {ours / hf:.2f}x | {tflops:.3f} "
            f"| n/a (no CPU peak table) |"
        )
    print(
        "(median step time: "
        + ", ".join(f"{r[0]} {r[1]} {r[5][r[1]]:.2f}s / HF {r[5]['HF']:.2f}s" for r in rows)
        + ")"
    )
    print(machine_probe.verdict(readings))


if __name__ == "__main__":
    main()
