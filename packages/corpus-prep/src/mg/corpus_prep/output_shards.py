"""`mg-prep tokenize --output-shards N`: a dataset cut into N `.bin/.idx` pairs and its blend.

The run tokenizes into one dataset as usual; it is then cut at document
boundaries, in input order, into N contiguous shards of about equal token
counts (every shard gets at least one document with tokens: a `--data-path`
weight must be above 0), named `PREFIX_KEY_LEVEL_00000_of_0000N`. Beside
them `PREFIX_KEY_LEVEL.blend.txt` holds the blend that Megatron's
`--data-path` (or `--data-args-path FILE`) takes, one `weight prefix` pair per
line with the shards' token counts as weights, so that the shards are read in
proportion to their size, as the single dataset would have been.

The cut copies byte ranges of the `.bin` and rewrites the index ranges (each
shard's pointers and document indices start at 0), so it streams at disk
speed; the concatenated shards hold exactly the single dataset's documents.
"""

from __future__ import annotations

import os

import numpy as np

from mg.indexed_dataset.format import IndexedDataset, IndexHeader, bin_path_of, idx_path_of
from mg.indexed_dataset.layout import DOCUMENT_INDEX_DTYPE, LENGTH_DTYPE, POINTER_DTYPE

COPY_BLOCK = 16 << 20


class TooFewDocumentsError(ValueError):
    """Fewer documents with tokens than shards asked for."""


def shard_names(prefix: str, shards: int) -> list[str]:
    return [f"{prefix}_{i:05d}_of_{shards:05d}" for i in range(shards)]


def document_tokens(lengths: np.ndarray, document_indices: np.ndarray) -> np.ndarray:
    """Tokens per document (a document may hold no sequence at all)."""
    ends = np.concatenate(([0], np.cumsum(lengths, dtype=np.int64)))
    return ends[document_indices[1:]] - ends[document_indices[:-1]]


def cut_points(tokens: np.ndarray, shards: int) -> list[int]:
    """Document boundaries `[0, b1, ..., len(tokens)]` giving `shards` contiguous parts of
    about equal token counts, each with at least one document that has tokens."""
    filled = np.flatnonzero(tokens)
    if len(filled) < shards:
        raise TooFewDocumentsError(
            f"{len(filled)} documents with tokens, fewer than the {shards} shards"
        )
    through = np.cumsum(tokens[filled])  # tokens up to and including each filled document
    total = int(through[-1])
    cuts, before = [0], 0  # `before`: filled documents in the shards so far
    for k in range(1, shards):
        count = int(np.searchsorted(through, k * total / shards)) + 1
        count = min(max(count, before + 1), len(filled) - (shards - k))
        cuts.append(int(filled[count - 1]) + 1)  # empty documents after it: the next shard
        before = count
    cuts.append(len(tokens))
    return cuts


def split_dataset(prefix: str, target: str, shards: int) -> list[tuple[str, int]]:
    """Write the dataset at `prefix` as `shards` datasets named after `target`; return each
    one's (prefix, tokens), in order."""
    with IndexedDataset(prefix) as dataset:
        lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
        documents = np.asarray(dataset.document_indices, dtype=np.int64)
        dtype = dataset.dtype
    ends = np.concatenate(([0], np.cumsum(lengths)))
    tokens = document_tokens(lengths, documents)
    cuts = cut_points(tokens, shards)
    written = []
    with open(bin_path_of(prefix), "rb") as source:
        for name, first, last in zip(shard_names(target, shards), cuts, cuts[1:], strict=False):
            s0, s1 = int(documents[first]), int(documents[last])
            start, stop = int(ends[s0]) * dtype.itemsize, int(ends[s1]) * dtype.itemsize
            _write_shard(
                source, name, dtype, start, stop, lengths[s0:s1], documents[first : last + 1] - s0
            )
            written.append((name, int(ends[s1] - ends[s0])))
    return written


def _write_shard(
    source,
    name: str,
    dtype: np.dtype,
    start: int,
    stop: int,
    lengths: np.ndarray,
    documents: np.ndarray,
) -> None:
    """One shard's `.bin` (bytes [start, stop) of the source) and its `.idx`, each written
    beside its final name and renamed into place, the `.idx` last."""
    bin_temporary, idx_temporary = bin_path_of(name) + ".tmp", idx_path_of(name) + ".tmp"
    with open(bin_temporary, "wb") as out:
        source.seek(start)
        left = stop - start
        while left:
            block = source.read(min(left, COPY_BLOCK))
            out.write(block)
            left -= len(block)
    pointers = (
        np.concatenate(([0], np.cumsum(lengths[:-1]))) * dtype.itemsize
        if len(lengths)
        else np.zeros(0, np.int64)
    )
    with open(idx_temporary, "wb") as out:
        out.write(IndexHeader(dtype, len(lengths), len(documents)).pack())
        out.write(lengths.astype(LENGTH_DTYPE).tobytes())
        out.write(pointers.astype(POINTER_DTYPE).tobytes())
        out.write(documents.astype(DOCUMENT_INDEX_DTYPE).tobytes())
    os.replace(bin_temporary, bin_path_of(name))
    os.replace(idx_temporary, idx_path_of(name))


def write_blend(prefix: str, shards: list[tuple[str, int]]) -> str:
    """`prefix.blend.txt`: one `weight prefix` line per shard; return the path."""
    path = prefix + ".blend.txt"
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as out:
        out.writelines(f"{tokens} {name}\n" for name, tokens in shards)
    os.replace(temporary, path)
    return path


def remove_dataset(prefix: str) -> None:
    for path in (bin_path_of(prefix), idx_path_of(prefix)):
        if os.path.exists(path):
            os.remove(path)
