"""The distributed optimizer with tensor parallelism on 4 gloo ranks matches one process.

One 4-rank launch trains a tiny GPT-2 shape (biases, tied embeddings) at TP=2 x DP=2
with `--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather`
(and again saving at iteration 10 in the `torch` format and resuming in the same layout),
a tiny Llama shape (GQA, SwiGLU, RMSNorm, untied) at TP=2 + sequence parallel x
DP=2 with the distributed optimizer, saving at iteration 10 (torch_dist), and
resumes that checkpoint at TP=1 x DP=4 with the distributed optimizer; the GPT-2 shape
is also saved so in torch_dist and resumed at TP=2 by plain AdamW. Each is compared with
the same flags in one process (plain AdamW).

Each TP rank's distributed optimizer shards its local parameter shards over the
data-parallel ranks; sequence-parallel norms' partial gradients are summed over
TP before the reduce-scatter; the gradient norm sums TP-sharded squares over TP
and counts replicated ones once. Tolerance: as in test_tp_training (fp32, 20
iterations, 1e-5 relative): only the order of floating-point sums changes.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _sibling(name: str):
    """A module beside this file (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_dotp_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_ranks = _sibling("test_ddp.py").run_ranks
_helpers = _sibling("conftest.py")
_tp_training = _sibling("test_tp_training.py")
ITERS, LLAMA, NO_DROPOUT = _tp_training.ITERS, _tp_training.LLAMA, _tp_training.NO_DROPOUT
_tp, _vocab, _close = _tp_training._tp, _tp_training._vocab, _tp_training._close
DIST_OPT = ["--use-distributed-optimizer"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("dist_opt_tp")
    ckpt = str(tmp / "ckpt")
    gpt_ckpt = str(tmp / "gpt_ckpt")
    gpt = _helpers._mock_argv(tmp, *NO_DROPOUT, mbs=2, gbs=8, iters=ITERS)
    llama = [*gpt, *LLAMA]
    save = ["--save", ckpt, "--ckpt-format", "torch_dist", "--train-iters", str(ITERS // 2)]
    overlap = ["--overlap-grad-reduce", "--overlap-param-gather"]
    torch_ckpt = ["--ckpt-format", "torch", "--save", str(tmp / "torch_ckpt")]
    torch_ckpt += ["--lr-decay-iters", str(ITERS)]  # the 20-iteration schedule, saved at 10
    gpt_dist = ["--ckpt-format", "torch_dist", "--save", gpt_ckpt, "--lr-decay-iters", str(ITERS)]
    argvs = {
        "gpt_tp2_dp2": [*gpt, *_tp(2), *DIST_OPT, *overlap],
        "gpt_torch_save": [*gpt, *_tp(2), *DIST_OPT, *torch_ckpt, "--train-iters", "10"],
        "gpt_torch_resume": [
            *gpt,
            *_tp(2),
            *DIST_OPT,
            *torch_ckpt,
            "--load",
            str(tmp / "torch_ckpt"),
        ],
        "llama_tp2_sp_dp2_save": [*llama, *_tp(2), "--sequence-parallel", *DIST_OPT, *save],
        "llama_resume_tp1_dp4": [*llama, *_tp(1), *DIST_OPT, "--load", ckpt],
        # torch_dist with the distributed optimizer, resumed by plain AdamW at TP=2
        "gpt_dist_save": [*gpt, *_tp(2), *DIST_OPT, *gpt_dist, "--train-iters", "10"],
        "gpt_resume_tp2_plain": [*gpt, *_tp(2), *gpt_dist, "--load", gpt_ckpt],
    }
    four = run_ranks(list(argvs.values()), 4, tmp / "four.json")
    return {"four": dict(zip(argvs, four, strict=True)), "gpt": gpt, "llama": llama}


def test_gpt_tp2_dp2_distributed_optimizer_with_overlap_matches_one_process(runs, train) -> None:
    one = train([*runs["gpt"], *_vocab(1)])
    _close(runs["four"]["gpt_tp2_dp2"]["losses"], one.losses)
    _close(runs["four"]["gpt_tp2_dp2"]["grad_norms"], one.grad_norms)
    # torch format: one mp_rank_0T file per TP rank with its shard's full optimizer state
    _close(runs["four"]["gpt_torch_save"]["losses"], one.losses[: ITERS // 2])
    _close(runs["four"]["gpt_torch_resume"]["losses"], one.losses[ITERS // 2 :])
    # plain AdamW over DTensors (foreach=False) from the distributed optimizer's torch_dist
    # state, whose stored groups say fused=True
    _close(runs["four"]["gpt_dist_save"]["losses"], one.losses[: ITERS // 2])
    _close(runs["four"]["gpt_resume_tp2_plain"]["losses"], one.losses[ITERS // 2 :])


def test_llama_sp_distributed_optimizer_saves_and_resumes_at_tp1(runs, train) -> None:
    one = train([*runs["llama"], *_vocab(1)])
    _close(runs["four"]["llama_tp2_sp_dp2_save"]["losses"], one.losses[: ITERS // 2])
    _close(runs["four"]["llama_tp2_sp_dp2_save"]["grad_norms"], one.grad_norms[: ITERS // 2])
    _close(runs["four"]["llama_resume_tp1_dp4"]["losses"], one.losses[ITERS // 2 :])
