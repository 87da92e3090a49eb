"""`just gpu-check`: every GPU test and the 1.3B benchmark, on one GPU, from a clean checkout.

    python3 bench/gpu_check.py                    # tests, then bf16 / +compile / FP8 / FSDP2 runs
    python3 bench/gpu_check.py --wheels DIR       # install missing packages from wheels first
    python3 bench/gpu_check.py --skip-bench       # the tests only

It needs only a Python with a CUDA build of torch: mg's packages are imported from
this checkout (`packages/*/src` on PYTHONPATH), and what else the tests import and
the machine lacks (torchao, FastAPI and pydantic for the server, gguf) is installed
from the wheels in `--wheels` (pip, no index) into a temporary folder, so a machine
with no package index runs it too. In order, each stage timed:

1. The GPU tests: `tests/gpu` (attention backends, bf16 and FP8 training numerics,
   CUDA-graph and quantized serving, Mamba's torch path) and the CUDA cases of the
   package suites named in `CUDA_TESTS`; pytest's pass/fail/skip counts are kept.
2. `bench/bench_gpu.py`: Megatron's 1.3B GPT in bf16, bf16 + torch.compile and FP8
   (torchao, tensorwise, compiled), `--iters` iterations each; then bf16 with
   `--use-torch-fsdp2` (ZeRO-3) for `--fsdp-iters` (fewer: its tokens/s beside bf16's is
   what it is for, and the check must stay within minutes).
3. The results file `bench/results/gpu-<device>.md`: the benchmark's table, then the
   test counts, FP8 against bf16 (tokens/s ratio, largest relative loss difference
   over the run) and every stage or run that could not run, with why.

Without CUDA it says so and exits 0; `--device cpu` runs the same stages on a tiny
shape (the dry run of this script; the tests then run on the CPU through
MG_GPU_TEST_DEVICE=cpu).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench" / "bench_gpu.py"
GPU_TESTS = ["tests/gpu"]
CUDA_TESTS = [  # CUDA cases of the package suites (each skips itself elsewhere)
    "packages/core/tests/test_attention_backend.py",
    "packages/trainer/tests/test_fp8_torchao.py",
]
RUNS = ["bf16", "bf16 + compile", "fp8 + compile"]
FP8_RUN, BF16_RUN, FSDP_RUN = "fp8 + compile", "bf16", "bf16 + FSDP2"


def source_path() -> str:
    """Every package's `src`, for PYTHONPATH: mg imported from this checkout."""
    return os.pathsep.join(str(p) for p in sorted((ROOT / "packages").glob("*/src")))


def install_wheels(wheels: Path, target: Path) -> str | None:
    """pip-install every wheel in `wheels` into `target` (no index, no dependencies);
    returns why not, or None."""
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if not files:
        return f"no wheels in {wheels}"
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps"]
    command += ["--no-compile", "--target", str(target), *files]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        return f"pip install from {wheels} failed: {done.stderr.strip()[-300:]}"
    return None


def run_tests(env: dict[str, str], junit: Path, on_cpu: bool) -> tuple[dict[str, int], str]:
    """pytest over the GPU tests; returns the outcome counts and pytest's summary line."""
    # not the slow multi-rank cases: their ranks would share the one GPU
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-m", "not slow"]
    command += [f"--junitxml={junit}", "-o", "addopts=--import-mode=importlib -ra"]
    command += [*GPU_TESTS, *CUDA_TESTS]
    if on_cpu:
        env = {**env, "MG_GPU_TEST_DEVICE": "cpu"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    output = done.stdout + done.stderr
    print(output[-6000:], flush=True)
    counts = {k: 0 for k in ("passed", "failed", "errors", "skipped")}
    if junit.exists():
        text = junit.read_text()
        head = re.search(r"<testsuite [^>]*>", text)
        if head:
            for key, attr in (("failed", "failures"), ("errors", "errors"), ("skipped", "skipped")):
                found = re.search(rf'{attr}="(\d+)"', head.group(0))
                counts[key] = int(found.group(1)) if found else 0
            total = re.search(r'tests="(\d+)"', head.group(0))
            counts["passed"] = (int(total.group(1)) if total else 0) - sum(
                counts[k] for k in ("failed", "errors", "skipped")
            )
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    problems = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    skips = [line for line in output.splitlines() if line.startswith("SKIPPED")]
    return counts, "\n".join([*(lines[-1:] or ["(no summary)"]), *problems, *skips])


def _bench_gpu():
    """bench_gpu.py as a module: the benchmark's own arithmetic and table."""
    sys.path.insert(0, str(BENCH.parent))
    import bench_gpu

    return bench_gpu


def fsdp_warmup(opts: argparse.Namespace) -> int:
    """Iterations of the shorter FSDP2 run left out of its median."""
    return min(opts.warmup, max(opts.fsdp_iters // 3, 1))


def comparisons(records: dict[str, dict], warmup: int, fsdp_warmup: int) -> list[str]:
    """FP8 and compile against bf16: tokens/s ratio and the largest relative loss difference;
    FSDP2 against bf16: the tokens/s ratio."""
    bench_gpu = _bench_gpu()
    lines = []
    base = records.get(BF16_RUN)
    for name in (FP8_RUN, "bf16 + compile"):
        if base is None or name not in records:
            continue
        run, ref = records[name], base
        speed = bench_gpu.summary(run, warmup)["tokens_per_s_per_gpu"]
        speed /= bench_gpu.summary(ref, warmup)["tokens_per_s_per_gpu"]
        pairs = list(zip(run["losses"], ref["losses"], strict=True))
        worst = max(abs(a - b) / abs(b) for a, b in pairs)
        lines.append(
            f"- {name} against {BF16_RUN}: {speed:.2f}x the tokens/s; losses within "
            f"{worst:.2%} of {BF16_RUN}'s over {len(pairs)} iterations (largest relative "
            f"difference; last losses {run['losses'][-1]:.3f} and {ref['losses'][-1]:.3f})"
        )
    if base is not None and FSDP_RUN in records:  # untied embeddings: other losses, by design
        speed = bench_gpu.summary(records[FSDP_RUN], fsdp_warmup)["tokens_per_s_per_gpu"]
        speed /= bench_gpu.summary(base, warmup)["tokens_per_s_per_gpu"]
        lines.append(
            f"- {FSDP_RUN} (ZeRO-3, untied embeddings) against {BF16_RUN}: "
            f"{speed:.2f}x the tokens/s"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--wheels", type=Path, help="Wheels to install first (pip --no-index).")
    p.add_argument("--iters", type=int, default=50, help="Iterations per benchmark run.")
    p.add_argument("--warmup", type=int, default=5, help="Iterations left out of medians.")
    p.add_argument("--fsdp-iters", type=int, default=12, help="Iterations of the FSDP2 run.")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--skip-bench", action="store_true", help="The tests only.")
    p.add_argument("--skip-tests", action="store_true", help="The benchmark only.")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--output", type=Path, help="Default: bench/results/gpu-<device>.md.")
    opts = p.parse_args(argv)
    start = time.perf_counter()
    not_run: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    paths = [source_path()]
    if opts.wheels is not None:
        why = install_wheels(opts.wheels, work / "site")
        if why is None:
            paths.append(str(work / "site"))
        else:
            not_run.append(f"wheels: {why}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*paths, os.environ.get("PYTHONPATH", "")]))
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]
    sys.path[:0] = paths

    import torch

    on_cpu = opts.device == "cpu"
    if not on_cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here; nothing to check (--device cpu: a dry run)")
        return 0
    device = "cpu" if on_cpu else torch.cuda.get_device_name(0)
    print(f"gpu_check: {device}, torch {torch.__version__}", flush=True)

    stages: list[str] = []
    counts, test_summary = None, ""
    if not opts.skip_tests:
        t0 = time.perf_counter()
        counts, test_summary = run_tests(env, work / "junit.xml", on_cpu)
        stages.append(f"GPU tests: {time.perf_counter() - t0:.0f} s")
        print(f"gpu_check: tests {counts} ({stages[-1]})", flush=True)

    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")
    output = opts.output or ROOT / "bench" / "results" / f"gpu-{slug}.md"
    records: dict[str, dict] = {}
    if not opts.skip_bench:
        t0 = time.perf_counter()
        command = [sys.executable, str(BENCH), "--iters", str(opts.iters)]
        command += ["--warmup", str(opts.warmup), "--output", str(output), "--gpus", "1"]
        command += ["--micro-batch-size", str(opts.micro_batch_size), "--records", str(work)]
        command += ["--device", opts.device]
        done = subprocess.run([*command, "--runs", *RUNS], cwd=ROOT, env=env)
        fsdp = [*command, "--runs", FSDP_RUN]  # its report aside, not over the first one's
        for flag, value in [
            ("--iters", opts.fsdp_iters),
            ("--warmup", fsdp_warmup(opts)),
            ("--output", work / "fsdp.md"),
        ]:
            fsdp[fsdp.index(flag) + 1] = str(value)
        fsdp_done = subprocess.run(fsdp, cwd=ROOT, env=env)
        stages.append(f"benchmark: {time.perf_counter() - t0:.0f} s")
        for path in work.glob("record-*.json"):
            record = json.loads(path.read_text())
            records[record["run"]] = record
        exits = {**dict.fromkeys(RUNS, done.returncode), FSDP_RUN: fsdp_done.returncode}
        for name, exit_code in exits.items():
            if name not in records:
                not_run.append(f"benchmark run '{name}': failed (exit {exit_code}; log above)")

    lines = ["", "## GPU check (`just gpu-check`)", ""]
    lines.append(f"Stages: {'; '.join(stages)}; whole check {time.perf_counter() - start:.0f} s.")
    if counts is not None:
        lines += ["", f"GPU tests: {counts['passed']} passed, {counts['failed']} failed, "]
        lines[-1] += f"{counts['errors']} errors, {counts['skipped']} skipped."
        lines += ["", "```", test_summary, "```"]
    if FSDP_RUN in records:
        heading = f"{FSDP_RUN}, {opts.fsdp_iters} iterations (median after {fsdp_warmup(opts)}):"
        table = _bench_gpu().table({FSDP_RUN: records[FSDP_RUN]}, {}, fsdp_warmup(opts))
        lines += ["", heading, "", *table]
    comparison = comparisons(records, opts.warmup, fsdp_warmup(opts))
    if comparison:
        lines += ["", *comparison]
    if not_run:
        lines += ["", "Could not run:", "", *(f"- {item}" for item in not_run)]
    text = "\n".join(lines) + "\n"
    print(text)
    if output.exists() or not opts.skip_bench:
        with output.open("a") as f:
            f.write(text)
    else:
        output.write_text(f"# GPU check on {device}\n" + text)
    print(f"gpu_check: wrote {output}")
    failed = counts is not None and (counts["failed"] or counts["errors"])
    return 1 if failed or not_run else 0


if __name__ == "__main__":
    sys.exit(main())
