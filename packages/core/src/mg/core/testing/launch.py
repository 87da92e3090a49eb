"""Start a script as N local ranks (torchrun's environment variables), for multi-process tests.

Each rank runs `python SCRIPT ARGS…` with RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and a free MASTER_PORT set, one OpenMP thread each (the test
boxes are small and shared). A failed launch raises with every rank's log
tail; a port taken between choosing and binding it is retried, and a rank
killed by a signal once (see `run_ranks`).
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
    """Run the ranks to completion (or kill them at `timeout`) and return their outcomes.

    A launch is repeated when a port was taken between choosing and binding it, and once
    when a rank died by a signal other than this function's own kill (gloo's TCP transport
    aborts the process on a loopback connection error now and then on a loaded machine; a
    crash that the code causes happens again and is reported).
    """
    aborted_once = False
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
        if any("address already in use" in o.log.lower() for o in outcomes):
            continue
        if not aborted_once and any(_killed_by_a_signal(o) for o in outcomes):
            aborted_once = True
            continue
        return outcomes
    return outcomes


def _killed_by_a_signal(outcome: RankOutcome) -> bool:
    """Died by a signal, not by `run_ranks`'s kill at its timeout."""
    return (
        outcome.returncode is not None
        and outcome.returncode < 0
        and not (outcome.log.endswith(" s]") and "[killed after" in outcome.log)
    )


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
