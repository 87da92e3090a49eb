"""Concatenate indexed datasets into one (Megatron's tools/merge_datasets.py)."""

from __future__ import annotations

import os
from collections.abc import Sequence

from mg.indexed_dataset.builder import IndexedDatasetBuilder
from mg.indexed_dataset.errors import IndexedDatasetError
from mg.indexed_dataset.layout import bin_path_of, idx_path_of, read_header


def list_dataset_prefixes(folder: str | os.PathLike[str]) -> list[str]:
    """Prefixes of the `.bin`/`.idx` pairs in `folder`, sorted by name as Megatron merges them.

    The order is plain string order (`part_10` before `part_2`), Megatron's
    order, so that a merge gives the same file. Other files are ignored; a
    `.bin` without its `.idx` (or the reverse) is an error, since merging
    without it would silently drop data.
    """
    folder = os.fspath(folder)
    extensions: dict[str, set[str]] = {}
    for name in os.listdir(folder):
        stem, extension = os.path.splitext(name)
        if extension in (".bin", ".idx") and os.path.isfile(os.path.join(folder, name)):
            extensions.setdefault(stem, set()).add(extension)
    for stem, found in sorted(extensions.items()):
        if len(found) < 2:
            (have,) = found
            lacking = ".idx" if have == ".bin" else ".bin"
            raise IndexedDatasetError(
                f"{os.path.join(folder, stem + lacking)}: missing: {stem}{have} is in {folder} "
                f"but {stem}{lacking} is not; copy it too, or move {stem}{have} out of the folder"
            )
    return [os.path.join(folder, stem) for stem in sorted(extensions)]


def merge_datasets(
    prefixes: Sequence[str | os.PathLike[str]],
    output_prefix: str | os.PathLike[str],
    multimodal: bool = False,
) -> None:
    """Write `output_prefix.{bin,idx}` holding the documents of `prefixes`, in that order.

    All inputs must share one token dtype (one tokenizer). Each input is checked
    in full before it is copied, and the output appears only when complete, so
    the output prefix may even be one of the inputs.
    """
    if not prefixes:
        raise IndexedDatasetError(
            f"{os.fspath(output_prefix)}: nothing to merge: no input prefixes"
        )
    first = os.fspath(prefixes[0])
    if not os.path.isfile(idx_path_of(first)):
        raise IndexedDatasetError(f"{idx_path_of(first)}: missing: cannot merge {first}")
    dtype = read_header(idx_path_of(first)).dtype
    with IndexedDatasetBuilder(bin_path_of(output_prefix), dtype, multimodal) as builder:
        for prefix in prefixes:
            builder.add_index(prefix)
        builder.finalize(idx_path_of(output_prefix))
