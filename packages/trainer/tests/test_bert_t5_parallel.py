"""`mg-train bert` and `mg-train t5` with tensor, sequence and pipeline parallelism on 4
gloo ranks match one process.

One 4-rank launch trains, one after the other: BERT at TP=2 + sequence parallel
(DP=2), at PP=2 (DP=2, the tied embedding's copy on the last stage) and at
TP=2 x PP=2, and T5 at TP=2 + sequence parallel (DP=2); each against the same
flags in one process, on the sentence-split Botchan corpus. Compared: the LM
loss of every iteration, BERT's sentence-order loss (logged from the last
stage under PP), the gradient norms and the validation losses, to 1e-5
relative (fp32; only the order of floating-point sums changes), gradient
norms to 5e-4: one process takes torch's fp32 norm of the 30,592 x 32
embedding gradient in one piece, 1.8e-4 off its float64 norm (measured at
iteration 1: 0.974445 vs 0.974619; the whole norm 4e-5 off), which the
parallel paths are closer to. For the same reason clipping is off: its
coefficient would carry that error into every update.
Dropout is
off, and `--make-vocab-size-divisible-by` is scaled so every layout pads the
vocabulary alike.

T5 has no pipeline split in Megatron core_v0.16.1 either: refused by name.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from mg.trainer.arguments import ArgumentError, parse_args

sys.path.insert(0, str(Path(__file__).parent))
from sentence_data import build_sentence_corpus, fill, template_argv  # noqa: E402


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_bt_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_ranks = _sibling("test_ddp.py").run_ranks
_helpers = _sibling("conftest.py")

ITERS = 8
RTOL = 1e-5
NORM_RTOL = 5e-4
QUIET = ["--attention-dropout", "0", "--hidden-dropout", "0", "--train-iters", str(ITERS)]
QUIET += ["--eval-interval", "4", "--eval-iters", "2", "--lr-warmup-iters", "2"]
QUIET += ["--clip-grad", "0"]  # the clip coefficient would carry the norm's fp32 error


def _layout(tp: int = 1, pp: int = 1, sp: bool = False) -> list[str]:
    flags = ["--make-vocab-size-divisible-by", str(128 // tp)]
    flags += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    return [*flags, "--sequence-parallel"] if sp else flags


@pytest.fixture(scope="module")
def argv(tmp_path_factory: pytest.TempPathFactory):
    """`argv(family, *layout)`: the flags of a run on the sentence-split corpus."""
    tmp = tmp_path_factory.mktemp("bert_t5_parallel")
    corpus = build_sentence_corpus(tmp)

    def argv(family: str, *layout: str) -> list[str]:
        return [*fill(template_argv(family), corpus, str(tmp / "cache")), *QUIET, *layout]

    return argv


@pytest.fixture(scope="module")
def runs(argv, tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("bert_t5_parallel_runs")
    argvs = {
        "bert_tp2_sp": argv("bert", *_layout(tp=2, sp=True)),
        "bert_pp2": argv("bert", *_layout(pp=2)),
        "bert_tp2_pp2": argv("bert", *_layout(tp=2, pp=2)),
        "t5_tp2_sp": argv("t5", *_layout(tp=2, sp=True)),
    }
    four = run_ranks(list(argvs.values()), 4, tmp / "four.json")
    one = {family: _helpers._train(argv(family, *_layout())) for family in ("bert", "t5")}
    return {"four": dict(zip(argvs, four, strict=True)), "one": one}


def _close(a: list[float], b: list[float], rel: float = RTOL) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=rel), (a, b)


@pytest.mark.parametrize("run", ["bert_tp2_sp", "bert_pp2", "bert_tp2_pp2", "t5_tp2_sp"])
def test_parallel_layouts_match_one_process(runs, run: str) -> None:
    family = run.split("_")[0]
    one, parallel = runs["one"][family], runs["four"][run]
    assert len(one.losses) == ITERS
    _close(parallel["losses"], one.losses)
    _close(parallel["grad_norms"], one.grad_norms, rel=NORM_RTOL)
    if family == "bert":
        _close(parallel["extra_losses"]["sop loss"], one.extra_losses["sop loss"])
    for (it, value), (it_one, value_one) in zip(
        parallel["validation"], one.validation, strict=True
    ):
        assert it == it_one and value == pytest.approx(value_one, rel=RTOL)


def test_t5_pipeline_parallel_is_refused_by_name(argv) -> None:
    with pytest.raises(ArgumentError, match=r"^--pipeline-model-parallel-size > 1 is not "):
        parse_args(argv("t5", *_layout(pp=2)), world_size=2)


def test_dry_run_counts_each_gpu_s_share_of_bert() -> None:
    """TP=2 x PP=2 of a 2-layer BERT, counted by hand: the first stage holds the embedding
    (words split by vocabulary) and layer 0, the last layer 1, the final norm, the heads,
    the output bias (split) and its copy of the tied word embeddings (split)."""
    import torch

    from mg.core.models import BertModel, TransformerConfig
    from mg.trainer.encoder_dry_run import parameters_per_gpu

    h, v, s = 32, 256, 64
    config = TransformerConfig(
        num_layers=2, hidden_size=h, num_attention_heads=4, vocab_size=v, seq_length=s
    )
    with torch.device("meta"):
        model = BertModel(config)
    sharded_layer = (3 * h * h + 3 * h + 4 * h * h + 4 * h + h * h + 4 * h * h) / 2
    layer = sharded_layer + h + h + 4 * h  # row-parallel biases and two norms: replicated
    first = v * h / 2 + s * h + 2 * h + layer
    heads = (h * h + h + 2 * h) + (h * h + h) + (2 * h + 2)  # LM head, pooler, binary head
    last = layer + 2 * h + heads + v / 2 + v * h / 2
    assert parameters_per_gpu(model, tp=2, pp=2) == [first, last]
    assert parameters_per_gpu(model, tp=1, pp=1) == [sum(p.numel() for p in model.parameters())]


def test_bert_and_t5_dry_runs(argv, capsys, monkeypatch) -> None:
    from mg.trainer.cli import main

    monkeypatch.setenv("WORLD_SIZE", "8")
    assert main([*argv("bert", *_layout(tp=2, pp=2, sp=True)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mg-train dry run: bert, 2 layers")
    assert "world 8 = TP 2 x PP 2 x DP 2, sequence parallel on" in out
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main([*argv("t5", *_layout(tp=2)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("mg-train dry run: t5, 2 layers (encoder and decoder each)")
    assert "world 4 = TP 2 x PP 1 x DP 2" in out
