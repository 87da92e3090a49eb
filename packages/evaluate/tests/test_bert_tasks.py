"""mg-eval race / mnli / qqp: formats parsed exactly as Megatron's tasks/ read them, and a
tiny BERT finetuned on small learnable files goes clearly above chance."""

from __future__ import annotations

import json

import pytest
from bert_tasks_data import (
    SEQ_LENGTH,
    save_tiny_bert,
    tokenizer_config,
    write_mnli,
    write_qqp,
    write_race,
)

from mg.core.tokenizers import build_tokenizer
from mg.evaluate.cli import main
from mg.evaluate.finetune_samples import build_tokens_types_paddings_from_ids, clean_text
from mg.evaluate.glue import read_mnli, read_qqp
from mg.evaluate.race import race_samples


@pytest.fixture(scope="module")
def bert_ckpt(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("bert"))


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(tokenizer_config())


def run(capsys, tmp_path, task: str, *args: str) -> dict:
    report = tmp_path / f"{task}.jsonl"
    code = main([task, *args, "--report", str(report), "--log-interval", "1000"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"validation results on {task.upper()}" in out.out
    assert "metrics for" in out.out
    return json.loads(report.read_text().splitlines()[-1])


def test_megatron_token_layout() -> None:
    # [CLS] a [SEP] b [SEP] pad..., types 0 0 0 1 1 0.., paddings 1 .. 0
    ids, types, pads, cut = build_tokens_types_paddings_from_ids([5, 6], [7], 8, 101, 102, 0)
    assert ids == [101, 5, 6, 102, 7, 102, 0, 0] and not cut
    assert types == [0, 0, 0, 0, 1, 1, 0, 0] and pads == [1, 1, 1, 1, 1, 1, 0, 0]
    # cut: seq_length - 1 tokens, then [SEP] (type 1 with a second segment)
    ids, types, pads, cut = build_tokens_types_paddings_from_ids([5, 6, 7], [8, 9], 6, 101, 102, 0)
    assert ids == [101, 5, 6, 7, 102, 102] and types == [0, 0, 0, 0, 0, 1] and cut
    ids, types, _, cut = build_tokens_types_paddings_from_ids([5, 6], None, 6, 101, 102, 0)
    assert ids == [101, 5, 6, 102, 0, 0] and types == [0] * 6 and not cut
    assert clean_text("A  b .\nc . d") == "A b. c. d"


def test_mnli_columns_exact(tmp_path) -> None:
    for dev in (False, True):
        path = tmp_path / f"mnli{dev}.tsv"
        expected = write_mnli(path, 6, seed=3, dev=dev)
        got = read_mnli(path)
        assert [(a, b, label) for _, a, b, label in got] == expected
        assert [uid for uid, *_ in got] == list(range(6))
    # a test file (10 columns): every label is the test label, contradiction
    test = tmp_path / "test.tsv"
    header = [
        "index",
        "promptID",
        "pairID",
        "genre",
        "s1b",
        "s2b",
        "s1p",
        "s2p",
        "sentence1",
        "sentence2",
    ]
    test.write_text("\t".join(header) + "\n7\t1\t2\tg\tx\tx\tx\tx\tA cat . Big .\tNo dog .\n")
    # Megatron's clean_text: " . " → ". " (a final " ." stays)
    assert read_mnli(test) == [(7, "A cat. Big .", "No dog .", 0)]


def test_qqp_columns_and_skips(tmp_path, capsys) -> None:
    path = tmp_path / "qqp.tsv"
    expected = write_qqp(path, 5, seed=4)
    with path.open("a") as f:
        f.write("99\t1\t2\tonly four columns\n")  # skipped with a warning, as Megatron
        f.write("98\t1\t2\t \tq2?\t1\n")  # empty question1: skipped
    got = read_qqp(path)
    assert [(a, b, label) for _, a, b, label in got] == expected
    assert capsys.readouterr().err.count("skipping") == 2
    test = tmp_path / "test.tsv"
    test.write_text("id\tquestion1\tquestion2\n3\tWhy?\tHow?\n")
    assert read_qqp(test) == [(3, "Why?", "How?", 0)]


def test_race_fields_exact(tmp_path, tokenizer) -> None:
    folder = tmp_path / "race"
    folder.mkdir()
    record = {
        "article": "The cat sat .  It slept .",
        "questions": ["Where did the _ sit?", "Who slept"],
        "options": [["cat", "dog", "cow", "hen"], ["it", "he", "she", "we"]],
        "answers": ["A", "D"],
    }
    (folder / "1.txt").write_text(json.dumps(record) + "\n")
    samples = race_samples([str(folder)], tokenizer, 32)
    assert [s.label for s in samples] == [0, 3]
    article = tokenizer.tokenize("The cat sat. It slept.")
    first = samples[0]
    qa = tokenizer.tokenize("Where did the dog sit?")  # '_' replaced by the choice
    assert first.ids[1][: len(qa) + 2 + len(article) + 1] == [
        tokenizer.cls,
        *qa,
        tokenizer.sep,
        *article,
        tokenizer.sep,
    ]
    qa = tokenizer.tokenize("Who slept we")  # no '_': the choice is appended
    assert samples[1].ids[3][1 : len(qa) + 1] == qa
    assert len(first.ids) == len(first.types) == 4 and all(len(r) == 32 for r in first.ids)


def test_mnli_finetune_beats_chance(bert_ckpt, tmp_path, capsys) -> None:
    write_mnli(tmp_path / "train.tsv", 384, seed=1)
    write_mnli(tmp_path / "dev_matched.tsv", 96, seed=2, dev=True)
    record = run(
        capsys, tmp_path, "mnli",
        "--pretrained-checkpoint", str(bert_ckpt),
        "--train-data", str(tmp_path / "train.tsv"),
        "--valid-data", str(tmp_path / "dev_matched.tsv"),
        "--epochs", "3", "--lr", "5e-3", "--micro-batch-size", "16",
        "--seq-length", str(SEQ_LENGTH), "--lr-warmup-fraction", "0",
    )  # fmt: skip
    m = record["metrics"]
    print("mnli", m["accuracy"], m["final_train_loss"])
    assert m["num_examples"] == 96 and m["iterations"] == 3 * (384 // 16)
    assert m["accuracy"] > 0.8  # chance: 1/3


def test_qqp_finetune_beats_chance(bert_ckpt, tmp_path, capsys) -> None:
    write_qqp(tmp_path / "train.tsv", 256, seed=5)
    write_qqp(tmp_path / "dev.tsv", 80, seed=6)
    record = run(
        capsys, tmp_path, "qqp",
        "--pretrained-checkpoint", str(bert_ckpt),
        "--train-data", str(tmp_path / "train.tsv"),
        "--valid-data", str(tmp_path / "dev.tsv"),
        "--epochs", "3", "--lr", "5e-3", "--micro-batch-size", "16",
        "--seq-length", str(SEQ_LENGTH), "--lr-warmup-fraction", "0",
    )  # fmt: skip
    print("qqp", record["metrics"]["accuracy"])
    assert record["metrics"]["accuracy"] > 0.85  # chance: 1/2


def test_race_finetune_beats_chance(bert_ckpt, tmp_path, capsys) -> None:
    write_race(tmp_path / "train" / "middle", 96, seed=7)
    write_race(tmp_path / "train" / "high", 32, seed=8)
    write_race(tmp_path / "dev" / "middle", 40, seed=9)
    record = run(
        capsys, tmp_path, "race",
        "--pretrained-checkpoint", str(bert_ckpt),
        "--train-data", str(tmp_path / "train" / "middle"), str(tmp_path / "train" / "high"),
        "--valid-data", str(tmp_path / "dev" / "middle"),
        "--epochs", "3", "--lr", "5e-3", "--micro-batch-size", "8",
        "--seq-length", str(SEQ_LENGTH), "--lr-warmup-fraction", "0",
    )  # fmt: skip
    m = record["metrics"]
    print("race", m["accuracy"])
    assert m["num_examples"] == 80 and m["iterations"] == 3 * (256 // 8)
    assert m["accuracy"] > 0.6  # chance: 1/4
