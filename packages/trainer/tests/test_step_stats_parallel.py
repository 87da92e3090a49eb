"""--log-params-norm and --log-num-zeros-in-grad on 2 gloo ranks equal one process.

One 2-rank launch trains a tiny GPT (untied embeddings: the padded vocabulary row of
the input embedding never gets a gradient, so there are zeros to count) at TP=2,
then at DP=2 with the distributed optimizer (its gradient reduction and parameter
gather overlapped). Every rank logs the same figures; the params norm equals the
norm over the whole (gathered) parameters and the one-process run's, each
parameter counted once (TP-replicated norms once, shards summed); the zeros equal
a count over the whole gradients (TP) and the one-process run's count; the TP
grad norm (the same reduction) equals the one-process one.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("step_stats_worker.py")
ITERS = 4
FLAGS = [
    "--log-params-norm",
    "--log-num-zeros-in-grad",
    "--untie-embeddings-and-output-weights",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]


def _run_ranks(argvs: list[list[str]], world_size: int, out: Path) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), json.dumps(argvs)],
            env=dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(world_size),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                OMP_NUM_THREADS="1",
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode != 0 for p in procs):
        raise AssertionError("ranks failed:\n" + "\n".join(log[-3000:] for log in logs))
    return json.loads(out.read_text())


def _close(a: list[float], b: list[float], rtol: float = 1e-5) -> None:
    assert len(a) == len(b) == ITERS
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= rtol * abs(y), (a, b)


@pytest.mark.slow
def test_tp2_and_distributed_optimizer_match_one_process(tmp_path, mock_argv, train) -> None:
    base = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=8, iters=ITERS)
    tp2 = [*base, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    dist_opt = [*base, "--make-vocab-size-divisible-by", "128", "--use-distributed-optimizer"]
    tp_run, dp_run = _run_ranks([tp2, [*dist_opt, *overlap]], 2, tmp_path / "two.json")

    one_norms: list[float] = []
    one_zeros: list[int] = []

    def record(trainer) -> None:
        one_norms.append(trainer.stats.params_norm)
        one_zeros.append(trainer.stats.num_zeros)

    one = train([*base, "--make-vocab-size-divisible-by", "128"], on_iteration=record)
    assert min(one_zeros) >= 32  # the padded row of the 32-wide input embedding
    for run in (tp_run, dp_run):
        for ranks in run["per_rank"]:  # every rank logs the same figures
            assert all(r == ranks[0] for r in ranks), ranks
        _close(run["params_norms"], run["reference_norms"], 1e-12)
        _close(run["params_norms"], one_norms)
        assert run["num_zeros"] == one_zeros
    assert tp_run["num_zeros"] == tp_run["reference_zeros"]
    _close(tp_run["grad_norms"], one.grad_norms)
    _close(dp_run["grad_norms"], one.grad_norms)
