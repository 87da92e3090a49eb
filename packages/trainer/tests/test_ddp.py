"""Two CPU processes (gloo) with data parallelism match one process on the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).with_name("ddp_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(argvs: list[list[str]], world_size: int, out: Path, attempts: int = 3) -> list[dict]:
    """Launch `world_size` ranks of ddp_worker.py; retry when another process took the port."""
    for _ in range(attempts):
        port = _free_port()
        procs = []
        for rank in range(world_size):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(out), json.dumps(argvs)],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                )
            )
        logs = [p.communicate(timeout=300)[0] for p in procs]
        if all(p.returncode == 0 for p in procs):
            return json.loads(out.read_text())
        if not any("address already in use" in log.lower() for log in logs):
            break
    raise AssertionError("ranks failed:\n" + "\n".join(log[-3000:] for log in logs))


def test_two_processes_match_one(tmp_path, mock_argv, train) -> None:
    """DP=2 x MBS 2 (each rank half of every global batch of 8) vs one process accumulating
    4 micro-batches of 2; with gradients all-reduced after backward and with DDP overlap."""
    flags = [
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--eval-interval",
        "3",
        "--eval-iters",
        "1",
    ]
    argv = mock_argv(tmp_path, *flags, mbs=2, gbs=8, iters=6)
    one = train(argv)
    runs = run_ranks([argv, [*argv, "--overlap-grad-reduce"]], 2, tmp_path / "two.json")
    for two in runs:
        for a, b in zip(one.losses, two["losses"], strict=True):
            assert abs(a - b) / abs(a) <= 1e-5, (one.losses, two["losses"])
        for a, b in zip(one.grad_norms, two["grad_norms"], strict=True):
            assert abs(a - b) / abs(a) <= 1e-4
        for (i, a), (j, b) in zip(one.validation, two["validation"], strict=True):
            assert i == j and abs(a - b) / abs(a) <= 1e-5
