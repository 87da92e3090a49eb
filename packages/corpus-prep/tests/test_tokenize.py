"""`mg-prep tokenize`: semantics, inputs, bad lines, workers and partitions, messages."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import zstandard

from mg.core.fixtures import fixture_path
from mg.corpus_prep.cli import main
from mg.corpus_prep.sample_corpus import real_corpus, write_jsonl
from mg.indexed_dataset.format import IndexedDataset

GPT2 = [
    "--tokenizer-type",
    "GPT2BPETokenizer",
    "--vocab-file",
    str(fixture_path("gpt2-bpe", "vocab.json")),
    "--merge-file",
    str(fixture_path("gpt2-bpe", "merges.txt")),
]
EOD = 50256


def mg_prep(*args: object) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def tokenize(*args: object) -> int:
    return mg_prep("tokenize", *args, "--no-progress-bar")


def write_lines(path: Path, lines: list[str | bytes | dict]) -> Path:
    with open(path, "wb") as out:
        for line in lines:
            if isinstance(line, dict):
                line = json.dumps(line)
            out.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return path


def documents(prefix: Path | str) -> list[list[list[int]]]:
    """The dataset as documents -> sequences -> token ids."""
    dataset = IndexedDataset(str(prefix))
    di = dataset.document_indices
    return [[dataset[i].tolist() for i in range(di[d], di[d + 1])] for d in range(len(di) - 1)]


def same_files(a: Path | str, b: Path | str) -> bool:
    return all(
        Path(f"{a}{s}").read_bytes() == Path(f"{b}{s}").read_bytes() for s in (".bin", ".idx")
    )


@pytest.fixture(scope="module")
def real_jsonl(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("real") / "real.jsonl"
    write_jsonl(path, real_corpus(wikipedia_pages=8))
    return path


# --- semantics -------------------------------------------------------------------------------


def test_document_level_append_eod_empty_documents_and_order(tmp_path):
    corpus = write_lines(
        tmp_path / "c.jsonl",
        [{"text": "Hello world"}, {"text": ""}, {"text": "a <|endoftext|> b"}, {"text": " "}],
    )
    assert (
        tokenize("--input", corpus, "--output-prefix", tmp_path / "o", *GPT2, "--append-eod") == 0
    )
    docs = documents(tmp_path / "o_text_document")
    assert docs[0] == [[15496, 995, EOD]]
    assert docs[1] == []  # an empty document keeps its boundary, gets no eod
    assert EOD not in docs[2][0][:-1] and docs[2][0][-1] == EOD  # the literal is text
    assert docs[3] == [[220, EOD]]
    assert len(docs) == 4


def test_list_values_are_presplit_sentences_and_empty_sentences_dropped(tmp_path):
    corpus = write_lines(tmp_path / "c.jsonl", [{"text": ["Hello world", "", "Bye"]}])
    assert (
        tokenize("--input", corpus, "--output-prefix", tmp_path / "o", *GPT2, "--append-eod") == 0
    )
    assert documents(tmp_path / "o_text_document") == [[[15496, 995], [3886, 68, EOD]]]


def test_several_json_keys_give_one_complete_dataset_each(tmp_path):
    rows = [{"text": f"text {i}", "title": f"title {i}", "x": 1} for i in range(5)]
    corpus = write_lines(tmp_path / "c.jsonl", rows)
    status = tokenize(
        "--input", corpus, "--output-prefix", tmp_path / "o", *GPT2, "--json-keys", "text",
        "title",
    )  # fmt: skip
    assert status == 0
    for key in ("text", "title"):
        assert (
            tokenize(
                "--input", corpus, "--output-prefix", tmp_path / key, *GPT2, "--json-keys", key
            )
            == 0
        )
        assert same_files(tmp_path / f"o_{key}_document", tmp_path / f"{key}_{key}_document")
        assert len(documents(tmp_path / f"o_{key}_document")) == 5


def test_workers_and_partitions_do_not_change_the_output(real_jsonl, tmp_path):
    base = ["--input", real_jsonl, *GPT2, "--append-eod", "--log-interval", 100000]
    assert tokenize(*base, "--output-prefix", tmp_path / "w1", "--workers", 1) == 0
    assert tokenize(*base, "--output-prefix", tmp_path / "w2", "--workers", 2) == 0
    assert tokenize(*base, "--output-prefix", tmp_path / "w0", "--workers", 0) == 0
    status = tokenize(*base, "--output-prefix", tmp_path / "p3", "--workers", 3, "--partitions", 3)
    assert status == 0
    reference = tmp_path / "w1_text_document"
    for name in ("w2", "w0", "p3"):
        assert same_files(tmp_path / f"{name}_text_document", reference), name
    assert not [p for p in os.listdir(tmp_path) if "partitions" in p or p.endswith(".tmp")]


def test_gzip_zstd_globs_and_folders_read_like_the_plain_concatenation(real_jsonl, tmp_path):
    data = real_jsonl.read_bytes()
    lines = data.splitlines(keepends=True)
    half = len(lines) // 2
    folder = tmp_path / "in"
    folder.mkdir()
    (folder / "part1.jsonl.gz").write_bytes(gzip.compress(b"".join(lines[:half])))
    (folder / "part2.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(b"".join(lines[half:]))
    )
    assert tokenize("--input", real_jsonl, "--output-prefix", tmp_path / "plain", *GPT2) == 0
    assert tokenize("--input", folder, "--output-prefix", tmp_path / "folder", *GPT2) == 0
    pattern = str(folder / "part*")
    assert tokenize("--input", pattern, "--output-prefix", tmp_path / "glob", *GPT2) == 0
    two = [folder / "part1.jsonl.gz", folder / "part2.jsonl.zst"]
    assert tokenize("--input", *two, "--output-prefix", tmp_path / "two", *GPT2) == 0
    for name in ("folder", "glob", "two"):
        assert same_files(tmp_path / f"{name}_text_document", tmp_path / "plain_text_document")


# --- bad input -------------------------------------------------------------------------------

BAD_LINES = {
    "invalid JSON": (
        b'{"text": "a" "b"}',
        r"invalid JSON \(Expecting ',' delimiter at column 14\)",
    ),
    "missing key": (b'{"body": "a"}', r"no key 'text' \(the object has 'body'\); see --json-keys"),
    "not UTF-8": (b'{"text": "caf\xe9"}', r"not valid UTF-8 \(byte 0xe9 at byte 14 of the line\)"),
    "non-string value": (b'{"text": 42}', r"the value of 'text' is a JSON number, not a string"),
    "null value": (b'{"text": null}', r"the value of 'text' is a JSON null, not a string"),
    "mixed list": (b'{"text": ["a", 1]}', r"the value of 'text' is a JSON array, not a string"),
    "not an object": (b'["text"]', r"expected a JSON object, found a JSON array"),
    "unpaired surrogate": (
        b'{"text": "a\\ud800b"}',
        r"the value of 'text' has an unpaired surrogate \\ud800 at character 2",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_line_stops_the_run_naming_file_line_and_reason(tmp_path, monkeypatch, capsys, case):
    monkeypatch.chdir(tmp_path)
    line, reason = BAD_LINES[case]
    write_lines(tmp_path / "corpus.jsonl", [b'{"text": "ok"}'] * 16 + [line, b'{"text": "ok"}'])
    status = tokenize("--input", "corpus.jsonl", "--output-prefix", "out/c", *GPT2, "--workers", 2)
    assert status == 2
    err = capsys.readouterr().err
    assert re.search(
        rf"mg-prep tokenize: error: corpus\.jsonl:17: {reason}.*; "
        r"fix the line or pass --on-error skip",
        err,
    ), err
    assert "Traceback" not in err
    # nothing under a final name, no temporaries, not even the folder the run made
    assert not (tmp_path / "out").exists()


def test_skip_counts_every_reason_and_keeps_the_good_lines(tmp_path, capsys):
    lines = [b'{"text": "good one"}']
    for line, _ in BAD_LINES.values():
        lines += [line, b'{"text": "good"}', b"   "]
    corpus = write_lines(tmp_path / "c.jsonl", lines)
    status = tokenize(
        "--input", corpus, "--output-prefix", tmp_path / "o", *GPT2, "--on-error", "skip",
        "--workers", 1,
    )  # fmt: skip
    assert status == 0
    err = capsys.readouterr().err
    assert len(documents(tmp_path / "o_text_document")) == 1 + len(BAD_LINES)
    assert "skipped 8 lines: 3 non-string value, 1 invalid JSON, 1 missing key, 1 not UTF-8, " \
        "1 not a JSON object, 1 unpaired surrogate" in err  # fmt: skip
    assert f"{len(BAD_LINES)} blank lines ignored" in err
    assert f"{corpus}:2: invalid JSON" in err  # examples name file:line


def test_truncated_gzip_fails_or_is_skipped_and_counted(real_jsonl, tmp_path, capsys):
    whole = gzip.compress(real_jsonl.read_bytes())
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(whole[: len(whole) // 2])
    good = write_lines(tmp_path / "good.jsonl", [{"text": "after"}])
    args = ["--input", broken, good, "--output-prefix", tmp_path / "o", *GPT2]
    assert tokenize(*args) == 2
    err = capsys.readouterr().err
    assert re.search(r"broken\.jsonl\.gz:\d+: the file cannot be read after line \d+", err), err
    assert "fix the file or pass --on-error skip" in err
    assert not list(tmp_path.glob("o_*"))
    assert tokenize(*args, "--on-error", "skip") == 0
    assert "1 unreadable file" in capsys.readouterr().err
    assert documents(tmp_path / "o_text_document")[-1] == [[8499]]  # "after" still read


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"--input": ["missing.jsonl"]}, "missing.jsonl: no such file or folder"),
        ({"--vocab-file": ["nope.json"]}, "--vocab-file nope.json: no such file"),
        ({"--workers": ["3"], "--partitions": ["2"]}, "not a multiple of --partitions"),
        ({"--json-keys": ["text", "text"]}, "a key is named twice"),
    ],
)
def test_command_line_mistakes_are_clean_errors(tmp_path, monkeypatch, capsys, change, message):
    monkeypatch.chdir(tmp_path)
    write_lines(tmp_path / "c.jsonl", [{"text": "x"}])
    flags = {"--input": ["c.jsonl"], "--output-prefix": ["o"]}
    flags.update({flag: [value] for flag, value in zip(GPT2[::2], GPT2[1::2], strict=True)})
    flags.update(change)
    assert tokenize(*[part for flag, values in flags.items() for part in (flag, *values)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_vocabulary_that_is_not_one_is_a_clean_error(tmp_path, capsys):
    corpus = write_lines(tmp_path / "c.jsonl", [{"text": "x"}])
    bogus = tmp_path / "vocab.json"
    bogus.write_text("this is not json")
    args = [*GPT2]
    args[3] = str(bogus)
    assert tokenize("--input", corpus, "--output-prefix", tmp_path / "o", *args) == 2
    err = capsys.readouterr().err
    assert "mg-prep tokenize: error: cannot build the GPT2BPETokenizer tokenizer" in err
    assert "Traceback" not in err


def test_an_existing_output_survives_a_failed_run(tmp_path):
    good = write_lines(tmp_path / "good.jsonl", [{"text": "first"}])
    bad = write_lines(tmp_path / "bad.jsonl", [{"text": "second"}, b"{broken"])
    assert tokenize("--input", good, "--output-prefix", tmp_path / "o", *GPT2) == 0
    before = (tmp_path / "o_text_document.bin").read_bytes()
    assert tokenize("--input", bad, "--output-prefix", tmp_path / "o", *GPT2) == 2
    assert (tmp_path / "o_text_document.bin").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bad.jsonl", "good.jsonl", "o_text_document.bin", "o_text_document.idx",
    ]  # fmt: skip


# --- messages --------------------------------------------------------------------------------


def test_log_interval_lines_and_summary(real_jsonl, tmp_path, capsys):
    status = tokenize(
        "--input", real_jsonl, "--output-prefix", tmp_path / "o", *GPT2, "--log-interval", 1000,
        "--workers", 1,
    )  # fmt: skip
    assert status == 0
    err = capsys.readouterr().err
    lines = re.findall(
        r"Processed (\d+) documents \([\d.]+ docs/s, [\d.]+ MB/s, [\d,]+ tokens/s, "
        r"ETA \d+:\d\d:\d\d\)\.",
        err,
    )
    assert len(lines) >= 3 and all(int(n) >= 1000 for n in lines)
    dataset = IndexedDataset(str(tmp_path / "o_text_document"))
    assert re.search(
        rf"{dataset.num_documents:,} documents, {len(dataset):,} sequences, "
        rf"{dataset.num_tokens:,} tokens from [\d.]+ MB in [\d.]+ s \([\d,]+ docs/s, "
        r"[\d.]+ MB/s, [\d,]+ tokens/s\)",
        err,
    ), err
    assert "wrote " in err and "o_text_document.bin/.idx (uint16, key 'text')" in err


def test_bert_without_sentence_splitting_warns_like_megatron(tmp_path, capsys):
    from mg.core.fixtures import fixture_dir

    corpus = write_lines(tmp_path / "c.jsonl", [{"text": "Hello there. General Kenobi."}])
    vocab = fixture_dir("minilm-bert") / "vocab.txt"
    bert = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab]
    assert tokenize("--input", corpus, "--output-prefix", tmp_path / "o", *bert) == 0
    assert "without --split-sentences" in capsys.readouterr().err
    assert len(documents(tmp_path / "o_text_document")[0]) == 1


@pytest.mark.slow
def test_a_50_mb_document(tmp_path):
    """One JSON line of 50 MB: tokenized whole, like Megatron does."""
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")
    big = (text * (50_000_000 // len(text) + 1))[:50_000_000]
    corpus = write_lines(tmp_path / "c.jsonl", [{"text": "small"}, {"text": big}])
    assert (
        tokenize("--input", corpus, "--output-prefix", tmp_path / "o", *GPT2, "--append-eod") == 0
    )
    dataset = IndexedDataset(str(tmp_path / "o_text_document"))
    assert dataset.num_documents == 2 and dataset.sequence_lengths[1] > 10_000_000
    assert np.asarray(dataset[1])[-1] == EOD
    shutil.rmtree(tmp_path)


def test_a_json_array_file_gets_a_hint(tmp_path, capsys):
    corpus = tmp_path / "array.json"
    corpus.write_text('[\n  {"text": "a"},\n  {"text": "b"}\n]\n')
    assert tokenize("--input", corpus, "--output-prefix", tmp_path / "o", *GPT2) == 2
    err = capsys.readouterr().err
    assert "array.json:1: invalid JSON" in err
    assert "looks like one JSON array: write one object per line" in err


def test_more_partitions_than_lines_and_a_compressed_file(tmp_path):
    plain = write_lines(tmp_path / "a.jsonl", [{"text": "one"}])
    packed = tmp_path / "b.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"text": "two"}\n{"text": "three"}\n'))
    args = ["--input", plain, packed, *GPT2, "--append-eod"]
    assert (
        tokenize(*args, "--output-prefix", tmp_path / "p", "--workers", 4, "--partitions", 4) == 0
    )
    assert tokenize(*args, "--output-prefix", tmp_path / "s", "--workers", 1) == 0
    assert same_files(tmp_path / "p_text_document", tmp_path / "s_text_document")
    assert len(documents(tmp_path / "p_text_document")) == 3
