"""`mg-eval` as N local ranks (torchrun's environment), for the multi-process tests.

Ranks are launched as a script through mg.core.testing.launch (spawned
workers could not unpickle a test module under pytest's importlib mode). One
launch can run several mg-eval commands, separated by ``--then``, in the same
process group: each rank starts once, which is most of a run's time.
"""

from __future__ import annotations

import json
from pathlib import Path

from mg.core.testing.launch import launch_workers, run_ranks

THEN = "--then"

_ENTRY = """import sys
import torch.distributed as dist
from mg.evaluate.cli import main
commands = [[]]
for arg in sys.argv[1:]:
    if arg == "--then":
        commands.append([])
    else:
        commands[-1].append(arg)
code = 0
for argv in commands:
    code = main(argv)
    if code:
        break
if dist.is_initialized():
    dist.destroy_process_group()
sys.exit(code)
"""


def entry_script(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "mg_eval_entry.py"
    script.write_text(_ENTRY)
    return str(script)


def run_eval_ranks(world: int, argv: list[str], folder: Path) -> list[str]:
    """`mg-eval ARGV` on `world` ranks, each exiting 0; returns their logs."""
    return launch_workers(entry_script(folder), world, argv, timeout=300)


def failed_eval_ranks(world: int, argv: list[str], folder: Path) -> list[str]:
    """The logs of `mg-eval ARGV` on `world` ranks that must all exit 2."""
    outcomes = run_ranks(entry_script(folder), world, argv, timeout=120)
    assert [o.returncode for o in outcomes] == [2] * world, [o.log[-2000:] for o in outcomes]
    return [o.log for o in outcomes]


def report_metrics(report: Path) -> list[dict]:
    """The metrics of every record of a --report file (one per command; rank 0 writes)."""
    return [json.loads(line)["metrics"] for line in report.read_text().splitlines()]
