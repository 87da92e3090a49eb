"""`--torch-compile` and `--cross-entropy-loss-fusion` train like the plain step, alone and
with parallelism.

Inductor fuses the elementwise work between matmuls, which reorders a few fp32
sums (norm statistics, fused backward reductions): losses agree with eager to
1e-5 relative over 10 iterations (Adam included), not bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mg.core.testing.launch import launch_workers

WORKER = Path(__file__).with_name("ddp_worker.py")
FLAGS = ["--attention-dropout", "0", "--hidden-dropout", "0", "--lr-decay-iters", "20"]
RTOL = 1e-5


def _close(reference: list[float], losses: list[float], name: str) -> None:
    assert len(losses) == len(reference), name
    for a, b in zip(reference, losses, strict=True):
        assert abs(a - b) / abs(a) <= RTOL, (name, reference, losses)


def test_compiled_layers_train_like_eager(tmp_path: Path, mock_argv, train) -> None:
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=4, iters=10)
    eager = train(argv)
    compiled = train([*argv, "--torch-compile"])
    _close(eager.losses, compiled.losses, "compiled")
    recomputed = train(
        [
            *argv,
            "--torch-compile",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ]
    )
    _close(eager.losses, recomputed.losses, "compiled + full recompute")


@pytest.mark.slow
def test_compiled_layers_with_parallelism_match_eager(tmp_path: Path, mock_argv, train) -> None:
    """2 ranks: DP=2, TP=2 + SP, PP=2 and FSDP ZeRO-3 (compiled layers, then sharded as
    torchtitan does) against one eager process."""
    argv = mock_argv(
        tmp_path, *FLAGS, "--make-vocab-size-divisible-by", "64", mbs=2, gbs=4, iters=10
    )
    eager = train(argv)
    configs = {
        "dp2": [],
        "tp2 sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        "pp2": ["--pipeline-model-parallel-size", "2"],
        "fsdp": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
        + ["--data-parallel-sharding-strategy", "optim_grads_params"],
    }
    out = tmp_path / "runs.json"
    argvs = [[*argv, "--torch-compile", *c] for c in configs.values()]
    launch_workers(str(WORKER), 2, [str(out), json.dumps(argvs)], timeout=900)
    for name, run in zip(configs, json.loads(out.read_text()), strict=True):
        _close(eager.losses, run["losses"], name)


def test_missing_compiler_is_refused(tmp_path: Path, mock_argv, monkeypatch) -> None:
    import shutil

    from mg.trainer.arguments import ArgumentError, parse_args

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ArgumentError, match="--torch-compile: torch.compile on CPU needs a C"):
        parse_args(mock_argv(tmp_path, "--torch-compile"), world_size=1)


def test_cross_entropy_loss_fusion_trains_like_unfused(tmp_path: Path, mock_argv, train) -> None:
    """fp32, one process and PP=2 (the last stage takes the fused loss) on 2 ranks."""
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=4, iters=10)
    plain = train(argv)
    _close(plain.losses, train([*argv, "--cross-entropy-loss-fusion"]).losses, "fused")
    out = tmp_path / "pp.json"
    pp2 = [*argv, "--cross-entropy-loss-fusion", "--pipeline-model-parallel-size", "2"]
    launch_workers(str(WORKER), 2, [str(out), json.dumps([pp2])], timeout=600)
    _close(plain.losses, json.loads(out.read_text())[0]["losses"], "fused pp2")


def test_cross_entropy_loss_fusion_with_tp_is_refused(tmp_path: Path, mock_argv) -> None:
    from mg.trainer.arguments import ArgumentError, parse_args

    flags = ["--cross-entropy-loss-fusion", "--tensor-model-parallel-size", "2"]
    with pytest.raises(ArgumentError, match="already vocab-parallel"):
        parse_args(mock_argv(tmp_path, *flags), world_size=2)
