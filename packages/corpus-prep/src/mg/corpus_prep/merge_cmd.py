"""`mg-prep merge`: Megatron's tools/merge_datasets.py, for folders and explicit prefixes.

    mg-prep merge --input data/parts --output-prefix data/corpus_text_document

A folder contributes every `.bin`/`.idx` pair in it in sorted name order,
as Megatron merges a folder; a prefix (or a `.bin`/`.idx` path) contributes
that one dataset. When PREFIX.bin/.idx exist and a folder PREFIX/ too (mg-train
keeps its index cache in PREFIX/cache/), the dataset is merged and a line says
so. Inputs are merged in the order given. All inputs must hold tokens of one
dtype; the output appears only once it is complete, and replaces an existing
dataset of the same name (a line says so).
"""

from __future__ import annotations

import argparse
import os
import sys

from mg.corpus_prep.commands import UserError, refuse_own_input
from mg.corpus_prep.output_faults import (
    cannot_write,
    existing_dataset,
    missing_folders,
    remove_folders,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="concatenate indexed datasets (merge_datasets.py)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--input",
        nargs="+",
        required=True,
        metavar="DIR|PREFIX",
        help="folders of datasets (merged in sorted order) and/or dataset prefixes",
    )
    parser.add_argument("--output-prefix", required=True, help="output path without .bin/.idx")
    parser.add_argument(
        "--multimodal", action="store_true", help="the datasets carry sequence modes"
    )
    parser.set_defaults(func=run)


def _strip_suffix(path: str) -> str:
    root, extension = os.path.splitext(path)
    return root if extension in (".bin", ".idx") else path


def resolve_inputs(inputs: list[str], output_prefix: str) -> list[str]:
    """The dataset prefixes to merge, in order; a folder's own copy of the output is left out."""
    # lazy: numpy only once the flags are parsed (`mg-prep merge --help` stays instant)
    from mg.indexed_dataset.format import IndexedDatasetError, list_dataset_prefixes

    output = os.path.abspath(output_prefix)
    prefixes: list[str] = []
    for item in inputs:
        prefix = _strip_suffix(item)
        is_dataset = all(os.path.isfile(prefix + suffix) for suffix in (".bin", ".idx"))
        if is_dataset and os.path.isdir(item):
            print(
                f"mg-prep merge: {item} is a dataset ({item}.bin/.idx) and a folder; "
                f"merging the dataset (name the folder as {os.path.join(item, '')} to merge "
                "the datasets in it)",
                file=sys.stderr,
            )
        if os.path.isdir(item) and not is_dataset:
            try:
                found = list_dataset_prefixes(item)
            except IndexedDatasetError as err:
                raise UserError(str(err)) from err
            found = [p for p in found if os.path.abspath(p) != output]
            if not found:
                raise UserError(f"{item}: the folder holds no .bin/.idx datasets")
            prefixes.extend(found)
            continue
        missing = [p for p in (prefix + ".bin", prefix + ".idx") if not os.path.isfile(p)]
        if missing:
            raise UserError(
                f"{item}: not a folder or a dataset prefix ({', '.join(missing)} not found)"
            )
        prefixes.append(prefix)
    return prefixes


def run(args: argparse.Namespace) -> int:
    # lazy: numpy only once the flags are parsed (`mg-prep merge --help` stays instant)
    from mg.indexed_dataset.format import IndexedDataset, IndexedDatasetError

    prefixes = resolve_inputs(args.input, args.output_prefix)
    # a folder's own copy of the output is already left out; a named input is refused
    refuse_own_input(
        [("--output-prefix", args.output_prefix + suffix) for suffix in (".bin", ".idx")],
        [("--input", prefix + suffix) for prefix in prefixes for suffix in (".bin", ".idx")],
    )
    replacing = existing_dataset(args.output_prefix)
    try:
        _write(prefixes, args.output_prefix, args.multimodal)
        with IndexedDataset(args.output_prefix, multimodal=args.multimodal) as merged:
            documents, sequences, tokens = merged.num_documents, len(merged), merged.num_tokens
            dtype = merged.dtype.name
    except IndexedDatasetError as err:
        raise UserError(str(err)) from err
    print(
        f"mg-prep merge: {len(prefixes)} datasets -> {args.output_prefix}.bin/.idx: "
        f"{documents:,} documents, {sequences:,} sequences, {tokens:,} tokens ({dtype})"
    )
    if replacing:  # as Megatron's merge_datasets.py, which does it silently
        print(f"mg-prep merge: replaced the existing {args.output_prefix}.bin/.idx")
    return 0


def _write(prefixes: list[str], output_prefix: str, multimodal: bool) -> None:
    """merge_datasets, with the output's OSErrors (full disk, read-only folder, a path
    through a file) as one-line UserErrors; the builder has removed its temporaries."""
    # lazy: numpy only once the flags are parsed (`mg-prep merge --help` stays instant)
    from mg.indexed_dataset.format import merge_datasets

    folder = os.path.dirname(os.path.abspath(output_prefix))
    created = missing_folders(folder)
    try:
        os.makedirs(folder, exist_ok=True)
        merge_datasets(prefixes, output_prefix, multimodal=multimodal)
    except BaseException as err:
        remove_folders(created)  # a failed merge leaves no folder it made either
        if not isinstance(err, OSError):
            raise
        inputs = {prefix + suffix for prefix in prefixes for suffix in (".bin", ".idx")}
        if err.filename and os.fspath(err.filename) in inputs:  # an input, not the output
            raise UserError(f"{err.filename}: cannot read ({err.strerror or err})") from err
        raise UserError(cannot_write(output_prefix, err)) from err
