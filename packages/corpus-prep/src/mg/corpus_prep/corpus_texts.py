"""Loose-JSON documents from `--input` paths, for `clean` and `train-tokenizer`.

Files are found and streamed by `mg.corpus_prep.reader` (plain, gzip, zstd;
one line in memory at a time). Each non-blank line must be a JSON object with
a string under every requested key. A bad line is an error that names its
file and line; with ``on_error="skip"`` it is reported and skipped instead,
the same contract as `mg-prep tokenize --on-error`.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from mg.corpus_prep.encoder import parse_line
from mg.corpus_prep.reader import Segment, find_sources, read_lines

MAX_REPORTED_SKIPS = 10


class BadLine(Exception):
    """A line that is not a usable document; the message names file and line."""


@dataclass(frozen=True)
class Document:
    source: str
    lineno: int
    record: dict[str, Any]  # the whole JSON object, other fields included
    texts: list[str]  # one per json key, in key order


def parse_document(source: str, lineno: int, data: bytes, keys: list[str]) -> Document | None:
    """Decode one line (None if blank); raise `BadLine` saying what is wrong, and where.

    Validation and messages are tokenize's (`encoder.parse_line`), so both
    commands reject the same lines with the same words; the object is then
    kept whole, since `clean` writes its other fields back out.
    """
    parsed = parse_line(data, tuple(keys))
    if parsed is None:
        return None
    if isinstance(parsed, tuple):
        raise BadLine(f"{source}:{lineno}: {parsed[1]}")
    texts = []
    for key in keys:
        value = parsed[key]
        if not isinstance(value, str):
            raise BadLine(
                f"{source}:{lineno}: the value of {key!r} is a list of sentences; "
                "this command needs one string per document"
            )
        texts.append(value)
    record = json.loads(data.decode("utf-8").lstrip("\ufeff"))
    return Document(source, lineno, record, texts)


class SkipReporter:
    """Prints the first few skipped lines to stderr and counts all of them."""

    def __init__(self, stream: Any = None, limit: int = MAX_REPORTED_SKIPS) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.limit = limit
        self.count = 0

    def __call__(self, error: BadLine) -> None:
        self.count += 1
        if self.count <= self.limit:
            print(f"skipped {error}", file=self.stream)
        if self.count == self.limit:
            print("(further skipped lines are counted, not shown)", file=self.stream)


def iter_documents(
    inputs: Iterable[str],
    keys: list[str],
    on_error: str = "fail",
    on_skip: Callable[[BadLine], None] | None = None,
) -> Iterator[Document]:
    """Documents of every input file, in input order; blank lines are ignored.

    ``on_error="fail"`` raises the first `BadLine`; ``"skip"`` hands it to
    `on_skip` (default: a `SkipReporter`) and goes on.
    """
    report = on_skip or SkipReporter()
    for source in find_sources(inputs):
        for lineno, data in read_lines(Segment(source)):
            try:
                document = parse_document(source.name, lineno, data, keys)
            except BadLine as err:
                if on_error != "skip":
                    raise
                report(err)
                continue
            if document is not None:
                yield document
