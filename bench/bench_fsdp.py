"""Per-rank memory of fully sharded data parallelism at DP=4, per strategy, against DDP.

    uv run --frozen python bench/bench_fsdp.py            # GPT, ~125M params
    uv run --frozen python bench/bench_fsdp.py --quick    # a small model, for a smoke run

One GPT config (fp32, AdamW, mock data, micro-batch 1, 2 micro-batches per rank) runs
as 4 gloo ranks on this machine for each data-parallel path: plain DDP, the
distributed optimizer, and FSDP (`--use-megatron-fsdp`) at each
`--data-parallel-sharding-strategy`. Each rank measures its phases as
`bench_scale.py` does (the kernel's peak-RSS mark reset before a phase, VmHWM read
after it, GB, imports included):

- build: `Trainer(args)` (layout, model: under FSDP sharded before it gets storage,
  optimizer, data);
- step: two training iterations (the first allocates Adam's state); the RSS after it
  is the rank's resident training state;
- save: a checkpoint (`torch_dist`, or `fsdp_dtensor` under FSDP).

glibc keeps freed heap memory (and raises its mmap threshold as large blocks are
freed), which would count FSDP's transient all-gather and reduce-scatter buffers
as resident: the ranks run with a fixed `MALLOC_MMAP_THRESHOLD_` (large blocks are
mapped and returned when freed) and `malloc_trim(0)` before the resident state is read.

Written to `bench/results/fsdp-cpu.md` with the dry run's plan of each FSDP strategy
(weights + gradients + optimizer state per rank) beside the measured resident state
over the single-rank-copy baseline (what a rank holds before the model is built).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
PATHS = {
    "DDP": [],
    "distributed optimizer": ["--use-distributed-optimizer"],
    **{
        f"FSDP {s}": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", s]
        for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")
    },
}


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class Phases:
    """Peak RSS (bytes) and wall time (s) per phase of this process."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, float]] = {"baseline": {"rss_after": _status("VmRSS")}}

    def run(self, name: str, work):
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        start = time.perf_counter()
        out = work()
        self.results[name] = {
            "peak": _status("VmHWM"),
            "seconds": time.perf_counter() - start,
            "rss_after": _status("VmRSS"),
        }
        return out


def _argv(model: dict, flags: list[str], save: str) -> list[str]:
    fsdp = "--use-megatron-fsdp" in flags
    return [
        "gpt",
        "--num-layers", str(model["layers"]),
        "--hidden-size", str(model["hidden"]),
        "--num-attention-heads", str(model["heads"]),
        "--seq-length", str(model["seq"]),
        "--max-position-embeddings", str(model["seq"]),
        "--mock-data", "--vocab-size", str(model["vocab"]),
        "--micro-batch-size", "1", "--global-batch-size", str(2 * WORLD),
        "--train-iters", "3", "--lr", "1e-4", "--log-interval", "1000", "--eval-iters", "0",
        "--hidden-dropout", "0", "--attention-dropout", "0",
        "--data-cache-path", model["cache"], "--save", save,
        "--ckpt-format", "fsdp_dtensor" if fsdp else "torch_dist",
        *flags,
    ]  # fmt: skip


def _worker(spec_path: str) -> None:
    """One rank: the phases of one data-parallel path; writes rank<R>.json beside the spec."""
    spec = json.loads(Path(spec_path).read_text())
    phases = Phases()
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    phases.results["baseline"] = {"rss_after": _status("VmRSS")}  # imports, no model
    rank = int(os.environ["RANK"])
    args = parse_args(_argv(spec["model"], spec["flags"], spec["save"]), world_size=WORLD)
    trainer = phases.run("build", lambda: Trainer(args))
    phases.run("step", lambda: (trainer.train_step(), trainer.train_step()))
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what is live, not what glibc kept
    phases.results["step"]["rss_after"] = _status("VmRSS")
    trainer.state.iteration = 2
    phases.run("save", lambda: (trainer.save(), trainer.finish_saves()))
    dist.barrier()
    Path(spec_path).parent.joinpath(f"rank{rank}.json").write_text(json.dumps(phases.results))
    dist.destroy_process_group()


def _launch(spec: dict, folder: Path, threads: int) -> list[dict]:
    sys.path.insert(0, str(ROOT / "packages" / "core" / "src"))
    from mg.core.testing.launch import run_ranks

    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {"OMP_NUM_THREADS": str(threads), "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    outcomes = run_ranks(__file__, WORLD, ["--worker", str(spec_path)], timeout=3600, env=env)
    for r, o in enumerate(outcomes):
        if o.returncode != 0:
            raise SystemExit(f"rank {r} of {spec['name']} failed:\n{o.log[-4000:]}")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _planned(model: dict, strategy: str) -> float:
    """The dry run's weights + gradients + optimizer state per rank (bytes)."""
    from mg.trainer.arguments import parse_args
    from mg.trainer.dry_run import estimate
    from mg.trainer.fsdp_dry_run import per_rank_bytes

    flags = ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy, "--dry-run"]
    args = parse_args(_argv(model, flags, "unused"), world_size=WORLD)
    from mg.trainer.families import get_family
    from mg.trainer.padded_vocab import padded_vocab_size

    config = get_family("gpt").build_config(args, padded_vocab_size(args))
    parameters = estimate(args, config).most_loaded.parameters
    parts = per_rank_bytes(strategy, parameters, WORLD, 4, 0, 0, prefetch=False)
    return parts["weights"] + parts["gradients"] + parts["optimizer state"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model (smoke run)")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        _worker(options.worker)
        return
    work = Path(tempfile.mkdtemp(prefix="bench_fsdp_"))
    model = (
        {"layers": 2, "hidden": 128, "heads": 4, "seq": 64, "vocab": 8192}
        if options.quick
        else {"layers": 12, "hidden": 768, "heads": 12, "seq": 128, "vocab": 50304}
    )
    model["cache"] = str(work / "cache")
    h, layers, vocab, seq = model["hidden"], model["layers"], model["vocab"], model["seq"]
    params = layers * (12 * h * h + 13 * h) + vocab * h + seq * h + 2 * h
    rows = {}
    for name, flags in PATHS.items():
        print(f"{name} ...", flush=True)
        spec = {"name": name, "model": model, "flags": flags, "save": str(work / name)}
        rows[name] = _launch(spec, work / name.replace(" ", "_"), options.threads)
    lines = [
        "# Per-rank memory of fully sharded data parallelism (DP=4)",
        "",
        f"GPT, {layers} layers, hidden {h}, vocab {vocab}, seq {seq}: {params / 1e6:.0f}M "
        "parameters, fp32, AdamW, micro-batch 1, 2 micro-batches per rank, 4 gloo ranks on "
        f"one machine ({platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS="
        f"{options.threads} per rank), `bench/bench_fsdp.py{' --quick' if options.quick else ''}`.",
        "",
        "Peak RSS in GB of the largest rank per phase (imports included); resident state: "
        "the RSS after two steps over the rank's RSS before the model (imports only); plan: "
        "the dry run's weights + gradients + optimizer state per rank.",
        "",
        "| path | build | step | save | resident state | plan | step time (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, ranks in rows.items():

        def worst(phase: str, key: str = "peak", ranks=ranks) -> float:
            return max(r[phase][key] for r in ranks)

        state = max(r["step"]["rss_after"] - r["baseline"]["rss_after"] for r in ranks)
        plan = "-"
        if name.startswith("FSDP"):
            plan = f"{_planned(model, name.split()[1]) / 1e9:.2f}"
        lines.append(
            f"| {name} | {worst('build') / 1e9:.2f} | {worst('step') / 1e9:.2f} | "
            f"{worst('save') / 1e9:.2f} | {state / 1e9:.2f} | {plan} | "
            f"{worst('step', 'seconds') / 2:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    out = ROOT / "bench" / "results" / ("fsdp-cpu-quick.md" if options.quick else "fsdp-cpu.md")
    out.write_text(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
