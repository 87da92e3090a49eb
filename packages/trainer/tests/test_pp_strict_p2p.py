"""Every pipeline schedule of mg-train under NCCL's point-to-point rules matches one process.

The ranks use gloo, which would forgive tagged messages and unbatched or
out-of-order exchanges; `mg.core.testing.strict_p2p` (installed in each rank
by strict_p2p_worker.py) refuses them: lone send/recv and tags raise, every
batch is a rendezvous (a send completes only once the peer has received it),
and each message's header is checked against what the receive expected. A
schedule that would deadlock on NCCL hangs and fails; one that receives out
of order fails on the header check and would change the losses.

One 4-rank launch runs every layout in sequence, 20 iterations each on a tiny
GPT (4 layers, tied embeddings, mock data, MBS 1, GBS 8, fp32): PP=2 (1F1B,
DP=2: 4 micro-batches per pipeline), interleaved PP=2 with 2 chunks per rank,
PP=2 x DP=2 with the distributed optimizer and overlapped grad reduce,
PP=2 x TP=2 with sequence parallelism, and PP=2 x CP=2 (8 micro-batches
each). Losses must equal the single-process run's to 1e-5 relative and grad
norms too (the tolerance of test_pp_cp_equivalence.py, where its reasoning
is written down). One 2-rank launch trains PP=2 under --bf16 and --fp16 (10 iterations):
activations and gradients must cross in that dtype, and the loss must stay
finite and within 2e-2 relative of fp32's (bf16 keeps 8 bits of mantissa).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from mg.core.testing.launch import launch_workers

WORKER = Path(__file__).with_name("strict_p2p_worker.py")
LOSS_RTOL = 1e-5
NORM_RTOL = 1e-5
# 64·tp vocabulary padding: 127 ids give 128 rows at TP=1 and TP=2 alike
FLAGS = [
    "--num-layers", "4", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--make-vocab-size-divisible-by", "64",
]  # fmt: skip
PP2 = ["--pipeline-model-parallel-size", "2"]
CONFIGS = {
    "pp2 1f1b dp2": PP2,
    "pp2 interleaved v=2 dp2": [*PP2, "--num-layers-per-virtual-pipeline-stage", "1"],
    "pp2 dp2 dist-opt overlapped": [
        *PP2, "--use-distributed-optimizer", "--overlap-grad-reduce",
    ],
    "pp2 tp2 sp": [*PP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2 cp2": [*PP2, "--context-parallel-size", "2"],
}  # fmt: skip


def _launch(argvs: list[list[str]], world_size: int, out: Path) -> list[list[dict]]:
    """Each rank's results (one entry per argv)."""
    out.mkdir()
    launch_workers(str(WORKER), world_size, [str(out), json.dumps(argvs)], timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world_size)]


def _close(a: list[float], b: list[float], rtol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= rtol * abs(x) for x, y in zip(a, b, strict=True))


@pytest.fixture
def one(tmp_path: Path, mock_argv, train):
    """The single-process run every layout must match, and its argv."""
    argv = mock_argv(tmp_path, *FLAGS, mbs=1, gbs=8, iters=20)
    return argv, train(argv)


def test_every_pipeline_layout_under_nccl_rules_matches_one_process(tmp_path: Path, one) -> None:
    argv, reference = one
    ranks = _launch([[*argv, *c] for c in CONFIGS.values()], 4, tmp_path / "four")
    for i, name in enumerate(CONFIGS):
        run = ranks[0][i]
        assert _close(reference.losses, run["losses"], LOSS_RTOL), (name, reference.losses, run)
        assert _close(reference.grad_norms, run["grad_norms"], NORM_RTOL), (name, run)
        # the pipeline's messages crossed, in fp32, with the run's one shape
        kinds = {c["kind"] for r in ranks for c in r[i]["p2p"]}
        assert {"activations", "output gradient"} <= kinds, (name, kinds)


def test_bf16_and_fp16_pipelines_send_in_the_compute_dtype(tmp_path: Path, one) -> None:
    """Under fp16 the dynamic loss scale starts at 2^32 and skips the first steps (Megatron's
    behaviour), so only its first loss, before any update, is compared."""
    argv, reference = one
    short = [*argv, "--train-iters", "10"]
    runs = _launch([[*short, *PP2, "--bf16"], [*short, *PP2, "--fp16"]], 2, tmp_path / "two")
    for i, dtype in enumerate(["torch.bfloat16", "torch.float16"]):
        for rank in runs:
            crossed = [c for c in rank[i]["p2p"] if c["kind"] is not None]
            assert {c["kind"] for c in crossed} == {"activations", "output gradient"}, crossed
            for c in crossed:
                assert c["dtype"] == dtype and c["shape"] == [1, 32, 32], c
        losses = runs[0][i]["losses"]
        assert len(losses) == 10 and all(math.isfinite(x) for x in losses), (dtype, losses)
        compared = 10 if dtype == "torch.bfloat16" else 1
        assert _close(reference.losses[:compared], losses[:compared], 2e-2), (
            dtype,
            reference.losses,
            losses,
        )
