"""Appends encoded chunks to one indexed dataset per JSON key, in input order.

Outputs are named as Megatron names them, `{prefix}_{key}_{level}.bin/.idx`
with level `document` or `sentence`. Every key's builder is finalized (not
only the last key's, a bug of Megatron before core_v0.18). The builders write
temporary files and rename them only in `finalize`; `abort` deletes them, so a
failed run leaves nothing under a final name.
"""

from __future__ import annotations

import numpy as np

from mg.corpus_prep.encoder import EncodedChunk
from mg.indexed_dataset.builder import note_left_behind
from mg.indexed_dataset.format import IndexedDatasetBuilder


def output_prefixes(prefix: str, keys: tuple[str, ...], level: str) -> dict[str, str]:
    """Megatron's output names: one dataset prefix per key."""
    return {key: f"{prefix}_{key}_{level}" for key in keys}


class DatasetWriter:
    """One `IndexedDatasetBuilder` per key; use as a context manager (aborts on error)."""

    def __init__(self, prefix: str, keys: tuple[str, ...], level: str, dtype: np.dtype) -> None:
        self.prefixes = output_prefixes(prefix, keys, level)
        self.builders: dict[str, IndexedDatasetBuilder] = {}
        try:
            for key, path in self.prefixes.items():
                self.builders[key] = IndexedDatasetBuilder(path + ".bin", dtype)
        except BaseException as err:
            note_left_behind(err, self.abort())
            raise

    def write(self, chunk: EncodedChunk) -> None:
        for key, part in chunk.keys.items():
            builder = self.builders[key]
            token_ends = np.cumsum(part.document_tokens)
            sequence_ends = np.cumsum(part.document_sequences)
            token_start = sequence_start = 0
            for token_end, sequence_end in zip(
                token_ends.tolist(), sequence_ends.tolist(), strict=True
            ):
                builder.add_document(
                    part.tokens[token_start:token_end],
                    part.sequence_lengths[sequence_start:sequence_end],
                )
                token_start, sequence_start = token_end, sequence_end

    def finalize(self) -> dict[str, str]:
        """Write every key's `.idx` and move the files into place; returns key -> prefix."""
        try:
            for key, builder in self.builders.items():
                builder.finalize(self.prefixes[key] + ".idx")
        except BaseException as err:
            note_left_behind(err, self.abort())
            raise
        return dict(self.prefixes)

    def abort(self) -> list[str]:
        """Delete every unfinished builder's temporary files; returns those that stayed."""
        left: list[str] = []
        for builder in self.builders.values():
            if not builder.finalized:
                left += builder.abort()
        return left

    def __enter__(self) -> DatasetWriter:
        return self

    def __exit__(self, exc_type: object, exc_value: BaseException | None, *rest: object) -> None:
        if exc_value is not None:
            note_left_behind(exc_value, self.abort())
        elif exc_type is not None:
            self.abort()
