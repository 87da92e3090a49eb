"""What the step-by-step workflows share: each command run in turn, announced and timed.

    timings = run_steps(steps, lambda step: run_command(step.argv, step.log))

prints `== 3. [train] mg-train ...` before a step and `-- 3. [train] 12 s wall, 20 s CPU`
after it; a failed command ends the run with its command line.
"""

from __future__ import annotations

import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

BIN = Path(__file__).resolve().parents[1] / "bin"
"""The tools' launchers (bin/mg-prep, bin/mg-train, ...)."""


class Step(Protocol):
    phase: str
    argv: list[str]


S = TypeVar("S", bound=Step)


@dataclass
class Timing:
    """Seconds of one phase, summed over its steps; CPU is its processes' user + system."""

    wall: float = 0.0
    cpu: float = 0.0


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_command(argv: list[str], log: Path | None = None) -> None:
    """`argv` run to its end; with `log`, its output is kept there and shown as it is written."""
    if log is None:
        if subprocess.run(argv).returncode != 0:
            sys.exit(f"failed: {shlex.join(argv)}")
        return
    with log.open("w") as out:
        process = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in process.stdout:
            sys.stdout.write(line)
            out.write(line)
        if process.wait() != 0:
            sys.exit(f"failed ({process.returncode}): {shlex.join(argv)}")


def run_steps(
    steps: Iterable[S],
    run_step: Callable[[S], None],
    timings: dict[str, Timing] | None = None,
) -> dict[str, Timing]:
    """Each step in turn (a failure stops the run); wall and CPU seconds added by phase."""
    timings = {} if timings is None else timings
    for number, step in enumerate(steps, 1):
        print(f"== {number}. [{step.phase}] {shlex.join(step.argv)}", flush=True)
        start, cpu = time.monotonic(), children_cpu()
        run_step(step)
        wall, used = time.monotonic() - start, children_cpu() - cpu
        print(f"-- {number}. [{step.phase}] {wall:.0f} s wall, {used:.0f} s CPU", flush=True)
        timing = timings.setdefault(step.phase, Timing())
        timing.wall += wall
        timing.cpu += used
    return timings


def phase_table(timings: dict[str, Timing]) -> list[str]:
    """summary.md's "Time by phase" section, a row a phase, as Markdown lines."""
    lines = ["## Time by phase", "", "| phase | wall s | CPU s |", "| --- | ---: | ---: |"]
    lines += [f"| {phase} | {t.wall:.0f} | {t.cpu:.0f} |" for phase, t in timings.items()]
    return lines


def tool(name: str, *args: object) -> list[str]:
    """The command line of one of the project's tools (bin/NAME)."""
    return [str(BIN / name), *map(str, args)]


def script(path: Path, *args: object) -> list[str]:
    """The command line of a Python script, run by this interpreter."""
    return [sys.executable, str(path), *map(str, args)]


def machine() -> str:
    """The CPU model, its count and the thread setting, for a summary's machine row."""
    model = platform.processor() or platform.machine()
    try:
        found = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        model = found.group(1).strip() if found else model
    except OSError:
        pass
    threads = os.environ.get("OMP_NUM_THREADS", "torch's default")
    return f"{model}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={threads}"


TRAIN_LOSS = re.compile(r"iteration +(\d+)/ *\d+ \|.*? lm loss: ([\d.E+-]+) \|")
"""An mg-train log line's iteration and `lm loss` (Megatron's format)."""


def train_losses(log: str) -> list[float]:
    """The `lm loss` of each logged training iteration of an mg-train log, in order."""
    return [float(loss) for _, loss in TRAIN_LOSS.findall(log)]
