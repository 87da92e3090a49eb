"""`mg-prep clean` end to end: outputs, per-reason counts, errors by file:line, atomic output."""

from __future__ import annotations

import argparse
import gzip
import json
import random

import pytest
import zstandard

from mg.core.fixtures import fixture_path
from mg.corpus_prep.clean_cmd import cleaning_options
from mg.corpus_prep.clean_flags import add_cleaning_arguments
from mg.corpus_prep.cleaning import CleanOptions
from mg.corpus_prep.cli import main


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(["clean", *map(str, argv)])
    return exit_info.value.code


def write_jsonl(path, records, raw_lines=()):
    lines = [json.dumps(r, ensure_ascii=False) for r in records] + list(raw_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_jsonl(path):
    data = path.read_bytes()
    if str(path).endswith(".gz"):
        data = gzip.decompress(data)
    elif str(path).endswith(".zst"):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(data)
    return [json.loads(line) for line in data.decode().splitlines()]


@pytest.fixture(scope="module")
def paragraph() -> str:
    lines = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8").splitlines()
    return " ".join(" ".join(lines[300:330]).split())  # ~2,000 characters, ~400 words


def near_copy(text: str) -> str:
    rng = random.Random(0)
    words = text.split()
    for i in rng.sample(range(len(words)), len(words) // 50):
        words[i] = "zzz"
    return " ".join(words)


def corpus(paragraph: str) -> list[dict]:
    return [
        {"id": 0, "text": "The caf\u00c3\u00a9 was \u201copen\u201d\u2026 every day of the week."},
        {"id": 1, "text": "too short"},
        {"id": 2, "text": 'The CAFÉ was "open"... every day   of the week.'},  # dup of 0
        {"id": 3, "text": paragraph},
        {"id": 4, "text": near_copy(paragraph)},
        {"id": 5, "text": "word " * 600},
        {"id": 6, "text": "A perfectly ordinary sentence about nothing much at all."},
    ]


def test_clean_drops_and_counts_per_reason(tmp_path, paragraph):
    source = write_jsonl(tmp_path / "in.jsonl", corpus(paragraph))
    out = tmp_path / "out" / "clean.jsonl"
    summary_path = tmp_path / "summary.json"
    status = run_cli(
        "--input", source, "--output", out, "--min-words", 3, "--max-words", 500,
        "--dedup", "near", "--summary-json", summary_path,
    )  # fmt: skip
    assert status == 0
    kept = read_jsonl(out)
    assert [r["id"] for r in kept] == [0, 3, 6]
    assert kept[0]["text"] == 'The café was "open"... every day of the week.'
    summary = json.loads(summary_path.read_text())
    assert summary["documents_read"] == 7
    assert summary["documents_kept"] == 3
    assert summary["dropped"] == {
        "empty": 0,
        "too_few_chars": 0,
        "too_many_chars": 0,
        "too_few_words": 1,
        "too_many_words": 1,
        "exact_duplicate": 1,
        "near_duplicate": 1,
        "invalid_line": 0,
    }
    assert summary["changed_by_rule"]["repair"] == 1
    assert summary["changed_by_rule"]["punctuation"] == 1
    assert summary["options"]["minhash_threshold"] == 0.8


def test_near_dup_kept_below_threshold_and_without_near_mode(tmp_path, paragraph):
    source = write_jsonl(tmp_path / "in.jsonl", corpus(paragraph))
    for extra in (["--dedup", "exact"], ["--dedup", "near", "--minhash-threshold", "0.99"]):
        out = tmp_path / "out.jsonl"
        assert run_cli("--input", source, "--output", out, *extra) == 0
        assert [r["id"] for r in read_jsonl(out)] == [0, 1, 3, 4, 5, 6]


def test_bad_line_fails_with_file_and_line(tmp_path, capsys):
    source = write_jsonl(tmp_path / "in.jsonl", [{"text": "fine"}], ["{not json", '{"x": 1}'])
    out = tmp_path / "out.jsonl"
    out.write_text("previous\n")
    assert run_cli("--input", source, "--output", out) == 2
    err = capsys.readouterr().err
    assert f"{source}:2: invalid JSON" in err
    assert "--on-error skip" in err
    # the previous output is untouched and no temporary is left behind
    assert out.read_text() == "previous\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


def test_skip_bad_lines_counts_them(tmp_path, capsys):
    source = write_jsonl(
        tmp_path / "in.jsonl", [{"text": "fine one"}], ["{not json", '{"x": 1}', '{"text": 5}']
    )
    out = tmp_path / "out.jsonl.gz"
    summary_path = tmp_path / "s.json"
    status = run_cli(
        "--input", source, "--output", out, "--on-error", "skip", "--summary-json", summary_path
    )
    assert status == 0
    err = capsys.readouterr().err
    assert f"{source}:3: no key 'text'" in err
    assert f"{source}:4: the value of 'text' is a JSON number" in err
    assert read_jsonl(out) == [{"text": "fine one"}]
    summary = json.loads(summary_path.read_text())
    assert summary["lines_skipped"] == 3
    assert summary["dropped"]["invalid_line"] == 3


def test_compressed_input_and_output_multiple_keys(tmp_path):
    records = [
        {"title": "A \u2018title\u2019", "text": "Body\u00a0one"},
        {"title": "a  \u2018title'", "text": "body one"},  # same document, case/space aside
        {"title": "A title", "text": "Body two"},
    ]
    raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    source = tmp_path / "in.jsonl.zst"
    source.write_bytes(zstandard.ZstdCompressor().compress(raw))
    out = tmp_path / "out.jsonl.zst"
    assert run_cli("--input", source, "--output", out, "--json-keys", "title", "text") == 0
    assert read_jsonl(out) == [
        {"title": "A 'title'", "text": "Body one"},
        {"title": "A title", "text": "Body two"},
    ]


def test_cleaning_flags_for_another_command_are_opt_in():
    parser = argparse.ArgumentParser()
    add_cleaning_arguments(parser, enabled_by_default=False)
    assert cleaning_options(parser.parse_args([])) is None
    assert cleaning_options(parser.parse_args(["--clean"])) == CleanOptions()
    filters_only = cleaning_options(parser.parse_args(["--min-words", "5", "--dedup", "exact"]))
    assert filters_only == CleanOptions(
        repair=False,
        normalization="none",
        punctuation=False,
        whitespace=False,
        min_words=5,
        dedup="exact",
    )
