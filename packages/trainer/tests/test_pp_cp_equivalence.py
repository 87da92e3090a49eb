"""Pipeline and context parallelism in mg-train match one process, 20 iterations, fp32.

Each launch runs several configurations in one process group (ddp_worker.py),
all on the same global batches as the single-process run: a tiny GPT with
4 layers, tied embeddings (so the embedding group is exercised), mock data,
MBS 2, GBS 8, dropout 0, AdamW with clipping.

Tolerance: the parallel runs do the same arithmetic in another order (the
ring's blockwise softmax, gradient sums over ranks, the tied embedding's two
halves added by an all-reduce), ~1e-7 relative per step; Adam amplifies
that a little over 20 steps, so losses must agree to 1e-5 relative and
gradient norms to 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mg.core.testing.launch import launch_workers

WORKER = Path(__file__).with_name("ddp_worker.py")

LOSS_RTOL = 1e-5
NORM_RTOL = 1e-4
FLAGS = ["--num-layers", "4", "--attention-dropout", "0", "--hidden-dropout", "0"]
# small buckets: several per stage, the tied embedding in one of its own
DIST_OPT_OVERLAPPED = [
    "--use-distributed-optimizer",
    "--overlap-grad-reduce",
    "--overlap-param-gather",
    "--ddp-bucket-size",
    "3000",
]


def run_ranks(argvs: list[list[str]], world_size: int, out: Path) -> list[dict]:
    """Train each argv on `world_size` gloo ranks (one process group); rank 0's results."""
    launch_workers(str(WORKER), world_size, [str(out), json.dumps(argvs)], timeout=600)
    return json.loads(out.read_text())


def _check(one, runs: list[dict], names: list[str]) -> None:
    for name, run in zip(names, runs, strict=True):
        assert len(run["losses"]) == len(one.losses) == 20, name
        for a, b in zip(one.losses, run["losses"], strict=True):
            assert abs(a - b) / abs(a) <= LOSS_RTOL, (name, one.losses, run["losses"])
        for a, b in zip(one.grad_norms, run["grad_norms"], strict=True):
            assert abs(a - b) / abs(a) <= NORM_RTOL, (name, one.grad_norms, run["grad_norms"])


@pytest.fixture
def reference(tmp_path: Path, mock_argv, train):
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=8, iters=20)
    return argv, train(argv)


def test_two_ranks_pp2_interleaved_cp2_match_one(tmp_path: Path, reference) -> None:
    """PP=2 (1F1B, 4 micro-batches), PP=2 with 2 virtual stages per rank, CP=2; interleaved
    PP=2 with full recompute; PP=2 with the distributed optimizer and both overlaps."""
    argv, one = reference
    configs = {
        "pp2": ["--pipeline-model-parallel-size", "2"],
        "pp2 interleaved": [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
        "cp2": ["--context-parallel-size", "2"],
        "pp2 interleaved, full recompute": [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
        "pp2 distributed optimizer, overlapped": [
            "--pipeline-model-parallel-size",
            "2",
            *DIST_OPT_OVERLAPPED,
        ],
    }
    runs = run_ranks([[*argv, *c] for c in configs.values()], 2, tmp_path / "two.json")
    _check(one, runs, list(configs))


@pytest.mark.slow
def test_four_ranks_pp2_dp2_cp2_dp2_pp2_cp2_match_one(tmp_path: Path, reference) -> None:
    """PP=2 x DP=2, interleaved PP=2 x DP=2, CP=2 x DP=2, PP=2 x CP=2 on 4 processes."""
    argv, one = reference
    configs = {
        "pp2 dp2": ["--pipeline-model-parallel-size", "2"],
        "pp2 interleaved dp2": [
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "1",
        ],
        "cp2 dp2": ["--context-parallel-size", "2"],
        "pp2 cp2": ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"],
    }
    runs = run_ranks([[*argv, *c] for c in configs.values()], 4, tmp_path / "four.json")
    _check(one, runs, list(configs))


@pytest.mark.slow
def test_four_ranks_pp2_tp2_and_tp2_cp2_match_one(tmp_path: Path, mock_argv, train) -> None:
    """PP=2 x TP=2 (with and without sequence parallelism) and TP=2 x CP=2 on 4 processes.

    The vocabulary is padded to a multiple of 64·tp, so 127 ids give 128 rows at
    TP=1 and TP=2 alike (with the default 128·tp the two models would differ)."""
    argv = mock_argv(
        tmp_path, *FLAGS, "--make-vocab-size-divisible-by", "64", mbs=2, gbs=8, iters=20
    )
    one = train(argv)
    configs = {
        "pp2 tp2": ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2"],
        "pp2 tp2 sp": [
            "--pipeline-model-parallel-size",
            "2",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
        ],
        "tp2 cp2": ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2"],
    }
    runs = run_ranks([[*argv, *c] for c in configs.values()], 4, tmp_path / "four_tp.json")
    _check(one, runs, list(configs))


def test_four_ranks_distributed_optimizer_with_pipeline_matches_one(
    tmp_path: Path, mock_argv, train
) -> None:
    """The distributed optimizer under PP=2 x DP=2 (1F1B and interleaved, overlapped grad
    reduce-scatter and param all-gather) and PP=2 x TP=2: the tied embedding's shards are
    summed over the embedding group, the grad norm over stages counts it once."""
    argv = mock_argv(
        tmp_path, *FLAGS, "--make-vocab-size-divisible-by", "64", mbs=2, gbs=8, iters=20
    )
    one = train(argv)
    pp2 = ["--pipeline-model-parallel-size", "2"]
    configs = {
        "pp2 dp2 dist-opt overlapped": [*pp2, *DIST_OPT_OVERLAPPED],
        "pp2 interleaved dp2 dist-opt overlapped": [
            *pp2,
            "--num-layers-per-virtual-pipeline-stage",
            "1",
            *DIST_OPT_OVERLAPPED,
        ],
        "pp2 tp2 sp dist-opt": [
            *pp2,
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--use-distributed-optimizer",
        ],
    }
    runs = run_ranks([[*argv, *c] for c in configs.values()], 4, tmp_path / "four_do.json")
    _check(one, runs, list(configs))
