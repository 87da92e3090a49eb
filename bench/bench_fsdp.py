"""Per-rank memory of fully sharded data parallelism at DP=4, per strategy, against DDP.

    uv run --frozen python bench/bench_fsdp.py                 # GPT, ~125M params, every path
    uv run --frozen python bench/bench_fsdp.py --model 275m    # one process + the FSDP paths
    uv run --frozen python bench/bench_fsdp.py --model 757m    # bench_scale.py's 757M GPT
    uv run --frozen python bench/bench_fsdp.py --quick         # a small model, for a smoke run
    uv run --frozen python bench/bench_fsdp.py --throughput    # tokens/s at DP=2: FSDP vs ZeRO-1

The larger models run a single-process baseline (the distributed optimizer on one
rank, bench_scale.py's "TP=1 PP=1 sharded" path) and FSDP `optim_grads_params`
(ZeRO-3), and report each rank's training peak over the baseline's; the 275M model
also runs `optim_grads` and `optim` (whole weights on each rank from a unit's forward
to its backward, sharded between steps). `no_shard` would need four whole copies of
the model's training state on one machine: its plan is printed instead, as for a
path whose ranks fail (e.g. killed for memory), with the reason.

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
Throughput runs leave the allocator at its defaults, as a user runs.

`--throughput` times training instead, at DP=2 (2 gloo ranks): the distributed
optimizer (ZeRO-1) and FSDP `optim_grads_params` / `optim_grads` (or `--paths`) on the
same model and batches (`--micro-batch-size`, `--micro-batches` per rank, `--overlap`
for both sides' overlap flags), each path launched --repeats times in turn (A B C A B
C ...), 2 warm-up steps and then --steps timed ones between barriers; tokens/s from the
median launch
(`bench/results/fsdp-cpu-throughput.md`).

Written to `bench/results/fsdp-cpu.md` with the dry run's plan of each FSDP strategy
(weights + gradients + optimizer state per rank) beside the measured resident state
over the single-rank-copy baseline (what a rank holds before the model is built).
"""

from __future__ import annotations

import argparse
import atexit
import ctypes
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
ONE_PROCESS = "one process"
PATHS = {
    ONE_PROCESS: ["--use-distributed-optimizer"],
    "DDP": [],
    "distributed optimizer": ["--use-distributed-optimizer"],
    **{
        f"FSDP {s}": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", s]
        for s in ("no_shard", "optim", "optim_grads", "optim_grads_params")
    },
}
MODELS = {
    "124m": {"layers": 12, "hidden": 768, "heads": 12},
    "275m": {"layers": 8, "hidden": 1536, "heads": 16},
    "757m": {"layers": 24, "hidden": 1536, "heads": 16},
}
# the paths each model runs: the whole-model DP paths only where four copies fit
MODEL_PATHS = {
    "124m": [p for p in PATHS if p != ONE_PROCESS],
    "275m": [ONE_PROCESS, "FSDP optim_grads_params", "FSDP optim_grads", "FSDP optim"],
    "757m": [ONE_PROCESS, "FSDP optim_grads_params"],
}  # fmt: skip


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


def _argv(
    model: dict, flags: list[str], save: str, world: int = WORLD, iters: int = 3
) -> list[str]:
    fsdp = "--use-megatron-fsdp" in flags
    micro_batch = model.get("micro_batch", 1)
    return [
        "gpt",
        "--num-layers", str(model["layers"]),
        "--hidden-size", str(model["hidden"]),
        "--num-attention-heads", str(model["heads"]),
        "--seq-length", str(model["seq"]),
        "--max-position-embeddings", str(model["seq"]),
        "--mock-data", "--vocab-size", str(model["vocab"]),
        "--micro-batch-size", str(micro_batch),
        "--global-batch-size", str(micro_batch * model.get("micro_batches", 2) * world),
        "--train-iters", str(iters), "--lr", "1e-4", "--log-interval", "1000", "--eval-iters", "0",
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
    world = spec["world"]
    iters = 3 + spec.get("timed_steps", 0)
    argv = _argv(spec["model"], spec["flags"], spec["save"], world, iters)
    args = parse_args(argv, world_size=world)
    trainer = phases.run("build", lambda: Trainer(args))
    phases.run("step", lambda: (trainer.train_step(), trainer.train_step()))
    if spec.get("timed_steps"):  # --throughput: steady-state steps between barriers
        dist.barrier()
        start = time.perf_counter()
        for _ in range(spec["timed_steps"]):
            trainer.train_step()
        dist.barrier()
        phases.results["timed"] = {"seconds": time.perf_counter() - start}
        Path(spec_path).parent.joinpath(f"rank{rank}.json").write_text(json.dumps(phases.results))
        dist.destroy_process_group()
        return
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what is live, not what glibc kept
    phases.results["step"]["rss_after"] = _status("VmRSS")
    trainer.state.iteration = 2
    phases.run("save", lambda: (trainer.save(), trainer.finish_saves()))
    if dist.is_initialized():  # one process runs without a process group
        dist.barrier()
    Path(spec_path).parent.joinpath(f"rank{rank}.json").write_text(json.dumps(phases.results))
    if dist.is_initialized():
        dist.destroy_process_group()


def _launch(spec: dict, folder: Path, threads: int, fixed_mmap: bool = True) -> list[dict]:
    """Run one path's ranks; `fixed_mmap`: glibc's mmap threshold fixed (memory runs, see
    the docstring), else the allocator's defaults (throughput runs)."""
    sys.path.insert(0, str(ROOT / "packages" / "core" / "src"))
    from mg.core.testing.launch import run_ranks

    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {"OMP_NUM_THREADS": str(threads)}
    if fixed_mmap:
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 20)
    world = spec["world"]
    outcomes = run_ranks(__file__, world, ["--worker", str(spec_path)], timeout=3600, env=env)
    for r, o in enumerate(outcomes):
        if o.returncode != 0:
            raise SystemExit(f"rank {r} of {spec['name']} failed:\n{o.log[-4000:]}")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


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


def _train_peak(ranks: list[dict]) -> float:
    """The largest rank's peak over building and training (bench_scale.py's train peak)."""
    return max(max(r["build"]["peak"], r["step"]["peak"]) for r in ranks)


THROUGHPUT_PATHS = ["distributed optimizer", "FSDP optim_grads_params", "FSDP optim_grads"]


def _throughput(options: argparse.Namespace) -> None:
    """Tokens/s of each THROUGHPUT_PATHS path at DP=2, launches interleaved."""
    world, steps = 2, options.steps
    work = Path(tempfile.mkdtemp(prefix="bench_fsdp_tp_"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)
    model = (
        {"layers": 2, "hidden": 128, "heads": 4} if options.quick else dict(MODELS[options.model])
    )
    seq = options.seq or (128 if not options.quick else 64)
    model.update(seq=seq, vocab=50304 if not options.quick else 8192)
    model.update(micro_batch=options.micro_batch_size, micro_batches=options.micro_batches)
    model["cache"] = str(work / "cache")
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"] if options.overlap else []
    load = os.getloadavg()[0]
    paths = options.paths or THROUGHPUT_PATHS
    if "distributed optimizer" not in paths:
        paths = ["distributed optimizer", *paths]
    seconds: dict[str, list[float]] = {name: [] for name in paths}
    for repeat in range(options.repeats):
        for name in paths:
            print(f"{name}, launch {repeat + 1} ...", flush=True)
            spec = {"name": name, "model": model, "flags": PATHS[name] + overlap, "world": world,
                    "save": str(work / "unused"), "timed_steps": steps}  # fmt: skip
            folder = work / f"{name.replace(' ', '_')}_{repeat}"
            ranks = _launch(spec, folder, options.threads, fixed_mmap=False)
            seconds[name].append(max(r["timed"]["seconds"] for r in ranks))
    batch = options.micro_batch_size * options.micro_batches * world  # sequences a step
    tokens = steps * batch * model["seq"]
    rate = {name: tokens / sorted(runs)[len(runs) // 2] for name, runs in seconds.items()}
    base = rate["distributed optimizer"]
    lines = [
        "# Training throughput at DP=2: fully sharded data parallelism against ZeRO-1",
        "",
        f"GPT, {model['layers']} layers, hidden {model['hidden']}, vocab {model['vocab']}, "
        f"seq {model['seq']}, fp32, AdamW, micro-batch {options.micro_batch_size}, "
        f"{options.micro_batches} micro-batches per rank (global batch {batch})"
        f"{', --overlap-grad-reduce --overlap-param-gather' if options.overlap else ''}, "
        f"2 gloo ranks on one machine ({_cpu()}, {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={options.threads} per rank); {steps} timed steps after 2 warm-up "
        f"steps, {options.repeats} launches per path in turn, the median launch; load "
        f"average {load:.1f} before, {os.getloadavg()[0]:.1f} after. "
        f"`bench/bench_fsdp.py --throughput{' --quick' if options.quick else ''}"
        f"{f' --seq {options.seq}' if options.seq else ''}{_batch_options(options)}"
        f" --steps {steps} --repeats "
        f"{options.repeats}`.",
        "",
        "| path | tokens/s | vs distributed optimizer | launches (s) |",
        "| --- | ---: | ---: | --- |",
    ]
    for name in paths:
        runs = ", ".join(f"{t:.1f}" for t in seconds[name])
        lines.append(f"| {name} | {rate[name]:.0f} | {rate[name] / base:.2f}x | {runs} |")
    text = "\n".join(lines) + "\n"
    print(text)
    stem = "fsdp-cpu-throughput" + ("-quick" if options.quick else "")
    out = options.output or ROOT / "bench" / "results" / f"{stem}.md"
    out.write_text(text)
    print(f"written to {out}")


def _batch_options(options: argparse.Namespace) -> str:
    """The command line's batch, overlap and path options, where not the defaults."""
    text = (
        f" --micro-batch-size {options.micro_batch_size}" if options.micro_batch_size != 1 else ""
    )
    text += f" --micro-batches {options.micro_batches}" if options.micro_batches != 2 else ""
    text += " --overlap" if options.overlap else ""
    if options.paths:
        text += " --paths " + " ".join(f'"{p}"' for p in options.paths)
    return text


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model (smoke run)")
    parser.add_argument("--model", choices=sorted(MODELS), default="124m", help="GPT size")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--throughput", action="store_true", help="tokens/s at DP=2 instead")
    parser.add_argument("--steps", type=int, default=6, help="timed steps (--throughput)")
    parser.add_argument("--seq", type=int, help="sequence length (--throughput; default 128)")
    parser.add_argument("--repeats", type=int, default=3, help="launches per path (--throughput)")
    parser.add_argument(
        "--micro-batch-size", type=int, default=1, help="sequences per micro-batch (--throughput)"
    )
    parser.add_argument(
        "--micro-batches", type=int, default=2, help="micro-batches per rank a step (--throughput)"
    )
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="--overlap-grad-reduce --overlap-param-gather on every path (--throughput)",
    )
    parser.add_argument(
        "--paths", nargs="+", choices=list(PATHS), help="only these paths (default: the model's)"
    )
    parser.add_argument("--output", type=Path, help="default: bench/results/fsdp-cpu*.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.worker:
        _worker(options.worker)
        return
    if options.throughput:
        _throughput(options)
        return
    work = Path(tempfile.mkdtemp(prefix="bench_fsdp_"))
    atexit.register(shutil.rmtree, work, ignore_errors=True)  # checkpoints of GBs each
    model = (
        {"layers": 2, "hidden": 128, "heads": 4} if options.quick else dict(MODELS[options.model])
    )
    model.update(seq=128 if not options.quick else 64, vocab=50304 if not options.quick else 8192)
    paths = options.paths or MODEL_PATHS["757m" if options.quick else options.model]
    model["cache"] = str(work / "cache")
    h, layers, vocab, seq = model["hidden"], model["layers"], model["vocab"], model["seq"]
    params = layers * (12 * h * h + 13 * h) + vocab * h + seq * h + 2 * h
    rows = {}
    failed: dict[str, str] = {}
    for name in paths:
        print(f"{name} ...", flush=True)
        world = 1 if name == ONE_PROCESS else WORLD
        spec = {
            "name": name,
            "model": model,
            "flags": PATHS[name],
            "save": str(work / name),
            "world": world,
        }
        try:
            rows[name] = _launch(spec, work / name.replace(" ", "_"), options.threads)
        except SystemExit as failure:
            if name in (ONE_PROCESS, "FSDP optim_grads_params"):
                raise
            failed[name] = str(failure).splitlines()[0]
            print(failure, flush=True)
        finally:  # measured: one path's checkpoint on disk at a time
            shutil.rmtree(work / name, ignore_errors=True)
    baseline = _train_peak(rows[ONE_PROCESS]) if ONE_PROCESS in rows else None
    command = "bench/bench_fsdp.py" + (" --quick" if options.quick else "")
    if options.model != "124m" and not options.quick:
        command += f" --model {options.model}"
    if options.paths:
        command += " --paths " + " ".join(f'"{p}"' for p in options.paths)
    lines = [
        "# Per-rank memory of fully sharded data parallelism (DP=4)",
        "",
        f"GPT, {layers} layers, hidden {h}, vocab {vocab}, seq {seq}: {params / 1e6:.0f}M "
        "parameters, fp32, AdamW, micro-batch 1, 2 micro-batches per rank, 4 gloo ranks on "
        f"one machine ({platform.machine()}, {os.cpu_count()} cores, OMP_NUM_THREADS="
        f"{options.threads} per rank), `{command}`.",
        "",
        "Peak RSS in GB of the largest rank per phase (imports included); resident state: "
        "the RSS after two steps over the rank's RSS before the model (imports only); plan: "
        "the dry run's weights + gradients + optimizer state per rank; train peak / "
        "1-process: the larger of the build and step peaks over the single-process run's "
        "(bench_scale.py's ratio).",
        "",
        "| path | build | step | save | resident state | plan | train peak / 1-process "
        "| step time (s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, ranks in rows.items():

        def worst(phase: str, key: str = "peak", ranks=ranks) -> float:
            return max(r[phase][key] for r in ranks)

        state = max(r["step"]["rss_after"] - r["baseline"]["rss_after"] for r in ranks)
        plan = "-"
        if name.startswith("FSDP"):
            plan = f"{_planned(model, name.split()[1]) / 1e9:.2f}"
        ratio = "-" if baseline is None else f"{_train_peak(ranks) / baseline:.2f}x"
        lines.append(
            f"| {name} | {worst('build') / 1e9:.2f} | {worst('step') / 1e9:.2f} | "
            f"{worst('save') / 1e9:.2f} | {state / 1e9:.2f} | {plan} | {ratio} | "
            f"{worst('step', 'seconds') / 2:.1f} |"
        )
    skipped = [p for p in PATHS if p not in rows and p.startswith("FSDP")]
    for name in skipped:
        lines.append(
            f"| {name} | - | - | - | - | {_planned(model, name.split()[1]) / 1e9:.2f} | - | - |"
        )
    for name, reason in failed.items():
        lines.append(f"\n{name}: not measured ({reason}).")
    text = "\n".join(lines) + "\n"
    print(text)
    stem = "fsdp-cpu-quick" if options.quick else "fsdp-cpu"
    if options.model != "124m" and not options.quick:
        stem += f"-{options.model}"
    out = options.output or ROOT / "bench" / "results" / f"{stem}.md"
    out.write_text(text)
    print(f"written to {out}")


if __name__ == "__main__":
    main()
