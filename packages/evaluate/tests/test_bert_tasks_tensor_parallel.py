"""mg-eval mnli, qqp and race with --tensor-model-parallel-size 2 on 2 gloo ranks equal one
process.

Each rank loads the tiny BERT checkpoint and keeps its tensor-parallel shards
(Megatron's layout: vocab-parallel embedding, column/row-parallel attention and
MLP); the pooler and the classification head are replicated. Both ranks see the
same examples (no data parallelism at TP=2 on 2 ranks), so the run must equal
the single-process one (run as a fresh process too): the final training loss
after 12 AdamW steps (1e-4 relative; measured: 2e-6 for RACE, bitwise for
MNLI) and the number of correct validation answers. The learning rate is
1e-3: at 5e-3 RACE's loss drops suddenly around step 8, which amplifies the
1e-7 differences of split matmul sums to 1e-3 by step 12.
"""

from __future__ import annotations

import json

import pytest
from bert_tasks_data import SEQ_LENGTH, save_tiny_bert, write_mnli, write_qqp, write_race
from eval_ranks import THEN, run_eval_ranks


def _metrics(report) -> list[dict]:
    return [json.loads(line)["metrics"] for line in report.read_text().splitlines()]


def test_tensor_parallel_finetune_matches_one_process(tmp_path) -> None:
    ckpt = save_tiny_bert(tmp_path / "bert")
    write_mnli(tmp_path / "train.tsv", 96, seed=1)
    write_mnli(tmp_path / "dev.tsv", 33, seed=2, dev=True)
    write_qqp(tmp_path / "qqp_train.tsv", 64, seed=5)
    write_qqp(tmp_path / "qqp_dev.tsv", 20, seed=6)
    write_race(tmp_path / "race" / "train", 24, seed=7)
    write_race(tmp_path / "race" / "dev", 10, seed=9)
    common = ["--pretrained-checkpoint", str(ckpt), "--epochs", "2", "--lr", "1e-3",
              "--seq-length", str(SEQ_LENGTH), "--lr-warmup-fraction", "0",
              "--micro-batch-size", "16"]  # fmt: skip
    mnli = ["mnli", *common, "--train-data", str(tmp_path / "train.tsv"),
            "--valid-data", str(tmp_path / "dev.tsv")]  # fmt: skip
    qqp = ["qqp", *common, "--train-data", str(tmp_path / "qqp_train.tsv"),
           "--valid-data", str(tmp_path / "qqp_dev.tsv")]  # fmt: skip
    race = ["race", *common, "--train-data", str(tmp_path / "race" / "train"),
            "--valid-data", str(tmp_path / "race" / "dev"), "--micro-batch-size", "8"]  # fmt: skip
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    to_one = ["--report", str(one)]
    run_eval_ranks(1, [*mnli, *to_one, THEN, *qqp, *to_one, THEN, *race, *to_one], tmp_path)
    tp = ["--tensor-model-parallel-size", "2", "--report", str(two)]
    run_eval_ranks(2, [*mnli, *tp, THEN, *qqp, *tp, THEN, *race, *tp], tmp_path / "ranks")
    for single, parallel in zip(_metrics(one), _metrics(two), strict=True):
        assert parallel["iterations"] == single["iterations"] > 0
        assert parallel["num_examples"] == single["num_examples"]
        assert parallel["final_train_loss"] == pytest.approx(single["final_train_loss"], rel=1e-4)
        assert parallel["num_correct"] == single["num_correct"]
