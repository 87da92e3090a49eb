"""mg-eval mnli and qqp with --tensor-model-parallel-size 2 on 2 gloo ranks equal one process.

Each rank loads the tiny BERT checkpoint and keeps its tensor-parallel shards
(Megatron's layout: vocab-parallel embedding, column/row-parallel attention and
MLP); the pooler and the classification head are replicated. Both ranks see the
same examples (no data parallelism at TP=2 on 2 ranks), so the run must equal
the single-process one (run as a fresh process too): the final training loss
after 12 AdamW steps (1e-5 relative; measured: bitwise equal on CPU) and the
number of correct validation answers. RACE at TP > 1 is refused by name.
"""

from __future__ import annotations

import json

import pytest
from bert_tasks_data import SEQ_LENGTH, save_tiny_bert, write_mnli, write_qqp
from eval_ranks import THEN, run_eval_ranks


def _metrics(report) -> list[dict]:
    return [json.loads(line)["metrics"] for line in report.read_text().splitlines()]


def test_tensor_parallel_finetune_matches_one_process(tmp_path) -> None:
    ckpt = save_tiny_bert(tmp_path / "bert")
    write_mnli(tmp_path / "train.tsv", 96, seed=1)
    write_mnli(tmp_path / "dev.tsv", 33, seed=2, dev=True)
    write_qqp(tmp_path / "qqp_train.tsv", 64, seed=5)
    write_qqp(tmp_path / "qqp_dev.tsv", 20, seed=6)
    common = ["--pretrained-checkpoint", str(ckpt), "--epochs", "2", "--lr", "5e-3",
              "--seq-length", str(SEQ_LENGTH), "--lr-warmup-fraction", "0",
              "--micro-batch-size", "16"]  # fmt: skip
    mnli = ["mnli", *common, "--train-data", str(tmp_path / "train.tsv"),
            "--valid-data", str(tmp_path / "dev.tsv")]  # fmt: skip
    qqp = ["qqp", *common, "--train-data", str(tmp_path / "qqp_train.tsv"),
           "--valid-data", str(tmp_path / "qqp_dev.tsv")]  # fmt: skip
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    run_eval_ranks(1, [*mnli, "--report", str(one), THEN, *qqp, "--report", str(one)], tmp_path)
    tp = ["--tensor-model-parallel-size", "2", "--report", str(two)]
    run_eval_ranks(2, [*mnli, *tp, THEN, *qqp, *tp], tmp_path / "ranks")
    for single, parallel in zip(_metrics(one), _metrics(two), strict=True):
        assert parallel["iterations"] == single["iterations"] > 0
        assert parallel["num_examples"] == single["num_examples"]
        assert parallel["final_train_loss"] == pytest.approx(single["final_train_loss"], rel=1e-5)
        assert parallel["num_correct"] == single["num_correct"]
