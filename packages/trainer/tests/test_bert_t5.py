"""`mg-train bert` and `mg-train t5` on a tiny sentence-split Botchan corpus (CPU).

One 30-iteration run per family (the golden flags, `sentence_data.template_argv`)
serves three checks: the loss goes down, it matches the stored golden curve
(1e-5 relative), and (BERT) a 10 + save/load + 10 run repeats it bitwise.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import pytest

from mg.trainer.arguments import parse_args
from mg.trainer.cli import main
from mg.trainer.training import Trainer, TrainResult

GOLDEN = Path(__file__).parent / "golden"
sys.path.insert(0, str(Path(__file__).parent))
from sentence_data import build_sentence_corpus, fill, template_argv  # noqa: E402


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_sentence_corpus(tmp_path_factory.mktemp("sentences"))


@pytest.fixture(scope="module")
def runs(corpus: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, TrainResult]:
    cache = str(tmp_path_factory.mktemp("cache"))
    return {
        family: Trainer(parse_args(fill(template_argv(family), corpus, cache))).train()
        for family in ("bert", "t5")
    }


def test_bert_lm_and_sop_losses_go_down(runs) -> None:
    result = runs["bert"]
    lm, sop = result.losses, result.extra_losses["sop loss"]
    assert len(lm) == len(sop) == 30
    # From ~10.32 (ln of the 30k WordPiece vocab) to ~9.79 in 30 steps.
    assert statistics.mean(lm[:5]) > 10.2
    assert statistics.mean(lm[-5:]) < statistics.mean(lm[:5]) - 0.35
    # Sentence order is a coin toss this early: ~ln 2.
    assert all(0.6 < s < 0.8 for s in sop)


def test_t5_loss_goes_down(runs) -> None:
    result = runs["t5"]
    assert len(result.losses) == 30 and result.extra_losses == {}
    assert statistics.mean(result.losses[:5]) > 10.2
    assert statistics.mean(result.losses[-5:]) < statistics.mean(result.losses[:5]) - 0.5


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_matches_golden_curve(runs, family: str) -> None:
    record = json.loads((GOLDEN / f"{family}_tiny_botchan.json").read_text())
    assert record["argv"] == template_argv(family)
    result = runs[family]
    curves = [(result.losses, record["lm_loss"])]
    if family == "bert":
        curves.append((result.extra_losses["sop loss"], record["sop_loss"]))
    for losses, golden in curves:
        assert len(losses) == len(golden) == 30
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, golden, strict=True))
        assert worst <= 1e-5, f"largest relative difference {worst:.3e}"


def test_bert_resume_is_bitwise(runs, corpus: str, tmp_path) -> None:
    """10 iterations, save, exit; load, 10 more == iterations 1..20 of the 30-iteration run."""
    argv = fill(template_argv("bert"), corpus, str(tmp_path / "cache"))
    ckpt = str(tmp_path / "ckpt")
    first = Trainer(parse_args([*argv, "--save", ckpt, "--exit-interval", "10"])).train()
    second = Trainer(parse_args([*argv, "--load", ckpt, "--exit-interval", "20"])).train()
    assert first.exit_reason.startswith("--exit-interval")
    assert second.state.iteration == 20
    full = runs["bert"]
    assert first.losses + second.losses == full.losses[:20]
    sop = first.extra_losses["sop loss"] + second.extra_losses["sop loss"]
    assert sop == full.extra_losses["sop loss"][:20]


def test_cli_refuses_bad_bert_t5_flags_with_exit_2(corpus: str, tmp_path, capsys) -> None:
    argv = fill(template_argv("t5"), corpus, str(tmp_path / "cache"))
    i = argv.index("--decoder-seq-length")
    assert main(argv[:i] + argv[i + 2 :]) == 2
    assert "needs --decoder-seq-length" in capsys.readouterr().err
    i = argv.index("--vocab-extra-ids")
    assert main(argv[:i] + argv[i + 2 :]) == 2
    assert "--vocab-extra-ids 100" in capsys.readouterr().err
    bert = [a for a in fill(template_argv("bert"), corpus, str(tmp_path)) if a != corpus]
    bert[bert.index("--data-path")] = "--mock-data"
    assert main(bert) == 2
    assert "--mock-data is GPT only" in capsys.readouterr().err


def test_log_lines_and_no_binary_head(corpus: str, tmp_path, capsys) -> None:
    """Megatron's log line: `lm loss` then `sop loss` for BERT; no head, no `sop loss`.
    Validation reports `sop loss` too when the head is there."""
    short = ["--train-iters", "2", "--lr-warmup-iters", "1", "--log-interval", "1"]
    short += ["--eval-interval", "2"]
    argv = fill(template_argv("bert"), corpus, str(tmp_path / "cache"))
    argv[argv.index("--eval-iters") + 1] = "1"
    with_head = Trainer(parse_args([*argv, *short])).train()
    out = capsys.readouterr().out
    assert re.search(r"\| lm loss: \S+ \| sop loss: \S+ \| loss scale", out), out
    assert len(with_head.validation) == 1
    assert re.search(
        r"validation loss at .* \| lm loss value: \S+ \| lm loss PPL: \S+ \| "
        r"sop loss value: \S+ \| sop loss PPL: \S+ \|",
        out,
    ), out
    [(iteration, sop)] = with_head.extra_validation["sop loss"]
    assert iteration == 2 and 0.5 < sop < 0.9  # a coin toss this early: ~ln 2
    trainer = Trainer(parse_args([*argv, *short, "--bert-no-binary-head"]))
    names = {name for name, _ in trainer.model.named_parameters()}
    assert not any("binary_head" in name or "pooler" in name for name in names)
    without = trainer.train()
    out = capsys.readouterr().out
    assert "lm loss:" in out and "sop loss" not in out
    assert without.extra_losses == {} and len(without.losses) == 2
    assert len(without.validation) == 1 and without.extra_validation == {}
    assert "sop loss value" not in out


@pytest.mark.parametrize("family", ["bert", "t5"])
def test_weighted_blend_of_two_prefixes(corpus: str, tmp_path, family: str) -> None:
    """`--data-path 0.75 A 0.25 B` mixes two `_text_sentence` prefixes by weight, as
    Megatron's builder does for GPT; each blended sample is its source's sample."""
    import shutil

    import numpy as np

    from mg.core.tokenizers import TokenizerConfig, build_tokenizer
    from mg.indexed_dataset import BlendedDataset
    from mg.trainer.families import get_family

    other = str(tmp_path / "copy_text_sentence")
    for suffix in (".bin", ".idx"):
        shutil.copyfile(corpus + suffix, other + suffix)
    argv = fill(template_argv(family), corpus, str(tmp_path / "cache"))
    i = argv.index("--data-path")
    argv[i + 1 : i + 2] = ["0.75", corpus, "0.25", other]
    args = parse_args(argv)
    d = args.data
    tokenizer = build_tokenizer(
        TokenizerConfig(d.tokenizer_type, d.vocab_file, vocab_extra_ids=d.vocab_extra_ids)
    )
    train, valid, _ = get_family(family).build_datasets(args, tokenizer, [400, 8, 0])
    assert isinstance(train, BlendedDataset) and len(train) == 400
    share = float(np.mean(train.dataset_index == 0))
    assert abs(share - 0.75) < 0.01
    for k in (0, 1, 57, 399):
        source = train.datasets[int(train.dataset_index[k])]
        expected = source[int(train.dataset_sample_index[k])]
        got = train[k]
        for key, value in expected.items():
            np.testing.assert_array_equal(got[key], value)
    assert valid is not None and len(valid) == 8
    result = Trainer(parse_args([*argv, "--train-iters", "2", "--lr-warmup-iters", "1"])).train()
    assert len(result.losses) == 2 and all(10.0 < loss < 11.0 for loss in result.losses)
