"""Parquet input: the same bytes as the JSONL of the same rows, and clean errors."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_path
from mg.corpus_prep.cli import main
from mg.corpus_prep.reader import Segment, find_sources, read_lines
from mg.corpus_prep.sample_corpus import real_corpus, write_jsonl

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

GPT2 = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", fixture_path("gpt2-bpe", "vocab.json"),
    "--merge-file", fixture_path("gpt2-bpe", "merges.txt"),
]  # fmt: skip


def tokenize(*args: object) -> int:
    try:
        main(["tokenize", *(str(a) for a in args), "--no-progress-bar"])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def same_files(a: Path, b: Path) -> bool:
    return all(
        Path(f"{a}{s}").read_bytes() == Path(f"{b}{s}").read_bytes() for s in (".bin", ".idx")
    )


@pytest.fixture(scope="module")
def rows() -> list[dict[str, str]]:
    return [{"text": d["text"], "id": str(i)} for i, d in enumerate(real_corpus(4))]


def write_parquet(path: Path, rows: list[dict], row_group_size: int = 7) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


def test_parquet_files_give_the_bytes_of_the_jsonl(rows, tmp_path):
    write_jsonl(tmp_path / "all.jsonl", iter(rows))
    half = len(rows) // 2
    folder = tmp_path / "shards"
    folder.mkdir()
    write_parquet(folder / "train-00000-of-00002.parquet", rows[:half])
    write_parquet(folder / "train-00001-of-00002.parquet", rows[half:])
    common = [*GPT2, "--append-eod", "--json-keys", "text", "id", "--workers", 2]
    assert (
        tokenize("--input", tmp_path / "all.jsonl", "--output-prefix", tmp_path / "j", *common) == 0
    )
    assert tokenize("--input", folder, "--output-prefix", tmp_path / "p", *common) == 0
    pattern = folder / "train-*.parquet"
    assert (
        tokenize("--input", pattern, "--output-prefix", tmp_path / "g", *common, "--partitions", 2)
        == 0
    )
    for key in ("text", "id"):
        for name in ("p", "g"):
            assert same_files(tmp_path / f"{name}_{key}_document", tmp_path / f"j_{key}_document")


def test_other_column_types_are_read_and_rows_numbered_from_one(tmp_path):
    path = write_parquet(
        tmp_path / "typed.parquet",
        [
            {"text": "a", "n": 1, "raw": b"\xff", "t": datetime.date(2024, 1, 2)},
            {"text": "b", "n": None, "raw": b"ok", "t": None},
        ],
    )
    [source] = find_sources([str(path)])
    assert source.compression == "parquet"
    lines = [(n, json.loads(line)) for n, line in read_lines(Segment(source))]
    assert lines == [
        (1, {"text": "a", "n": 1, "raw": {"base64": "/w=="}, "t": "2024-01-02"}),
        (2, {"text": "b", "n": None, "raw": "ok", "t": None}),
    ]


def test_a_null_or_missing_text_names_the_file_and_row(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    write_parquet(tmp_path / "c.parquet", [{"text": "ok"}] * 4 + [{"text": None}])
    assert tokenize("--input", "c.parquet", "--output-prefix", "out/c", *GPT2) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: c\.parquet:5: the value of 'text' is a JSON null", err), err
    assert (
        tokenize("--input", "c.parquet", "--output-prefix", "out/c", *GPT2, "--json-keys", "body")
        == 2
    )
    assert "c.parquet:1: no key 'body' (the object has 'text')" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_truncated_parquet_file_is_a_clean_error(rows, tmp_path, capsys):
    good = write_parquet(tmp_path / "good.parquet", rows)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert tokenize("--input", bad, "--output-prefix", tmp_path / "out", *GPT2) == 2
    err = capsys.readouterr().err
    assert "bad.parquet" in err and "cannot be read" in err and "Traceback" not in err
    assert not list(tmp_path.glob("out*"))
