"""Parquet files (Hugging Face datasets' format) read as JSON lines, one row each.

Each row becomes the JSON object of its columns, so that everything after the
reader (keys, errors, `--on-error`, workers, partitions) is the same as for
JSONL and the output is the same bytes as for the JSONL of the same rows. Rows
are read a batch at a time: memory is one row group, whatever the file size.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator

PARQUET_MAGIC = b"PAR1"
BATCH_ROWS = 1024


def _jsonable(value: object) -> object:
    """A JSON stand-in for a value json cannot write (bytes, dates, decimals)."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")  # a binary text column, as gigatoken reads it
        except UnicodeDecodeError:
            return {"base64": base64.b64encode(value).decode("ascii")}
    return str(value)


def parquet_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """`(row number from 1, the row as one JSON line)` for every row of a Parquet file.

    A file pyarrow cannot read is an OSError naming the reason, as a truncated gzip is.
    """
    try:
        import pyarrow  # lazy: an optional dependency, needed only for Parquet input
        import pyarrow.parquet as pq  # lazy: as above
    except ImportError as err:
        raise OSError(
            f"reading Parquet needs pyarrow ({err}); install mg-corpus-prep[parquet]"
        ) from err
    row = 0
    try:
        with pq.ParquetFile(path) as table:
            for batch in table.iter_batches(batch_size=BATCH_ROWS):
                for record in batch.to_pylist():
                    row += 1
                    line = json.dumps(record, ensure_ascii=False, default=_jsonable)
                    yield row, line.encode("utf-8")
    except pyarrow.ArrowException as err:
        raise OSError(f"not a readable Parquet file: {err}") from err
