"""mg-train with tensor (and sequence) parallelism on 4 gloo ranks matches one process.

One 4-rank launch trains, one after the other: a tiny GPT-2 shape at TP=2
(DP=2) and TP=4, a tiny Qwen shape (the Llama shape below with Qwen2's
QKV-only biases and Qwen3's per-head QK norms) at TP=2 + sequence parallel, a
tiny Llama shape (GQA, SwiGLU, RMSNorm, RoPE, untied), and saves the Llama run at TP=2 x DP=2 in the
torch_dist format; then reloads that checkpoint at TP=1 (DP=4) and TP=4 and
trains on. Each is compared with the same flags in one process.

`--make-vocab-size-divisible-by` is scaled so the padded vocabulary (a
multiple of divisor x TP, as in Megatron) is 128 in every run: otherwise the
models would differ. Dropout is off.

Tolerance: 20 iterations, losses equal to 1e-5 relative (fp32). Tensor
parallelism only changes the order of floating-point sums (split matmul
inner sums all-reduced, the softmax denominator summed per vocab shard, the
gradient norm's squares), ~1e-7 relative per step; Adam keeps the runs
together, as the single-process test of mg.core.parallel shows at 1e-5.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _sibling(name: str):
    """A module beside this file (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_tp_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_ranks = _sibling("test_ddp.py").run_ranks
_helpers = _sibling("conftest.py")

ITERS = 20
RTOL = 1e-5
LLAMA = [
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--ffn-hidden-size",
    "64",
    "--num-attention-heads",
    "8",
    "--group-query-attention",
    "--num-query-groups",
    "4",
    "--lr-decay-iters",
    str(ITERS),
    "--position-embedding-type",
    "rope",
    "--untie-embeddings-and-output-weights",
    "--disable-bias-linear",
]
NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
QWEN = ["--add-qkv-bias", "--qk-layernorm"]


def _vocab(tp: int) -> list[str]:
    return ["--make-vocab-size-divisible-by", str(128 // tp)]


def _tp(tp: int) -> list[str]:
    return ["--tensor-model-parallel-size", str(tp), *_vocab(tp)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("tp")
    ckpt = str(tmp / "ckpt")
    gpt = _helpers._mock_argv(tmp, *NO_DROPOUT, mbs=2, gbs=8, iters=ITERS)
    llama = [*gpt, *LLAMA]
    # The saving run stops at iteration 10 (same LR schedule: --lr-decay-iters 20); its
    # background saves at 3, 6 and 9 are in flight while training and the exit check run.
    half = ["--train-iters", str(ITERS // 2), "--exit-interval", str(ITERS // 2)]
    save = ["--save", ckpt, "--ckpt-format", "torch_dist", "--async-save", *half]
    save += ["--save-interval", "3"]
    resume = ["--load", ckpt, "--ckpt-format", "torch_dist"]
    argvs = {
        "gpt_tp2": [*gpt, *_tp(2)],
        "gpt_tp4": [*gpt, *_tp(4)],
        "qwen_tp2_sp": [*llama, *QWEN, *_tp(2), "--sequence-parallel"],
        "llama_tp2_dp2_save": [*llama, *_tp(2), *save],
        "llama_resume_tp1": [*llama, *_tp(1), *resume],
        "llama_resume_tp4": [*llama, *_tp(4), *resume],
    }
    four = run_ranks(list(argvs.values()), 4, tmp / "four.json")
    return {
        "four": dict(zip(argvs, four, strict=True)),
        "gpt": gpt,
        "llama": llama,
        "ckpt": ckpt,
    }


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=RTOL), (a, b)


def test_gpt_tensor_parallel_matches_one_process(runs, train) -> None:
    one = train([*runs["gpt"], *_vocab(1)])
    assert len(one.losses) == ITERS
    _close(runs["four"]["gpt_tp2"]["losses"], one.losses)
    _close(runs["four"]["gpt_tp4"]["losses"], one.losses)
    _close(runs["four"]["gpt_tp2"]["grad_norms"], one.grad_norms)


@pytest.fixture(scope="module")
def llama_one(runs) -> list[float]:
    return _helpers._train([*runs["llama"], *_vocab(1)]).losses


def test_llama_and_qwen_tensor_and_sequence_parallel_match_one_process(
    runs, llama_one, train
) -> None:
    _close(runs["four"]["llama_tp2_dp2_save"]["losses"], llama_one[: ITERS // 2])
    qwen_one = train([*runs["llama"], *QWEN, *_vocab(1)]).losses
    _close(runs["four"]["qwen_tp2_sp"]["losses"], qwen_one)
    assert qwen_one != llama_one  # the QKV biases and QK norms take part


@pytest.mark.parametrize("layout", ["tp1", "tp4"])
def test_torch_dist_checkpoint_resumes_in_another_layout(runs, llama_one, layout) -> None:
    """Saved at iteration 10 by TP=2 x DP=2 (async); resumed at TP=1 x DP=4 and at
    TP=4, iterations 11..20 have the one-process run's losses."""
    ckpt = Path(runs["ckpt"])
    assert (ckpt / "iter_0000010" / "metadata.json").is_file()
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "10"
    _close(runs["four"][f"llama_resume_{layout}"]["losses"], llama_one[ITERS // 2 :])
