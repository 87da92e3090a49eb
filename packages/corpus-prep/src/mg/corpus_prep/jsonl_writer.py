"""Write a JSONL file (plain, .gz or .zst by its name) atomically.

Lines go to a temporary file beside the output; only a complete, fsynced file
is renamed to the output name. An error or interrupt deletes the temporary,
so the output name holds either the previous file or a complete new one.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
from types import TracebackType
from typing import IO, Any

import zstandard

from mg.corpus_prep.refresh_files import fsync_path, temporary_name


def compression_of(path: str) -> str:
    if path.endswith(".gz"):
        return "gzip"
    if path.endswith(".zst"):
        return "zstd"
    return "none"


class AtomicJsonlWriter:
    """``with AtomicJsonlWriter("out.jsonl.zst") as out: out.write({"text": ...})``."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self.temporary = temporary_name(self.path)
        self.lines = 0
        self._raw: IO[bytes] = open(self.temporary, "xb")  # noqa: SIM115 -- closed in close()
        compression = compression_of(self.path)
        self._stream: IO[bytes]
        if compression == "gzip":
            # mtime=0 and no file name in the header (it would be the temporary file's): the
            # same input gives byte-identical output
            self._stream = gzip.GzipFile(  # type: ignore[assignment]
                filename="", fileobj=self._raw, mode="wb", mtime=0
            )
        elif compression == "zstd":
            self._stream = zstandard.ZstdCompressor().stream_writer(self._raw, closefd=False)  # type: ignore[assignment]
        else:
            self._stream = self._raw

    def write(self, record: dict[str, Any]) -> None:
        self._stream.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
        self.lines += 1

    def commit(self) -> None:
        """Finish the compressed stream, fsync, and rename into place."""
        if self._stream is not self._raw:
            self._stream.close()
        self._raw.flush()
        os.fsync(self._raw.fileno())
        self._raw.close()
        os.replace(self.temporary, self.path)
        fsync_path(os.path.dirname(os.path.abspath(self.path)))

    def abort(self) -> None:
        for stream in (self._stream, self._raw):
            with contextlib.suppress(Exception):  # best effort: we are failing already
                stream.close()
        if os.path.exists(self.temporary):
            os.remove(self.temporary)

    def __enter__(self) -> AtomicJsonlWriter:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.commit()
        else:
            self.abort()
