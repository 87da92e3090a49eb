"""Find the input files and stream their lines, without ever holding a whole file.

`--input` takes files, glob patterns and folders, in any mix; plain, gzip and
zstd files are recognised by their first bytes (so a misnamed `.jsonl` that is
really gzip still works), and so are Parquet files, whose rows are read as
JSON lines (`parquet_rows`). A file is read as raw bytes and split on b"\\n" only:
decoding and JSON parsing happen in the tokenizer workers, where a bad line
becomes an error that names its file and line.

A `Segment` is a contiguous part of one file (the whole file, or a byte range
of an uncompressed file) so that `--partitions` can cut the input into
contiguous pieces that are read independently and still keep input order.
"""

from __future__ import annotations

import bisect
import glob
import gzip
import io
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

import zstandard

from mg.corpus_prep.parquet_rows import PARQUET_MAGIC, parquet_lines

# Extensions picked up from folders (a file named explicitly may have any name).
CORPUS_SUFFIXES = (
    ".jsonl",
    ".json",
    ".jsonl.gz",
    ".json.gz",
    ".jsonl.zst",
    ".json.zst",
    ".parquet",
)
GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
READ_BLOCK = 1 << 20


class InputError(Exception):
    """An input path is missing, unreadable or matches nothing."""


@dataclass(frozen=True)
class Source:
    """One input file: `name` is how messages show it (the path as found)."""

    name: str
    compression: str  # "none", "gzip", "zstd" or "parquet" (not lines: rows)
    size: int  # bytes on disk (compressed size for compressed files)


@dataclass(frozen=True)
class Segment:
    """Lines of `source` starting in bytes [start, end) of an uncompressed file.

    A compressed or Parquet file is always one whole segment (start 0, end None). A line
    belongs to the segment in which its first byte lies, so consecutive
    segments of one file cover every line exactly once.
    """

    source: Source
    start: int = 0
    end: int | None = None


def _is_glob(pattern: str) -> bool:
    return any(char in pattern for char in "*?[")


def _folder_files(folder: str) -> list[str]:
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found.extend(
            os.path.join(root, name)
            for name in sorted(files)
            if name.endswith(CORPUS_SUFFIXES) and not name.startswith(".")
        )
    return found


def detect_compression(path: str) -> str:
    """'gzip', 'zstd', 'parquet' or 'none', from the file's magic bytes."""
    with open(path, "rb") as stream:
        head = stream.read(4)
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    if head == PARQUET_MAGIC:
        return "parquet"
    return "none"


def find_sources(inputs: Iterable[str]) -> list[Source]:
    """Expand files, globs and folders into input files, in the order given.

    Globs and folders expand in sorted order (folders recursively, taking the
    corpus extensions in `CORPUS_SUFFIXES`); a file named twice is read once.
    Raises `InputError` for a path that does not exist, a pattern or folder
    that matches nothing, or a file that cannot be opened.
    """
    paths: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            matched = _folder_files(item)
            if not matched:
                raise InputError(
                    f"{item}: the folder holds no corpus files ({', '.join(CORPUS_SUFFIXES)})"
                )
            paths.extend(matched)
        elif _is_glob(item) and not os.path.exists(item):
            matched = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
            if not matched:
                raise InputError(f"{item}: the pattern matches no files")
            paths.extend(matched)
        elif os.path.exists(item):
            paths.append(item)
        else:
            raise InputError(f"{item}: no such file or folder")
    sources = []
    seen: set[str] = set()
    for path in paths:
        real = os.path.realpath(path)
        if real in seen:
            continue
        seen.add(real)
        try:
            compression = detect_compression(path)
            size = os.path.getsize(path)
        except OSError as err:
            raise InputError(f"{path}: cannot be read ({err.strerror or err})") from err
        sources.append(Source(path, compression, size))
    return sources


def open_binary(source: Source) -> BinaryIO:
    """The file's uncompressed bytes as a buffered binary stream."""
    if source.compression == "gzip":
        return gzip.open(source.name, "rb")  # type: ignore[return-value]
    raw = open(source.name, "rb")  # noqa: SIM115 -- the caller closes it
    if source.compression == "zstd":
        reader = zstandard.ZstdDecompressor().stream_reader(raw, closefd=True)
        return io.BufferedReader(reader, READ_BLOCK)  # type: ignore[arg-type]
    return raw


def count_newlines(path: str, end: int) -> int:
    """Newlines in the first `end` bytes of an uncompressed file (memchr-fast)."""
    count = 0
    with open(path, "rb") as stream:
        remaining = end
        while remaining > 0:
            block = stream.read(min(remaining, 16 * READ_BLOCK))
            if not block:
                break
            count += block.count(b"\n")
            remaining -= len(block)
    return count


def read_lines(segment: Segment) -> Iterator[tuple[int, bytes]]:
    """Stream `(line number, raw line)` of `segment`, numbered from 1 within their file.

    The newline is removed; a trailing "\\r" is kept (JSON reads it as
    whitespace). Memory is one line at a time plus the stream's buffer,
    whatever the file size.
    """
    source = segment.source
    if source.compression == "parquet":
        yield from parquet_lines(source.name)
        return
    lineno = 0
    with open_binary(source) as stream:
        position = 0
        if segment.start > 0:
            # Start at the first line beginning at or after `start`: skip the
            # rest of the line that byte start-1 belongs to.
            stream.seek(segment.start - 1)
            skipped = stream.readline()
            position = segment.start - 1 + len(skipped)
            # the skipped line's number is (newlines before it) + 1
            lineno = count_newlines(source.name, segment.start - 1) + 1
        end = segment.end
        for data in stream:
            if end is not None and position >= end:
                break
            position += len(data)
            lineno += 1
            yield lineno, data[:-1] if data[-1:] == b"\n" else data


def split_segments(sources: list[Source], parts: int) -> list[list[Segment]]:
    """Cut the concatenated input into `parts` contiguous groups of about equal size.

    Uncompressed files are cut at byte offsets (a line belongs to the part
    where it starts); compressed files cannot be entered in the middle and go
    whole to the part where they start. Parts may come out empty when there is
    little input. Concatenating the parts in order gives every line in input
    order, once.
    """
    total = sum(s.size for s in sources)
    cuts = [round(k * total / parts) for k in range(1, parts)]
    groups: list[list[Segment]] = [[] for _ in range(parts)]
    offset = 0  # input bytes before the current file
    for source in sources:
        if source.compression != "none":
            groups[bisect.bisect_right(cuts, offset)].append(Segment(source))
        start = 0
        while source.compression == "none" and start < source.size:
            part = bisect.bisect_right(cuts, offset + start)
            end = min(source.size, cuts[part] - offset) if part < len(cuts) else source.size
            groups[part].append(Segment(source, start, end if end < source.size else None))
            start = end
        offset += source.size
    return groups
