"""Start a script as N local ranks (torchrun's environment variables), for multi-process tests.

Each rank runs `python SCRIPT ARGS…` with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and a free MASTER_PORT set, one OpenMP thread each (the test
boxes are small and shared). A failed launch raises with every rank's log
tail; a port taken between choosing and binding it is retried.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class RankOutcome:
    """What one rank did: exit status and its combined stdout/stderr."""

    returncode: int
    log: str


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(
    script: str,
    world_size: int,
    args: Sequence[str] = (),
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[RankOutcome]:
    """Run the ranks to completion (or kill them at `timeout`) and return their outcomes."""
    for _ in range(3):
        base = {**os.environ, **(env or {})}
        base.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
            WORLD_SIZE=str(world_size),
            OMP_NUM_THREADS="1",
        )
        procs = [
            subprocess.Popen(
                [sys.executable, script, *args],
                env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(world_size)
        ]
        outcomes = []
        for proc in procs:
            try:
                log = proc.communicate(timeout=timeout)[0]
            except subprocess.TimeoutExpired:
                proc.kill()
                log = proc.communicate()[0] + f"\n[killed after {timeout:.0f} s]"
            outcomes.append(RankOutcome(proc.returncode, log))
        if not any("address already in use" in o.log.lower() for o in outcomes):
            return outcomes
    return outcomes


def launch_workers(
    script: str, world_size: int, args: Sequence[str] = (), timeout: float = 300.0
) -> list[str]:
    """`run_ranks`, raising with the rank logs unless every rank exits 0; returns the logs."""
    outcomes = run_ranks(script, world_size, args, timeout)
    if any(o.returncode != 0 for o in outcomes):
        tails = "\n".join(
            f"--- rank {r} (exit {o.returncode}) ---\n{o.log[-3000:]}"
            for r, o in enumerate(outcomes)
        )
        raise AssertionError(f"ranks of {script} failed:\n{tails}")
    return [o.log for o in outcomes]
