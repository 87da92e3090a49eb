"""Bad input to mg-eval race / mnli / qqp: one line naming the file, line and what to do."""

from __future__ import annotations

import json

import pytest
from bert_tasks_data import save_tiny_bert, write_mnli

from mg.evaluate.cli import main


@pytest.fixture(scope="module")
def bert_ckpt(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("bert"))


def error(capsys, task: str, ckpt, train, valid=None, *extra: str) -> str:
    argv = [task, "--pretrained-checkpoint", str(ckpt), "--train-data", str(train)]
    argv += ["--valid-data", str(valid or train), "--epochs", "1", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mg-eval {task}: error: ") and "Traceback" not in err
    return err


def test_mnli_bad_files(bert_ckpt, tmp_path, capsys) -> None:
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n")
    assert "the file is empty" in error(capsys, "mnli", bert_ckpt, empty)
    jsonl = tmp_path / "race.jsonl"
    jsonl.write_text(json.dumps({"article": "x"}) + "\n")
    assert f"{jsonl}:1: this looks like JSON" in error(capsys, "mnli", bert_ckpt, jsonl)
    short = tmp_path / "short.tsv"
    short.write_text("a\tb\tc\n")
    assert f"{short}:1: the header has 3" in error(capsys, "mnli", bert_ckpt, short)
    bad_label = tmp_path / "label.tsv"
    write_mnli(bad_label, 3, seed=0)
    lines = bad_label.read_text().splitlines()
    lines[2] = lines[2].rsplit("\t", 1)[0] + "\tmaybe"
    bad_label.write_text("\n".join(lines) + "\n")
    err = error(capsys, "mnli", bert_ckpt, bad_label)
    assert f"{bad_label}:3: label 'maybe'" in err and "contradiction" in err


def test_qqp_bad_label_and_header(bert_ckpt, tmp_path, capsys) -> None:
    path = tmp_path / "qqp.tsv"
    path.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t2\t3\tA?\tB?\t7\n")
    assert f"{path}:2: is_duplicate 7 is not 0 or 1" in error(capsys, "qqp", bert_ckpt, path)
    path.write_text("a\tb\n")
    assert "QQP files have 6" in error(capsys, "qqp", bert_ckpt, path)


def test_race_bad_folder_and_records(bert_ckpt, tmp_path, capsys) -> None:
    missing = tmp_path / "nope"
    assert "no such RACE folder" in error(capsys, "race", bert_ckpt, missing)
    (tmp_path / "emptydir").mkdir()
    assert "no *.txt files" in error(capsys, "race", bert_ckpt, tmp_path / "emptydir")
    folder = tmp_path / "race"
    folder.mkdir()
    record = {"article": "a", "questions": ["q"], "options": [["a", "b", "c", "d"]]}
    (folder / "1.txt").write_text(json.dumps(record) + "\n")
    assert "1.txt:1: missing field(s) answers" in error(capsys, "race", bert_ckpt, folder)
    record["answers"] = ["E"]
    (folder / "1.txt").write_text(json.dumps(record) + "\n")
    assert "answer 'E' is not one of A, B, C, D" in error(capsys, "race", bert_ckpt, folder)
    (folder / "1.txt").write_text("id\tq\n")
    assert "1.txt:1: not JSON" in error(capsys, "race", bert_ckpt, folder)


def test_gpt_checkpoint_and_flags_refused(bert_ckpt, trained, tmp_path, capsys) -> None:
    train = tmp_path / "t.tsv"
    write_mnli(train, 4, seed=0)
    _, gpt = trained
    assert "not a BERT checkpoint" in error(capsys, "mnli", gpt, train)
    err = error(capsys, "mnli", bert_ckpt, train, None, "--seq-length", "4096")
    assert "max_position_embeddings" in err
    assert "--lr must be > 0" in error(capsys, "mnli", bert_ckpt, train, None, "--lr", "0")
    err = error(capsys, "mnli", bert_ckpt, train, None, "--micro-batch-size", "64")
    assert "fewer than one global batch" in err


def test_pipeline_parallel_layout_not_supported(bert_ckpt, tmp_path, capsys) -> None:
    """The BERT tasks run tensor parallel; --pipeline-model-parallel-size is refused by name,
    and a tensor-parallel layout needs its ranks."""
    train = tmp_path / "t.tsv"
    write_mnli(train, 4, seed=0)
    flag = "--pipeline-model-parallel-size"
    err = error(capsys, "qqp", bert_ckpt, train, None, flag, "2")
    assert f"{flag} 2: pipeline-parallel finetuning is not supported for qqp" in err, err
    assert "use --tensor-model-parallel-size" in err
    race = tmp_path / "race"
    race.mkdir()
    err = error(capsys, "race", bert_ckpt, race, None, flag, "2")
    assert "not supported for race" in err and "wikitext, lambada and ppl" in err
    err = error(capsys, "mnli", bert_ckpt, train, None, "--tensor-model-parallel-size", "2")
    assert "needs 2 processes" in err, err
