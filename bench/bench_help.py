"""How long each tool's `--help` takes, as a user runs it (`bin/mg-*`), in one run.

    python bench/bench_help.py [--repeat 5]

Prints a Markdown table: the median and the slowest of `--repeat` runs of each
command's `--help` (the launcher, the interpreter's start-up and argparse), with the
machine's load average at the start and the end, so a figure taken on a busy machine
says so.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = [
    ["mg-prep", "--help"],
    ["mg-prep", "tokenize", "--help"],
    ["mg-train", "--help"],
    ["mg-train", "gpt", "--help"],
    ["mg-convert", "--help"],
    ["mg-convert", "import-hf", "--help"],
    ["mg-eval", "--help"],
    ["mg-eval", "ppl", "--help"],
    ["mg-serve", "--help"],
    ["mg-quantize", "--help"],
]


def time_once(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        [str(ROOT / "bin" / argv[0]), *argv[1:]],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    for argv in COMMANDS:
        time_once(argv)  # the first run syncs the environment and warms the page cache
        times = [time_once(argv) for _ in range(args.repeat)]
        rows.append((" ".join(argv), statistics.median(times), max(times)))
    load_after = os.getloadavg()[0]
    print(
        f"load average {load_before:.1f} at the start, {load_after:.1f} at the end; "
        f"{os.cpu_count()} CPUs; median and slowest of {args.repeat} runs\n"
    )
    print("| command | median | slowest |\n| --- | ---: | ---: |")
    for command, median, slowest in rows:
        print(f"| `{command}` | {median:.2f} s | {slowest:.2f} s |")


if __name__ == "__main__":
    main()
