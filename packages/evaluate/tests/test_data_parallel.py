"""Under torchrun (here: 2 gloo ranks) mg-eval shares the examples out and reduces the
sums: every number equals the one-process run; BERT finetuning averages gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bert_tasks_data import SEQ_LENGTH, save_tiny_bert, write_mnli
from eval_data import botchan_paragraphs
from eval_ranks import run_eval_ranks

from mg.evaluate.cli import main

WORLD = 2


def run_ranks(argv: list[str], folder: Path) -> None:
    """`mg-eval ARGV` as WORLD local ranks (torchrun's environment), each exiting 0."""
    run_eval_ranks(WORLD, argv, folder)


def metrics(report: Path) -> dict:
    lines = report.read_text().splitlines()
    assert len(lines) == 1  # only rank 0 writes
    return json.loads(lines[0])["metrics"]


def one_and_two(tmp_path: Path, argv: list[str]) -> tuple[dict, dict]:
    single, double = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert main([*argv, "--report", str(single)]) == 0
    run_ranks([*argv, "--report", str(double)], tmp_path)
    return metrics(single), metrics(double)


def test_zero_shot_tasks_equal_one_process(trained, wikitext_file, lambada_file, tmp_path):
    _, ckpt = trained
    # 9 windows / 18 lines: an odd count so the ranks get different shares
    one, two = one_and_two(
        tmp_path / "w",
        ["wikitext", "--load", str(ckpt), "--valid-data", str(wikitext_file),
         "--overlapping-eval", "48", "--micro-batch-size", "3"],
    )  # fmt: skip
    assert one["num_windows"] == two["num_windows"]
    for key in ("avg_loss", "ppl", "adjusted_ppl"):
        assert two[key] == pytest.approx(one[key], rel=1e-12), key
    (tmp_path / "l").mkdir()
    one, two = one_and_two(
        tmp_path / "l",
        ["lambada", "--load", str(ckpt), "--valid-data", str(lambada_file), "--strict-lambada",
         "--micro-batch-size", "5"],
    )  # fmt: skip
    assert one == two


@pytest.mark.slow
def test_ppl_equals_one_process(trained, tokenizer, tmp_path):
    import numpy as np

    from mg.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / "botchan_text_document")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for para in botchan_paragraphs(40):
        ids = tokenizer.tokenize(para) + [tokenizer.eod]
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + ".idx")
    _, ckpt = trained
    argv = ["ppl", "--load", str(ckpt), "--data-path", prefix, "--split", "80,20,0"]
    argv += ["--micro-batch-size", "3", "--data-cache-path", str(tmp_path / "cache")]
    one, two = one_and_two(tmp_path, argv)
    assert one["num_samples"] == two["num_samples"] and one["num_tokens"] == two["num_tokens"]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-12)


@pytest.mark.slow
def test_finetune_two_ranks_equals_double_micro_batch(tmp_path):
    """2 ranks x micro-batch 8 = one process x 16: the same global batches (the
    DistributedSampler deals them out), averaged gradients, so the same model."""
    ckpt = save_tiny_bert(tmp_path / "bert")
    write_mnli(tmp_path / "train.tsv", 96, seed=1)
    write_mnli(tmp_path / "dev.tsv", 33, seed=2, dev=True)
    common = ["mnli", "--pretrained-checkpoint", str(ckpt), "--train-data",
              str(tmp_path / "train.tsv"), "--valid-data", str(tmp_path / "dev.tsv"),
              "--epochs", "2", "--lr", "5e-3", "--seq-length", str(SEQ_LENGTH),
              "--lr-warmup-fraction", "0"]  # fmt: skip
    single, double = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    assert main([*common, "--micro-batch-size", "16", "--report", str(single)]) == 0
    run_ranks([*common, "--micro-batch-size", "8", "--report", str(double)], tmp_path)
    one, two = metrics(single), metrics(double)
    assert one["iterations"] == two["iterations"] == 2 * (96 // 16)
    assert one["num_examples"] == two["num_examples"] == 33
    assert two["final_train_loss"] == pytest.approx(one["final_train_loss"], rel=1e-4)
    assert two["num_correct"] == one["num_correct"]
