"""Per-rank memory and time at TP=1, TP=2, PP=2 and TP=2×PP=2: shard-aware vs whole-model.

    uv run --frozen python bench/bench_scale.py            # GPT-2-medium-like, ~355M params
    uv run --frozen python bench/bench_scale.py --quick    # a small model, for a smoke run

For one GPT config (fp32, `--use-distributed-optimizer`, mock data, micro-batch 1)
each layout runs as gloo ranks on this machine (`OMP_NUM_THREADS` threads each,
printed), twice in the same run:

- **sharded** (mg-train now): the model is built on the meta device and each rank
  materialises only its stage's layers and its tensor-parallel shards
  (`mg.core.parallel.materialize`); mg-eval / mg-serve read only their part of the
  checkpoint (`mg.core.checkpoint.model_part.load_model_part`);
- **whole** (the path before): every rank builds the whole fp32 model on the CPU
  and then keeps its part (`apply_tensor_parallel` slices, `split_model` keeps the
  stage); the readers load the whole checkpoint (`load_model`) and then shard it.

Phases, each rank measured alone: the kernel's peak-RSS mark is reset before each
phase (Linux `clear_refs` 5) and VmHWM read after it, so every figure is that
phase's peak resident memory, in GB, imports and earlier state included.

- build: `Trainer(args)` (layout, model, optimizer, data);
- step: one training iteration (the first allocates Adam's state). The RSS after
  it is the rank's *resident training state*;
- save: a `torch_dist` checkpoint of model and optimizer (sharded path only);
- load: that checkpoint resumed into the same trainer (sharded path only);
- reader: fresh processes load the checkpoint for evaluation in the same layout
  (the eval/serve load), sharded vs whole.

Printed and written to `bench/results/scale-cpu.md`: per layout the largest
rank's peak per phase, the ratios to the single-process run (whole-model path) and,
for save and load, to the rank's resident training state.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
"""(tp, pp); one rank per model-parallel position (DP = 1)."""


def _status(key: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


class Phases:
    """Peak RSS (bytes) and wall time (s) per phase of this process."""

    def __init__(self) -> None:
        self.results: dict[str, dict[str, float]] = {}

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


def _argv(model: dict, tp: int, pp: int, save: str | None, load: str | None) -> list[str]:
    argv = [
        "gpt",
        "--num-layers", str(model["layers"]),
        "--hidden-size", str(model["hidden"]),
        "--num-attention-heads", str(model["heads"]),
        "--seq-length", str(model["seq"]),
        "--max-position-embeddings", str(model["seq"]),
        "--mock-data", "--vocab-size", str(model["vocab"]),
        "--micro-batch-size", "1", "--global-batch-size", str(2 * pp),
        "--train-iters", "2", "--lr", "1e-4", "--log-interval", "1000", "--eval-iters", "0",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--use-distributed-optimizer", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--data-cache-path", model["cache"],
    ]  # fmt: skip
    if save:
        argv += ["--save", save]
    if load:
        argv += ["--load", load]
    return argv


def _worker(spec_path: str) -> None:
    """One rank: the phases of one (layout, path); writes rank<R>.json beside the spec."""
    spec = json.loads(Path(spec_path).read_text())
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    from mg.trainer import checkpointing_dist, families
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    tp, pp, path = spec["tp"], spec["pp"], spec["path"]
    if spec["phase"] == "reader":  # a fresh process: nothing of the training run around
        if world > 1:
            dist.init_process_group("gloo")
        phases = Phases()
        phases.run("reader", lambda: _reader(spec, path))
        Path(spec_path).parent.joinpath(f"rank{rank}.json").write_text(json.dumps(phases.results))
        return
    if path == "whole":  # the path before: build everything on every rank, then cut
        gpt = families.FAMILIES["gpt"]
        families.FAMILIES["gpt"] = families.ModelFamily(
            gpt.name, gpt.build_config, gpt.build_model, gpt.build_datasets, gpt.loss_terms
        )
    phases = Phases()
    save = spec["save"] if path == "sharded" else None
    args = parse_args(_argv(spec["model"], tp, pp, save, None), world_size=world)
    trainer = phases.run("build", lambda: Trainer(args))
    phases.run("step", trainer.train_step)
    trainer.state.iteration = 1
    if path == "sharded":
        phases.run("save", lambda: (trainer.save(), trainer.finish_saves()))
        phases.run(
            "load",
            lambda: checkpointing_dist.resume(
                save,
                model=trainer.model,
                optimizer=trainer.optimizer,
                scheduler=trainer.scheduler,
                loss_scaler=trainer.scaler,
                rng_shard=trainer.layout.shard_name,
            ),
        )
    if dist.is_initialized():
        dist.barrier()
    out = Path(spec_path).parent / f"rank{rank}.json"
    out.write_text(json.dumps(phases.results))


def _reader(spec: dict, path: str):
    """The eval/serve load of the checkpoint in this layout: this rank's part only
    (sharded) or the whole model, then its part (whole)."""
    import torch.distributed as dist

    from mg.core.checkpoint.model_io import load_model
    from mg.core.checkpoint.model_part import load_model_part
    from mg.core.parallel.layout import build_parallel_layout
    from mg.core.parallel.pipeline import split_model
    from mg.core.parallel.tensor_parallel import apply_tensor_parallel

    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    layout = build_parallel_layout(world, rank, tp=spec["tp"], pp=spec["pp"])
    if path == "sharded":
        return load_model_part(spec["checkpoint"], layout).parts
    model = load_model(spec["checkpoint"])[0]
    if layout.tp > 1:
        apply_tensor_parallel(model, layout.tp_mesh, sequence_parallel=False)
    return split_model(model, layout.pp_rank, layout.pp) if layout.pp > 1 else [model]


def _launch(spec: dict, folder: Path, threads: int) -> list[dict]:
    from mg.core.testing.launch import run_ranks

    folder.mkdir(parents=True, exist_ok=True)
    spec_path = folder / "spec.json"
    spec_path.write_text(json.dumps(spec))
    world = spec["tp"] * spec["pp"]
    env = {"OMP_NUM_THREADS": str(threads), "MG_BENCH_THREADS": str(threads)}
    outcomes = run_ranks(__file__, world, ["--worker", str(spec_path)], timeout=3600, env=env)
    return _collect(folder, world, [o.returncode for o in outcomes], [o.log for o in outcomes])


def _collect(folder: Path, world: int, codes: list[int], logs: list[str]) -> list[dict] | str:
    """Every rank's phases, or why the run failed (the kernel's OOM killer sends SIGKILL)."""
    if any(code == -9 for code in codes):
        return "killed (out of memory)"
    for r, code in enumerate(codes):
        if code != 0:
            raise SystemExit(f"rank {r} in {folder} failed:\n{logs[r][-4000:]}")
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in range(world)]


def _gb(value: float) -> str:
    return f"{value / 1e9:.2f}"


def _params(model: dict) -> int:
    h, layers, vocab, seq = model["hidden"], model["layers"], model["vocab"], model["seq"]
    return layers * (12 * h * h + 13 * h) + vocab * h + seq * h + 2 * h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="a small model (smoke run)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    parser.add_argument("--output", default=str(ROOT / "bench" / "results" / "scale-cpu.md"))
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    if args.quick:
        args.layers, args.hidden, args.heads, args.vocab = 4, 256, 8, 8192
    work = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=ROOT / "bench" / ".work"))
    model = {
        "layers": args.layers,
        "hidden": args.hidden,
        "heads": args.heads,
        "vocab": args.vocab,
        "seq": args.seq,
        "cache": str(work / "cache"),
    }
    print(f"GPT {_params(model) / 1e6:.0f}M parameters, fp32; OMP_NUM_THREADS={args.threads}")
    rows: dict[tuple[int, int, str], list[dict] | str] = {}
    for tp, pp in LAYOUTS:
        for path in ("sharded", "whole"):  # the sharded run writes the checkpoint both read
            folder = work / f"tp{tp}-pp{pp}-{path}"
            spec = {
                "tp": tp,
                "pp": pp,
                "path": path,
                "model": model,
                "save": str(work / f"ckpt-tp{tp}-pp{pp}"),
                "checkpoint": str(work / f"ckpt-tp{tp}-pp{pp}"),
            }
            started = time.perf_counter()
            rows[(tp, pp, path)] = _launch({**spec, "phase": "train"}, folder, args.threads)
            print(f"  tp={tp} pp={pp} {path}: {time.perf_counter() - started:.0f} s", flush=True)
        for path in ("sharded", "whole"):  # the eval/serve load of the sharded run's checkpoint
            spec = {"tp": tp, "pp": pp, "path": path, "phase": "reader"}
            spec["checkpoint"] = str(work / f"ckpt-tp{tp}-pp{pp}")
            read = _launch(spec, work / f"tp{tp}-pp{pp}-{path}-reader", args.threads)
            if isinstance(rows[(tp, pp, path)], list) and isinstance(read, list):
                for phases, reader in zip(rows[(tp, pp, path)], read, strict=True):
                    phases.update(reader)
        shutil.rmtree(work / f"ckpt-tp{tp}-pp{pp}", ignore_errors=True)  # GBs per layout
    report = _report(rows, model, args.threads)
    print(report)
    Path(args.output).write_text(report)


def _report(rows: dict, model: dict, threads: int) -> str:
    base = max(r["step"]["peak"] for r in rows[(1, 1, "whole")])
    lines = [
        "# Per-rank memory at scale: shard-aware construction and reading",
        "",
        f"GPT, {model['layers']} layers, hidden {model['hidden']}, {model['heads']} heads, "
        f"vocab {model['vocab']}, seq {model['seq']}: {_params(model) / 1e6:.0f}M parameters, "
        "fp32, AdamW through the distributed optimizer, micro-batch 1, gloo ranks on one "
        f"machine ({platform.machine()}, {os.cpu_count()} cores, "
        f"OMP_NUM_THREADS={threads} per rank), `bench/bench_scale.py`.",
        "",
        "Peak RSS in GB of the largest rank, per phase (imports and earlier state "
        "included); ratio: the training peak (build and step) over the single-process "
        "whole-model run's.",
        "",
        "| layout | path | build | step | resident state | save | load | reader | "
        "train peak / 1-process | save / state | load / state |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for (tp, pp, path), ranks in rows.items():
        if isinstance(ranks, str):  # the run did not finish
            lines.append(f"| TP={tp} PP={pp} | {path} | {ranks} |" + " |" * 8)
            continue

        def top(phase: str, key: str = "peak", ranks: list[dict] = ranks) -> float | None:
            values = [r[phase][key] for r in ranks if phase in r]
            return max(values) if values else None

        state = top("step", "rss_after")
        train_peak = max(top("build"), top("step"))
        save, load = top("save"), top("load")
        cells = [
            f"TP={tp} PP={pp}",
            path,
            _gb(top("build")),
            _gb(top("step")),
            _gb(state),
            _gb(save) if save else "-",
            _gb(load) if load else "-",
            _gb(top("reader")),
            f"{train_peak / base:.2f}x",
            f"{save / state:.2f}x" if save else "-",
            f"{load / state:.2f}x" if load else "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Wall time in seconds of the slowest rank, per phase:", ""]
    lines += ["| layout | path | build | step | save | load | reader |"]
    lines += ["| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (tp, pp, path), ranks in rows.items():
        if isinstance(ranks, str):
            continue
        cells = [f"TP={tp} PP={pp}", path]
        for phase in ("build", "step", "save", "load", "reader"):
            values = [r[phase]["seconds"] for r in ranks if phase in r]
            cells.append(f"{max(values):.1f}" if values else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
