"""Token ids against a model's vocabulary, checked before any step runs.

A dataset made with another tokenizer (or for a larger vocabulary) holds ids the
model's embedding has no row for; the first batch that meets one fails deep in
the forward with an ``IndexError``, possibly hours in. The tools check each
dataset's largest id first: one pass over the ``.bin`` (memory-mapped, in
chunks), skipped when the file's dtype cannot hold an id that large. Several
processes (a distributed run's ranks) share the pass: each reads every
``count``-th chunk and ``reduce_max`` (an all-reduce) gives them all the answer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import numpy as np

from mg.indexed_dataset.errors import IndexedDatasetError
from mg.indexed_dataset.reader import IndexedDataset

_CHUNK = 1 << 24  # tokens per read: bounded memory on any dataset size


def max_token_id(
    dataset: IndexedDataset, part: tuple[int, int] = (0, 1), *, mmap: bool = True
) -> int:
    """The largest token id in the dataset's ``.bin`` (-1 for an empty one); with
    ``part`` = (index, count), in this process's share of its chunks only; ``mmap``
    False reads the chunks with plain reads (``--no-mmap-bin-files``)."""
    if dataset.num_tokens == 0:
        return -1
    index, count = part
    starts = range(index * _CHUNK, dataset.num_tokens, count * _CHUNK)
    if mmap:
        tokens = np.memmap(dataset.bin_path, dtype=dataset.dtype, mode="r")
        return max((int(tokens[i : i + _CHUNK].max()) for i in starts), default=-1)
    top = -1
    with open(dataset.bin_path, "rb") as stream:
        for start in starts:
            stream.seek(start * np.dtype(dataset.dtype).itemsize)
            chunk = np.fromfile(stream, dtype=dataset.dtype, count=_CHUNK)
            top = max(top, int(chunk.max()))
    return top


def scan_bytes(prefix: str, part: tuple[int, int] = (0, 1)) -> int:
    """The bytes of ``prefix``'s ``.bin`` one of ``part[1]`` processes reads in a check."""
    return os.path.getsize(f"{prefix}.bin") // max(part[1], 1)


def check_token_ids(
    prefixes: Iterable[str],
    vocab_size: int,
    vocabulary: str,
    *,
    part: tuple[int, int] = (0, 1),
    reduce_max: Callable[[int], int] = lambda top: top,
    mmap: bool = True,
) -> None:
    """Refuse a dataset holding an id >= ``vocab_size``; ``vocabulary`` says whose it is
    (e.g. "the model's embedding (the tokenizer's 127 ids, padded to 128 rows)").

    Collective with ``part``/``reduce_max``: every process calls it with the same
    prefixes, its (rank, world size) and a max over the processes."""
    for prefix in prefixes:
        dataset = IndexedDataset(prefix, mmap=mmap, validate=False)
        try:
            if np.iinfo(dataset.dtype).max < vocab_size:
                continue  # no id the file can hold is out of range
            top = reduce_max(max_token_id(dataset, part, mmap=mmap))
        finally:
            dataset.close()
        if top >= vocab_size:
            raise IndexedDatasetError(
                f"{dataset.bin_path}: its largest token id is {top}, beyond {vocabulary}: ids "
                f"must be below {vocab_size}; the data was made with another tokenizer. Re-run "
                "mg-prep with this model's tokenizer, or pick the tokenizer (and vocabulary "
                "size) the data was made with"
            )
