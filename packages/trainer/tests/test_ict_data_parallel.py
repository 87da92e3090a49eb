"""Data-parallel `mg-train ict` on 2 gloo ranks matches one process on the same global batch.

Each query's negatives are the blocks of every rank (Megatron's pretrain_ict.py), so DP=2
with micro-batch b per rank is one process with micro-batch 2b: the same scores, the same
loss, and (the gather's reduce-scatter and the gradient average together, family_ict's
docstring) the same gradients. Compared over 5 iterations from a tiny BERT, fp32, dropout
off: every logged loss, the validation losses and the final weights of both towers, to
1e-6, and the gradient norms to 1e-5 relative. Runs: gradients all-reduced after
backward, DDP's overlapped reduction, and the distributed optimizer with 2 micro-batches
accumulated per rank (global batch 4b).

SGD, not Adam: some gradients are zero in exact arithmetic (the context tower's final
LayerNorm bias, the attention's key biases: shifting every block's embedding adds the
same score to all of a query's candidates), and Adam turns their fp32 round-off, which
differs with the order of sums, into steps of ±lr (3.7e-3 measured on that bias).
`--retriever-score-scaling` (scores √32 smaller) and no clipping keep this random
tiny BERT where fp32 round-off does not grow: without them the losses drift apart by
1.2e-6 by iteration 3 (gradient norms 3.6e-6), with them they stay within 2.4e-7,
the weights within 1.2e-7. A gather whose backward only slices (Megatron's, which
needs every rank to compute the whole batch's loss) fails here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from mg.core.testing.launch import launch_workers

sys.path.insert(0, str(Path(__file__).parent))
from sentence_data import TINY, build_sentence_corpus, vocab_file  # noqa: E402

WORKER = Path(__file__).with_name("ddp_worker.py")
ITERS = 5
B = 4  # micro-batch per rank
TOL = 1e-6


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_ictdp_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _argv(prefix: str, bert: str, folder: Path, mbs: int, gbs: int, *extra: str) -> list[str]:
    argv = ["ict", *TINY, "--seq-length", "64", "--tokenizer-type", "BertWordPieceLowerCase"]
    argv += ["--vocab-file", vocab_file(), "--data-path", prefix, "--bert-load", bert]
    argv += ["--data-cache-path", str(folder.parent / "cache"), "--save", str(folder)]
    argv += ["--split", "80,20,0", "--ckpt-format", "torch", "--optimizer", "sgd", "--lr", "0.05"]
    argv += ["--train-iters", str(ITERS), "--eval-interval", "5", "--eval-iters", "2"]
    argv += ["--hidden-dropout", "0", "--attention-dropout", "0", "--clip-grad", "0"]
    argv += ["--save-interval", "100", "--retriever-score-scaling"]
    return [*argv, "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs), *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    tmp = tmp_path_factory.mktemp("ict_dp")
    prefix = build_sentence_corpus(tmp)
    bert = _sibling("test_ict.py").tiny_bert_checkpoint(tmp / "bert")
    two = {
        "allreduce": _argv(prefix, bert, tmp / "allreduce", B, 2 * B),
        "ddp_overlap": _argv(prefix, bert, tmp / "ddp", B, 2 * B, "--overlap-grad-reduce"),
        "dist_opt_accumulate": _argv(
            prefix, bert, tmp / "dist_opt", B, 4 * B, "--use-distributed-optimizer"
        ),
    }
    out = tmp / "two.json"
    launch_workers(str(WORKER), 2, [str(out), json.dumps(list(two.values()))])
    results = dict(zip(two, json.loads(out.read_text()), strict=True))
    one = {}
    for gbs in (2 * B, 4 * B):
        result = Trainer(parse_args(_argv(prefix, bert, tmp / f"one_{gbs}", 2 * B, gbs))).train()
        one[gbs] = {
            "losses": result.losses,
            "grad_norms": result.grad_norms,
            "validation": result.validation,
        }
    return {"tmp": tmp, "two": results, "one": one}


def _weights(folder: Path) -> dict:
    from mg.core.checkpoint import load_checkpoint

    return load_checkpoint(folder)[0]["model"]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("run", "gbs", "folder"),
    [
        ("allreduce", 2 * B, "allreduce"),
        ("ddp_overlap", 2 * B, "ddp"),
        ("dist_opt_accumulate", 4 * B, "dist_opt"),
    ],
)
def test_data_parallel_ict_matches_one_process(runs, run: str, gbs: int, folder: str) -> None:
    two, one = runs["two"][run], runs["one"][gbs]
    print(run, "DP=2 losses", two["losses"], "one process", one["losses"])
    print(run, "gradient norms", two["grad_norms"], one["grad_norms"])
    assert len(one["losses"]) == ITERS
    for a, b in zip(two["losses"], one["losses"], strict=True):
        assert abs(a - b) <= TOL, (two["losses"], one["losses"])
    for a, b in zip(two["grad_norms"], one["grad_norms"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    for (i, a), (j, b) in zip(two["validation"], one["validation"], strict=True):
        assert i == j and abs(a - b) <= TOL
    assert len(two["validation"]) == len(one["validation"]) > 0
    ours, reference = _weights(runs["tmp"] / folder), _weights(runs["tmp"] / f"one_{gbs}")
    assert ours.keys() == reference.keys()
    worst = max(float((ours[k] - reference[k]).abs().max()) for k in reference)
    print(run, "largest weight difference", worst)
    assert worst <= TOL


def test_model_parallel_and_fsdp_still_refused(tmp_path) -> None:
    """Data parallelism is the one kind mg-train ict takes."""
    from mg.trainer.arguments import ArgumentError, parse_args

    prefix, bert = "corpus_text_sentence", str(tmp_path / "bert")
    argv = _argv(prefix, bert, tmp_path / "ckpt", B, 2 * B)
    with pytest.raises(ArgumentError, match="without model parallelism"):
        parse_args([*argv, "--tensor-model-parallel-size", "2"], world_size=2)
    fsdp = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
    with pytest.raises(ArgumentError, match="^mg-train ict does not support --use-megatron-fsdp"):
        parse_args([*argv, *fsdp], world_size=2)
