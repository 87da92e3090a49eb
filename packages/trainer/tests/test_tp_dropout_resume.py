"""TP=2 + SP and PP=2 with dropout: a resume continues every random stream, in both formats.

Each rank's tensor-parallel dropout stream is stored next to the default
generators: in its mp_rank file (Megatron's `rng_tracker_states
["model-parallel-rng"]`) or, in torch_dist, as a tensor under `rng.tp<T>_pp<P>`.
5 + save + load + 5 iterations equal 10 straight ones. With pipeline
parallelism each stage's generators are seeded `seed + 100 * pp_rank`
(Megatron's), so the stages draw different masks, and a run is bitwise
reproducible.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mg.core.testing.launch import launch_workers

WORKER = Path(__file__).with_name("ddp_worker.py")


def _straight_and_resumed(tmp_path: Path, argv: list[str], repeat: bool = False) -> list[dict]:
    """The run of `argv` (twice with `repeat`), its first 5 iterations saved, and the
    resume of those: each run's results, in that order, from one 2-rank launch."""
    ckpt = str(tmp_path / "ckpt")
    argvs = [argv, *([argv] if repeat else [])]
    argvs += [[*argv, "--save", ckpt, "--save-interval", "5", "--exit-interval", "5"]]
    argvs += [[*argv, "--load", ckpt]]
    out = tmp_path / "runs.json"
    launch_workers(str(WORKER), 2, [str(out), json.dumps(argvs)], timeout=600)
    runs = json.loads(out.read_text())
    straight, resumed = runs[0], runs[-1]
    assert len(resumed["losses"]) == 5
    assert resumed["losses"] == straight["losses"][5:]
    return runs


def _dropout_argv(tmp_path: Path, mock_argv, *flags: str) -> list[str]:
    dropout = ("--attention-dropout", "0.1", "--hidden-dropout", "0.1")
    return mock_argv(tmp_path, *dropout, *flags, mbs=2, gbs=4, iters=10)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_tp_dropout_resume_equals_straight_run(tmp_path: Path, mock_argv, ckpt_format) -> None:
    tp = ("--tensor-model-parallel-size", "2", "--sequence-parallel")
    vocab = ("--make-vocab-size-divisible-by", "64")
    argv = _dropout_argv(tmp_path, mock_argv, *tp, *vocab, "--ckpt-format", ckpt_format)
    _straight_and_resumed(tmp_path, argv)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_pp_dropout_is_per_stage_reproducible_and_resumes(
    tmp_path: Path, mock_argv, ckpt_format
) -> None:
    pp = ("--pipeline-model-parallel-size", "2")
    argv = _dropout_argv(tmp_path, mock_argv, *pp, "--ckpt-format", ckpt_format)
    straight, again, *_ = _straight_and_resumed(tmp_path, argv, repeat=True)
    assert straight["seeds"] == [1234, 1334]  # seed + 100 * pipeline rank
    assert again["losses"] == straight["losses"]  # bitwise
