"""One-command GPU benchmark: Megatron's 1.3B GPT trained by mg-train, MFU per iteration.

    uv run --frozen python bench/bench_gpu.py                 # every GPU of this machine
    uv run --frozen python bench/bench_gpu.py --iters 30 --micro-batch-size 4
    uv run --frozen python bench/bench_gpu.py --device cpu    # a tiny smoke run, no GPU needed

It trains the 1.3B shape of Megatron's GPT tables (24 layers, hidden 2048, 16
heads, sequence 2048, GPT-2's 50,257-token vocabulary padded to 50,304) with
`mg-train` itself (the Trainer, on mock data, no dropout, Adam), under `torchrun`
on all visible GPUs (with `--cross-entropy-loss-fusion`, and `--overlap-grad-reduce`
on several GPUs), in these runs:

    bf16            --bf16 (PyTorch SDPA, flash kernel where it applies)
    bf16 + compile  --bf16 --torch-compile (inductor fuses each layer's elementwise ops)
    bf16 + FSDP2    --bf16 --use-torch-fsdp2 --data-parallel-sharding-strategy
                    optim_grads_params (ZeRO-3 on torch's fully_shard, a unit a layer),
                    --untie-embeddings-and-output-weights as Megatron requires with FSDP2
                    (the same FLOPs a step; 103M more parameters)
    fp8 + compile   --bf16 --torch-compile, FP8 through torchao (--transformer-impl local
                    --fp8-format hybrid --fp8-recipe tensorwise), as torchtitan runs it
    TE bf16         --bf16 --transformer-impl transformer_engine      (TE installed)
    TE fp8          ... --fp8-format hybrid, delayed scaling, amax history 1024 / max,
                    as Megatron's llama3 FP8 example                     (TE installed)

Every iteration's time gives TFLOP/s per GPU and MFU with Megatron's FLOPs formula
(`mg.core.models.flops.num_floating_point_operations`, the trainer's own numerator)
against the GPU's dense bf16 peak (FP8 runs too, so their MFU says how much of the
bf16 peak the FP8 run reaches, as Megatron reports it). The median over the iterations
after `--warmup` is the headline. Results go to `bench/results/gpu-<device>.md`.

Without CUDA it prints why and exits 0 (so `just bench-gpu` is safe anywhere);
`--device cpu` runs a tiny shape on the CPU instead (the smoke test of the arithmetic).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"

# Megatron's 1.3B GPT (its GPT tables' 24 x 2048 row), sequence 2048.
SHAPE_1P3B = [
    "--num-layers",
    "24",
    "--hidden-size",
    "2048",
    "--num-attention-heads",
    "16",
    "--seq-length",
    "2048",
    "--max-position-embeddings",
    "2048",
    "--vocab-size",
    "50257",
]
SHAPE_SMOKE = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--vocab-size",
    "127",
    "--distributed-backend",
    "gloo",
]
TE = ["--transformer-impl", "transformer_engine"]
TORCHAO_FP8 = [
    "--transformer-impl",
    "local",
    "--fp8-format",
    "hybrid",
    "--fp8-recipe",
    "tensorwise",
]
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "1024"]
FP8 += ["--fp8-amax-compute-algo", "max"]
# Every GPU run: the fused output layer + cross-entropy (no fp32 logits tensor), as
# Megatron's GPT recipes use it; with several GPUs, gradients reduced during backward.
COMMON = ["--cross-entropy-loss-fusion"]
VARIANTS: dict[str, list[str]] = {
    "bf16": ["--bf16"],
    "bf16 + compile": ["--bf16", "--torch-compile"],
    "bf16 + FSDP2": [
        "--bf16",
        "--use-torch-fsdp2",
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "--untie-embeddings-and-output-weights",
    ],
    "fp8 + compile": ["--bf16", "--torch-compile", *TORCHAO_FP8],
    "TE bf16": ["--bf16", *TE],
    "TE fp8": ["--bf16", *TE, *FP8],
}


def train_argv(shape: list[str], mbs: int, gbs: int, iters: int, extra: list[str]) -> list[str]:
    """mg-train's argument list for one run (mock data, no evaluation, log every step)."""
    return [
        "gpt",
        *shape,
        "--mock-data",
        "--micro-batch-size",
        str(mbs),
        "--global-batch-size",
        str(gbs),
        "--train-iters",
        str(iters),
        "--lr",
        "1e-4",
        "--min-lr",
        "1e-5",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        str(min(2, iters - 1)),
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--log-interval",
        "1",
        "--eval-iters",
        "0",
        "--seed",
        "1234",
        *extra,
    ]


# --- one run (a torchrun worker, or in-process) ---------------------------------------------


def run_training(argv: list[str], out: Path | None) -> dict[str, Any]:
    """Train with mg-train's Trainer, timing each iteration; rank 0 writes the record."""
    import torch

    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = Trainer(parse_args(argv, world_size=world))
    device = trainer.env.device
    times: list[float] = []
    last = [time.perf_counter()]

    def on_iteration(_: Trainer) -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        now = time.perf_counter()
        times.append(now - last[0])
        last[0] = now

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    result = trainer.train(on_iteration=on_iteration)
    record = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": trainer.env.world_size,
        "peak_tflops": trainer.peak,
        "config": trainer.model_config.to_dict(),
        "global_batch_size": trainer.args.training.global_batch_size,
        "micro_batch_size": trainer.args.training.micro_batch_size,
        "seq_length": trainer.args.model.seq_length,
        "seconds": times,
        "losses": result.losses,
        "max_memory_gib": (
            torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
        ),
    }
    if out is not None and trainer.env.rank == 0:
        out.write_text(json.dumps(record))
    return record


def launch(argv: list[str], gpus: int, workdir: Path) -> dict[str, Any]:
    """One run under torchrun on `gpus` GPUs, in its own processes (memory freed after)."""
    out = workdir / "record.json"
    out.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={gpus}",
        __file__,
        "--worker",
        str(out),
        *argv,
    ]
    done = subprocess.run(command, text=True, capture_output=True)
    if done.returncode != 0 or not out.exists():
        tail = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"run failed (exit {done.returncode}):\n{tail}")
    return json.loads(out.read_text())


# --- MFU ------------------------------------------------------------------------------------


def per_iteration(record: dict[str, Any]) -> list[dict[str, float]]:
    """Each iteration's seconds, tokens/s/GPU, TFLOP/s/GPU and MFU (Megatron's formula)."""
    from mg.core.models import TransformerConfig
    from mg.core.models.flops import num_floating_point_operations, throughput_tflops_per_gpu

    config = TransformerConfig.from_dict(record["config"])
    gbs, seq, world = record["global_batch_size"], record["seq_length"], record["world_size"]
    flops = num_floating_point_operations(config, gbs, seq)
    rows = []
    for seconds in record["seconds"]:
        tflops = throughput_tflops_per_gpu(flops, seconds, world)
        peak = record["peak_tflops"]
        rows.append(
            {
                "seconds": seconds,
                "tokens_per_s_per_gpu": gbs * seq / seconds / world,
                "tflops_per_gpu": tflops,
                "mfu": tflops / peak if peak else float("nan"),
            }
        )
    return rows


def summary(record: dict[str, Any], warmup: int) -> dict[str, float]:
    """Medians over the iterations after the first `warmup`."""
    rows = per_iteration(record)[warmup:] or per_iteration(record)
    return {key: statistics.median(r[key] for r in rows) for key in rows[0]}


# --- the report -----------------------------------------------------------------------------


def torch_version() -> str:
    import torch

    return torch.__version__


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def describe(record: dict[str, Any]) -> str:
    c = record["config"]
    return (
        f"{c['num_layers']} layers x {c['hidden_size']} hidden, {c['num_attention_heads']} "
        f"heads, sequence {record['seq_length']}, vocabulary {c['vocab_size']:,} (padded)"
    )


def report(
    records: dict[str, dict[str, Any]], errors: dict[str, str], warmup: int, title: str
) -> str:
    first = next(iter(records.values()), None)
    device = first["device"] if first else "?"
    lines = [
        f"# GPU benchmark: {title} on {device}",
        "",
        "Written by `bench/bench_gpu.py` (`just bench-gpu`): mg-train on mock data, "
        f"{describe(first) if first else ''}, no dropout, Adam, fp32 main weights; MFU = "
        "Megatron's FLOPs per iteration / (iteration time x GPUs x dense bf16 peak; a "
        "CPU's FP32 estimate), median over the iterations after the first "
        f"{warmup}. `torch` {torch_version()}.",
        "",
        *table(records, errors, warmup),
        "",
        "Per iteration (MFU):",
        "",
    ]
    for name, record in records.items():
        mfus = " ".join(f"{r['mfu']:.1%}" for r in per_iteration(record))
        losses = " ".join(f"{x:.3f}" for x in record["losses"])
        lines += [f"- {name}: {mfus}", f"  - lm loss: {losses}"]
    return "\n".join(lines) + "\n"


def table(records: dict[str, dict[str, Any]], errors: dict[str, str], warmup: int) -> list[str]:
    """The runs' table (medians after `warmup` iterations), a failed run's error in its row."""
    lines = [
        "| run | GPUs | MBS | GBS | s/iter | tokens/s/GPU | TFLOP/s/GPU | MFU | max mem GiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, record in records.items():
        s = summary(record, warmup)
        memory = record["max_memory_gib"]
        lines.append(
            f"| {name} | {record['world_size']} | {record['micro_batch_size']} | "
            f"{record['global_batch_size']} | {s['seconds']:.3f} | "
            f"{s['tokens_per_s_per_gpu']:,.0f} | {s['tflops_per_gpu']:.1f} | "
            f"{s['mfu']:.1%} | {memory:.1f} |"
            if memory is not None
            else f"| {name} | {record['world_size']} | {record['micro_batch_size']} | "
            f"{record['global_batch_size']} | {s['seconds']:.3f} | "
            f"{s['tokens_per_s_per_gpu']:,.0f} | {s['tflops_per_gpu']:.3f} | "
            f"{s['mfu']:.1%} | - |"
        )
    for name, error in errors.items():
        lines.append(f"| {name} | failed: {error} | | | | | | | |")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:  # a torchrun worker: --worker OUT <mg-train argv>
        run_training(argv[2:], Path(argv[1]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--iters", type=int, default=20, help="Training iterations per run.")
    p.add_argument("--warmup", type=int, default=5, help="Iterations left out of the median.")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--accumulation", type=int, default=4, help="Micro-batches per step per GPU.")
    p.add_argument("--gpus", type=int, help="GPUs to use (default: all visible).")
    p.add_argument("--runs", nargs="+", choices=list(VARIANTS), help="Default: all that apply.")
    p.add_argument("--output", type=Path, help="Default: bench/results/gpu-<device>.md.")
    p.add_argument("--records", type=Path, help="Also write each run's record here (JSON).")
    opts = p.parse_args(argv)

    import torch

    if opts.device == "cpu":
        return smoke(opts)
    if not torch.cuda.is_available():
        print(
            "bench_gpu: no CUDA device here; nothing to measure (use --device cpu for a smoke run)"
        )
        return 0
    from mg.core.models.float8_training import torchao_installed
    from mg.core.models.te_spec import transformer_engine_installed

    gpus = opts.gpus or torch.cuda.device_count()
    names = opts.runs or [n for n in VARIANTS if transformer_engine_installed() or "TE" not in n]
    if not opts.runs and not torchao_installed():
        names.remove("fp8 + compile")
    mbs = opts.micro_batch_size
    gbs = mbs * gpus * opts.accumulation
    records, errors = {}, {}
    with tempfile.TemporaryDirectory() as work:
        for name in names:
            extra = [*COMMON, *(["--overlap-grad-reduce"] if gpus > 1 else []), *VARIANTS[name]]
            train = train_argv(SHAPE_1P3B, mbs, gbs, opts.iters, extra)
            print(f"bench_gpu: {name} on {gpus} GPU(s), MBS {mbs}, GBS {gbs}", flush=True)
            try:
                records[name] = launch(train, gpus, Path(work))
            except RuntimeError as err:
                errors[name] = str(err).splitlines()[-1][:200]
                print(f"bench_gpu: {name} failed:\n{err}", flush=True)
                continue
            keep_record(opts.records, name, records[name])
            s = summary(records[name], opts.warmup)
            print(
                f"bench_gpu: {name}: {s['tflops_per_gpu']:.1f} TFLOP/s/GPU, MFU {s['mfu']:.1%}",
                flush=True,
            )
    if not records:
        return 1
    text = report(records, errors, opts.warmup, "Megatron's 1.3B GPT")
    device = next(iter(records.values()))["device"]
    output = opts.output or RESULTS / f"gpu-{device_slug(device)}.md"
    output.write_text(text)
    print(text)
    print(f"bench_gpu: wrote {output}")
    return 0


def smoke(opts: argparse.Namespace) -> int:
    """A tiny shape on the CPU, in this process: the same record, report and arithmetic;
    with `--runs`, those runs (FP8 with torchao's matmuls emulated), else one fp32 run."""
    mbs = opts.micro_batch_size
    runs = {name: VARIANTS[name] for name in opts.runs or []} or {"fp32 (cpu smoke)": []}
    records = {}
    for name, extra in runs.items():
        if "--fp8-format" in extra:
            os.environ["MG_FP8_EMULATE"] = "1"  # no FP8 matmuls on a CPU
        train = train_argv(SHAPE_SMOKE, mbs, mbs * opts.accumulation, opts.iters, extra)
        records[name] = run_training(train, None)
        keep_record(opts.records, name, records[name])
    text = report(records, {}, opts.warmup, "a tiny GPT (smoke run)")
    if opts.output is not None:
        opts.output.write_text(text)
        opts.output.with_suffix(".json").write_text(json.dumps(next(iter(records.values()))))
    print(text)
    return 0


def keep_record(folder: Path | None, name: str, record: dict[str, Any]) -> None:
    """`record` as `folder/record-<run>.json`, its run's name inside (for gpu_check.py)."""
    if folder is not None:
        path = folder / f"record-{device_slug(name)}.json"
        path.write_text(json.dumps({**record, "run": name}))


if __name__ == "__main__":
    sys.exit(main())
