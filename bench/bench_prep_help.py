"""Wall time of every `mg-prep ... --help`, now and at an earlier commit, in one run.

    uv run --frozen python bench/bench_prep_help.py --before 9f40a35 --repeat 7

The earlier commit's core, indexed-dataset and corpus-prep sources are
exported (git archive) to a temporary folder put first on PYTHONPATH; both
versions then run alternately, each command --repeat times, in fresh
interpreters (`python -m mg.corpus_prep ... --help`), so that the load of a
shared machine weighs on both alike. Printed: the median wall seconds of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("packages/core/src", "packages/indexed-dataset/src", "packages/corpus-prep/src")
COMMANDS = ("", "tokenize", "clean", "merge", "inspect", "train-tokenizer", "refresh")


def export(commit: str, into: Path) -> str:
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, *SOURCES], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return os.pathsep.join(str(into / source) for source in SOURCES)


def wall(command: str, env: dict[str, str]) -> float:
    argv = [sys.executable, "-m", "mg.corpus_prep", *([command] if command else []), "--help"]
    start = time.perf_counter()
    subprocess.run(argv, check=True, capture_output=True, env=env)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", required=True, help="the commit to compare with")
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        before_env = {**os.environ, "PYTHONPATH": export(args.before, Path(folder))}
        now_env = dict(os.environ)
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeat):
            for command in COMMANDS:
                for label, env in (("before", before_env), ("now", now_env)):
                    times.setdefault((command, label), []).append(wall(command, env))
    print(f"{'mg-prep ... --help':<32} {'before s':>9} {'now s':>7}")
    for command in COMMANDS:
        name = f"mg-prep {command} --help".replace("  ", " ")
        before = statistics.median(times[command, "before"])
        now = statistics.median(times[command, "now"])
        print(f"{name:<32} {before:>9.2f} {now:>7.2f}")
    print(f"load average: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
