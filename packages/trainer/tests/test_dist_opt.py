"""mg-train --use-distributed-optimizer: DP=2 on gloo equals one process; checkpoints move
between DP sizes and into the plain optimizer.

Tolerance (fp32): 1e-5 relative on losses and 1e-4 on grad norms, as for DDP
(test_ddp.py). The distributed optimizer reduce-scatters the gradients in an
order that differs from one process accumulating all micro-batches, a ~1e-7
relative difference per step that AdamW carries through 20 steps.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKER = Path(__file__).with_name("ddp_worker.py")
FLAGS = ["--attention-dropout", "0", "--hidden-dropout", "0"]
LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(argvs: list[list[str]], world_size: int, out: Path) -> list[dict]:
    """ddp_worker.py on `world_size` gloo ranks, one run per argv; retried on a taken port."""
    for _ in range(3):
        port = _free_port()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(out), json.dumps(argvs)],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world_size)},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for r in range(world_size)
        ]
        logs = [p.communicate(timeout=300)[0] for p in procs]
        if all(p.returncode == 0 for p in procs):
            return json.loads(out.read_text())
        if not any("address already in use" in log.lower() for log in logs):
            break
    raise AssertionError("ranks failed:\n" + "\n".join(log[-3000:] for log in logs))


def _assert_close(reference: list[float], got: list[float], rtol: float) -> None:
    assert len(reference) == len(got)
    for a, b in zip(reference, got, strict=True):
        assert abs(a - b) <= rtol * abs(a), (reference, got)


def test_dp2_distributed_optimizer_matches_one_process(tmp_path, mock_argv, train) -> None:
    """20 iterations, global batch 8: one process (4 micro-batches of 2) vs DP=2 with the
    distributed optimizer (2 micro-batches each); a second DP=2 run saves at iteration 10
    and one process resumes it, with plain AdamW (no --use-distributed-optimizer) and with
    the distributed optimizer: iterations 11-20 equal the uninterrupted run."""
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=8, iters=20)
    one = train(argv)
    dist_opt = [*argv, "--use-distributed-optimizer"]
    ckpt = str(tmp_path / "ckpt")
    saving = [*dist_opt, "--save", ckpt, "--exit-interval", "10"]
    plain, saved = _run_ranks([dist_opt, saving], 2, tmp_path / "two.json")
    _assert_close(one.losses, plain["losses"], LOSS_RTOL)
    _assert_close(one.grad_norms, plain["grad_norms"], NORM_RTOL)
    _assert_close(one.losses[:10], saved["losses"], LOSS_RTOL)
    resumed = train([*argv, "--load", ckpt])
    _assert_close(one.losses[10:], resumed.losses, LOSS_RTOL)
    # distrib_optim.pt does not depend on the data-parallel size: DP=2 -> DP=1
    resumed = train([*dist_opt, "--load", ckpt])
    _assert_close(one.losses[10:], resumed.losses, LOSS_RTOL)


@pytest.mark.slow
def test_dp2_overlapped_distributed_optimizer_matches_one_process(
    tmp_path, mock_argv, train
) -> None:
    """As above with --overlap-grad-reduce and --overlap-param-gather over several buckets,
    with validation every 5 iterations (forwards that wait on the in-flight all-gathers)."""
    argv = mock_argv(
        tmp_path, *FLAGS, "--eval-interval", "5", "--eval-iters", "1", mbs=2, gbs=8, iters=20
    )
    one = train(argv)
    overlap = [
        *argv,
        "--use-distributed-optimizer",
        "--overlap-grad-reduce",
        "--overlap-param-gather",
        "--ddp-bucket-size",
        "5000",
    ]
    (run,) = _run_ranks([overlap], 2, tmp_path / "two.json")
    _assert_close(one.losses, run["losses"], LOSS_RTOL)
    _assert_close(one.grad_norms, run["grad_norms"], NORM_RTOL)
    _assert_close([v for _, v in one.validation], [v for _, v in run["validation"]], LOSS_RTOL)


def test_checkpoint_holds_megatrons_distrib_optim_layout(tmp_path, mock_argv, train) -> None:
    """With the distributed optimizer the torch format is Megatron's pair: the groups and
    step in model_optim_rng.pt, the flat parameter state in distrib_optim.pt beside it
    (main weights equal to the model's, in Megatron's grad-buffer order)."""
    ckpt = tmp_path / "ckpt"
    argv = mock_argv(tmp_path, *FLAGS, "--save", str(ckpt), mbs=2, gbs=4, iters=3)
    train([*argv, "--use-distributed-optimizer", "--ckpt-format", "torch"])
    folder = ckpt / "iter_0000003" / "mp_rank_00"
    state = torch.load(folder / "model_optim_rng.pt", weights_only=False)
    groups = state["optimizer"]["optimizer"]["param_groups"]
    assert {g["step"] for g in groups} == {3.0}
    assert all("params" not in g for g in groups)
    flat = torch.load(folder / "distrib_optim.pt", weights_only=True)
    assert flat["buckets_coalesced"] is True
    (buffer,) = flat[0].values()
    assert sorted(buffer) == ["exp_avg", "exp_avg_sq", "numel_unpadded", "param"]
    model = state["model"]
    # Megatron's order: reversed, each parameter 64-aligned; the last one starts at 0
    last = model["decoder.final_layernorm.bias"].reshape(-1)
    assert torch.equal(buffer["param"][: last.numel()], last)
    numel = sum(v.numel() for k, v in model.items() if "_extra_state" not in k)
    assert numel <= buffer["numel_unpadded"] < numel + 64 * len(model)
    assert buffer["exp_avg_sq"].abs().sum() > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--overlap-grad-reduce", "--pipeline-model-parallel-size", "2"],
            "needs --use-distributed-optimizer",
        ),
        (
            ["--overlap-grad-reduce", "--tensor-model-parallel-size", "2"],
            "needs --use-distributed-optimizer",
        ),
        (["--overlap-param-gather"], "only works with --use-distributed-optimizer"),
    ],
)
def test_unsupported_combinations_are_refused(tmp_path, mock_argv, flags, message) -> None:
    from mg.trainer.arguments import ArgumentError, parse_args

    with pytest.raises(ArgumentError, match=message):
        parse_args(mock_argv(tmp_path, *flags), world_size=2)


def test_dry_run_matches_the_distributed_optimizer_run(tmp_path, mock_argv) -> None:
    """The dry run's optimizer-state bytes equal what the distributed optimizer holds
    after a real CPU run (d = 1: all of AdamW's two fp32 moments, no padding)."""
    from mg.trainer.arguments import parse_args
    from mg.trainer.dry_run import estimate
    from mg.trainer.training import Trainer

    args = parse_args(mock_argv(tmp_path, "--use-distributed-optimizer", mbs=2, gbs=2, iters=3))
    trainer = Trainer(args)
    trainer.train()
    planned = estimate(args, trainer.model_config).stages[0]
    held = trainer.optimizer.memory_bytes()
    assert held["optimizer_state"] == planned.optimizer_state
    assert held["params"] == planned.weights and held["grads"] == planned.gradients
