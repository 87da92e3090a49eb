"""The chunk database: which tokens each chunk is, and a neighbour with its continuation.

A row of the table is Megatron's ``(dataset index, document id, start token, end
token, BERT length)``; a chunk's tokens are read from its indexed dataset and
padded with the end-of-document token to the chunk length (a document's last
chunk is usually short). Retrieval returns a neighbour chunk followed by its
continuation, the chunks after it in the same document (Retro's ``[N, F]``); a
continuation past the document's end is end-of-document tokens, not the next
document's first chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

DATASET, DOCUMENT, START, END, BERT_LENGTH = range(5)
CHUNK_COLUMNS = 5
_DOC_BITS = 40  # document ids below 2**40 in a key that also holds the dataset index


class TokenSource(Protocol):
    """What chunks are read from: an ``mg.indexed_dataset.IndexedDataset``."""

    def get(self, idx: int, offset: int = 0, length: int | None = None) -> np.ndarray: ...


def document_keys(dataset_index: np.ndarray | int, document_id: np.ndarray | int) -> np.ndarray:
    """One int64 per (dataset, document): what "the same document" is compared by."""
    return (np.asarray(dataset_index, dtype=np.int64) << _DOC_BITS) | np.asarray(
        document_id, dtype=np.int64
    )


class ChunkDatabase:
    """The chunk table over the datasets it indexes (in the order of ``datasets.json``)."""

    def __init__(
        self,
        chunks: np.ndarray,
        sources: Sequence[TokenSource],
        chunk_length: int,
        eod_token_id: int,
    ) -> None:
        if chunks.ndim != 2 or chunks.shape[1] != CHUNK_COLUMNS:
            raise ValueError(f"a chunk table has {CHUNK_COLUMNS} columns, got {chunks.shape}")
        self.chunks = chunks
        self.sources = list(sources)
        self.chunk_length = chunk_length
        self.eod_token_id = eod_token_id
        self.doc_keys = document_keys(chunks[:, DATASET], chunks[:, DOCUMENT])

    def __len__(self) -> int:
        return int(self.chunks.shape[0])

    def chunk_tokens(self, chunk_id: int) -> np.ndarray:
        """The ``chunk_length`` token ids of a chunk (int64), padded with end-of-document."""
        dataset, doc, start, end, _ = (int(v) for v in self.chunks[chunk_id])
        out = np.full(self.chunk_length, self.eod_token_id, dtype=np.int64)
        out[: end - start] = self.sources[dataset].get(doc, offset=start, length=end - start)
        return out

    def retrieved_tokens(
        self, neighbor_ids: Sequence[int], num_retrieved_chunks: int
    ) -> np.ndarray:
        """[neighbours, num_retrieved_chunks * chunk_length]: each neighbour and its continuation.

        A neighbour id of -1 (fewer neighbours than asked were found) and a
        continuation past its document's end read as end-of-document tokens.
        """
        length = self.chunk_length
        out = np.full(
            (len(neighbor_ids), num_retrieved_chunks * length), self.eod_token_id, dtype=np.int64
        )
        for row, first in enumerate(int(i) for i in neighbor_ids):
            if first < 0:
                continue
            for step in range(num_retrieved_chunks):
                chunk_id = first + step
                if chunk_id >= len(self) or self.doc_keys[chunk_id] != self.doc_keys[first]:
                    break
                out[row, step * length : (step + 1) * length] = self.chunk_tokens(chunk_id)
        return out
