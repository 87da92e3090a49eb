"""Input discovery and line streaming: files, globs, folders, compression, byte-range segments."""

from __future__ import annotations

import gzip
import os

import pytest
import zstandard

from mg.corpus_prep.reader import (
    InputError,
    Segment,
    find_sources,
    read_lines,
    split_segments,
)


def write(path, data: bytes):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def lines_of(segment: Segment) -> list[tuple[int, bytes]]:
    return list(read_lines(segment))


def test_plain_gzip_and_zstd_by_magic_bytes(tmp_path):
    data = b'{"text": "a"}\n{"text": "b"}\r\n{"text": "c"}'  # no final newline, a CRLF
    plain = write(tmp_path / "a.jsonl", data)
    gz = write(tmp_path / "b.jsonl.gz", gzip.compress(data))
    zst = write(tmp_path / "c.jsonl.zst", zstandard.ZstdCompressor().compress(data))
    misnamed = write(tmp_path / "d.jsonl", gzip.compress(data))  # gzip without .gz
    sources = find_sources([str(p) for p in (plain, gz, zst, misnamed)])
    assert [s.compression for s in sources] == ["none", "gzip", "zstd", "gzip"]
    expected = [(1, b'{"text": "a"}'), (2, b'{"text": "b"}\r'), (3, b'{"text": "c"}')]
    for source in sources:
        assert lines_of(Segment(source)) == expected


def test_folders_are_recursive_and_sorted_globs_sorted_duplicates_dropped(tmp_path):
    for name in ["b.jsonl", "a.json", "sub/c.jsonl.gz", "notes.txt", ".hidden.jsonl"]:
        write(tmp_path / "in" / name, b"")
    found = [os.path.relpath(s.name, tmp_path) for s in find_sources([str(tmp_path / "in")])]
    assert found == ["in/a.json", "in/b.jsonl", "in/sub/c.jsonl.gz"]
    pattern = str(tmp_path / "in" / "*.json*")
    explicit = str(tmp_path / "in" / "b.jsonl")
    found = [os.path.relpath(s.name, tmp_path) for s in find_sources([explicit, pattern])]
    assert found == ["in/b.jsonl", "in/a.json"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda tmp: str(tmp / "missing.jsonl"), "no such file or folder"),
        (lambda tmp: str(tmp / "*.nothing"), "the pattern matches no files"),
        (lambda tmp: str((tmp / "empty").mkdir() or tmp / "empty"), "holds no corpus files"),
    ],
)
def test_inputs_that_match_nothing_are_errors(tmp_path, make, message):
    with pytest.raises(InputError, match=message):
        find_sources([make(tmp_path)])


def test_byte_range_segments_cover_every_line_once_with_right_numbers(tmp_path):
    lines = [f'{{"text": "{"x" * (i * 7 % 23)}"}}'.encode() for i in range(200)]
    lines[50] = b""  # a blank line
    data = b"\n".join(lines) + b"\n"
    path = write(tmp_path / "c.jsonl", data)
    gz = write(tmp_path / "d.jsonl.gz", gzip.compress(data))
    sources = find_sources([str(path), str(gz), str(path)])  # the repeat is dropped
    assert len(sources) == 2
    whole = [line for s in sources for line in lines_of(Segment(s))]
    for parts in (1, 2, 3, 7, 64):
        groups = split_segments(sources, parts)
        assert len(groups) == parts
        pieces = [line for group in groups for seg in group for line in lines_of(seg)]
        assert pieces == whole, parts
    # the gzip file is never cut
    assert all(
        seg.start == 0 and seg.end is None
        for group in split_segments(sources, 5)
        for seg in group
        if seg.source.compression == "gzip"
    )


def test_segment_starting_exactly_at_a_line_start(tmp_path):
    path = write(tmp_path / "e.jsonl", b"aa\nbb\ncc\n")
    (source,) = find_sources([str(path)])
    assert lines_of(Segment(source, 0, 3)) == [(1, b"aa")]
    assert lines_of(Segment(source, 3, 6)) == [(2, b"bb")]
    assert lines_of(Segment(source, 4, None)) == [(3, b"cc")]  # starts mid-line: next line
