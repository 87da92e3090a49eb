"""Megatron's data and tokenizer flags: where samples come from and which tokenizer made them."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    import numpy as np

    from mg.trainer.arguments.args import Args


@dataclass
class DataArgs:
    """Where samples come from and which tokenizer made them."""

    data_path: list[str] | None = None
    data_args_path: str | None = None
    split: str | None = None
    mock_data: bool = False
    data_cache_path: str | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_extra_ids: int = 0
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    tiktoken_pattern: str | None = None
    num_workers: int = 0
    mmap_bin_files: bool = True


def add_data_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--data-path",
        nargs="+",
        help="Dataset prefixes: 'P', 'w1 P1 w2 P2 ...' or 'P1 P2 ...' (mg-prep output).",
    )
    p.add_argument(
        "--data-args-path",
        help="A blend file ('weight prefix' per line) as written by mg-prep refresh.",
    )
    p.add_argument("--split", help="Train/valid/test weights, e.g. 969,30,1 (the default).")
    p.add_argument("--mock-data", action="store_true", help="Synthetic data; no files needed.")
    p.add_argument("--data-cache-path", help="Where to put the sample-index cache files.")
    p.add_argument(
        "--reset-position-ids", action="store_true", help="Restart positions after each EOD."
    )
    p.add_argument(
        "--reset-attention-mask", action="store_true", help="No attention across EOD tokens."
    )
    p.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")
    p.add_argument("--tokenizer-type", help="Megatron tokenizer type, e.g. GPT2BPETokenizer.")
    p.add_argument("--vocab-file", help="Vocabulary file of the tokenizer.")
    p.add_argument("--merge-file", help="BPE merges file (GPT2BPETokenizer).")
    p.add_argument("--tokenizer-model", help="SentencePiece/tiktoken model or HF folder.")
    p.add_argument("--vocab-size", type=int, help="Vocab size for NullTokenizer/TikTokenizer.")
    p.add_argument("--vocab-extra-ids", type=int, default=0, help="T5 sentinel tokens.")
    p.add_argument("--mask-prob", type=float, default=0.15, help="BERT/T5: share of masked words.")
    p.add_argument(
        "--short-seq-prob", type=float, default=0.1, help="BERT/T5: share of short samples."
    )
    p.add_argument(
        "--tiktoken-pattern",
        choices=["v1", "v2"],
        help="TikTokenizer's pre-tokenisation regex (default v2); ignored by other tokenizers.",
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=0,
        help="Data-loader worker processes per rank (0: samples are read in the training "
        "process; Megatron's default is 2).",
    )
    p.add_argument(
        "--no-mmap-bin-files",
        dest="mmap_bin_files",
        action="store_false",
        help="Read the .bin files with file reads instead of memory-mapping them (gpt).",
    )


def finalize_data(args: Args) -> None:
    """Mock data brings its own tokenizer; real data gets Megatron's default split."""
    d = args.data
    if d.tokenizer_type is None and d.mock_data:
        d.tokenizer_type = "NullTokenizer"
        if d.vocab_size is None:
            d.vocab_size = 50257
    if d.split is None and not d.mock_data:
        d.split = "969, 30, 1"


def check_data(args: Args) -> None:
    """One data source, a tokenizer, and files that exist (before any index is built)."""
    d = args.data
    if d.num_workers < 0:
        fail(f"--num-workers must be >= 0, got {d.num_workers}")
    if not d.mmap_bin_files and args.family in ("bert", "t5"):
        fail(f"--no-mmap-bin-files is supported for gpt and mamba, not {args.family}")
    if d.mock_data and (d.data_path or d.data_args_path):
        fail("--mock-data and --data-path/--data-args-path are exclusive")
    if not d.mock_data and not d.data_path and not d.data_args_path:
        fail("no data: give --data-path, --data-args-path (a blend file) or --mock-data")
    if d.data_path and d.data_args_path:
        fail("give --data-path or --data-args-path, not both")
    if d.data_args_path and os.path.isdir(d.data_args_path):
        fail(
            f"--data-args-path {d.data_args_path} is a folder; pass the blend file in it "
            f"(mg-prep refresh writes {os.path.join(d.data_args_path, 'blend.txt')})"
        )
    if d.data_args_path and not os.path.isfile(d.data_args_path):
        fail(f"--data-args-path {d.data_args_path}: file not found")
    if d.tokenizer_type is None:
        fail("--tokenizer-type is required (e.g. GPT2BPETokenizer), unless --mock-data")
    for flag, path in (
        ("--vocab-file", d.vocab_file),
        ("--merge-file", d.merge_file),
        ("--tokenizer-model", d.tokenizer_model),
    ):
        if path is not None and not os.path.exists(path):
            fail(f"{flag} {path}: file not found")
    if args.family == "vlm" and (d.data_path or d.data_args_path):
        # image-text shards (mg-prep vlm: WebDataset tars, energon's .nv-meta), not prefixes
        folder = d.data_path[0] if d.data_path and len(d.data_path) == 1 else None
        if folder is None or not os.path.isfile(os.path.join(folder, ".nv-meta", "split.yaml")):
            fail(
                f"--data-path {' '.join(d.data_path or [d.data_args_path])}: mg-train vlm reads "
                "one folder made by mg-prep vlm (with .nv-meta/split.yaml)"
            )
        return
    if d.data_path or d.data_args_path:
        # lazy: --help stays instant (mg.indexed_dataset imports numpy)
        from mg.indexed_dataset import parse_data_path, read_blend_file

        try:
            blend = (
                read_blend_file(d.data_args_path)
                if d.data_args_path
                else (parse_data_path(d.data_path))
            )
        except ValueError as error:
            fail(str(error))
        source = "--data-args-path" if d.data_args_path else "--data-path"
        for prefix in blend.prefixes:
            if source == "--data-path":
                _not_a_blend(prefix)
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    fail(
                        f"{source}: {prefix}{ext} not found (a prefix is the path without "
                        ".bin/.idx, as mg-prep writes it)"
                    )
        # gpt and mamba datasets split sequences by --split; a dry run builds none
        if args.family in ("gpt", "mamba") and not args.training.dry_run:
            check_splits(blend.prefixes, d.split or "969, 30, 1", source, mmap=d.mmap_bin_files)


def _not_a_blend(prefix: str) -> None:
    """A blend file or an mg-prep refresh folder given to --data-path, said so."""
    refresh_blend = os.path.join(prefix, "blend.txt")
    if os.path.isdir(prefix) and os.path.isfile(refresh_blend):
        fail(
            f"--data-path {prefix} is an mg-prep refresh folder, not a dataset prefix: pass "
            f"its blend file, --data-args-path {refresh_blend}"
        )
    if os.path.isfile(prefix) and not prefix.endswith((".bin", ".idx")):
        fail(
            f"--data-path {prefix} is a file, not a dataset prefix: a blend file ('weight "
            f"prefix' per line, as mg-prep refresh writes) goes to --data-args-path {prefix}"
        )


_SPLIT_NAMES = ("train", "validation", "test")


def check_splits(prefixes: tuple[str, ...], split: str, source: str, *, mmap: bool = True) -> None:
    """Every split --split gives a share must hold tokens in every dataset of the blend.

    Megatron splits each dataset's sequences by the split's fractions, rounded; a small
    dataset (one refresh shard) can get none for a small share and fails only once the
    datasets are built, after the checkpoint has loaded. Reading the .idx files here
    costs a moment and names the dataset, the split and the fix."""
    # lazy: --help stays instant (mg.indexed_dataset imports numpy)
    from mg.indexed_dataset import IndexedDataset, IndexedDatasetError, parse_split
    from mg.indexed_dataset.split import split_matrix, split_range

    try:
        bookends = split_matrix(parse_split(split))
    except ValueError as error:
        fail(f"--split: {error}")
    for prefix in prefixes:
        try:
            with IndexedDataset(prefix, mmap=mmap) as dataset:
                lengths = dataset.sequence_lengths
                total = int(lengths.sum(dtype="int64"))
                shares = [
                    None if ends is None else _share(lengths, split_range(ends, len(lengths)))
                    for ends in bookends
                ]
                sequences = len(lengths)
        except IndexedDatasetError as error:
            fail(f"{source}: {error}")
        if not total:
            fail(
                f"{source} {prefix}: the dataset has {sequences} documents and no tokens: "
                "nothing to train on; tokenize a corpus with text into it (mg-prep)"
            )
        for index, share in enumerate(shares):
            if share is not None and not share[1]:
                fail(_empty_split_message(prefix, sequences, split, index, share[0], source))


def _share(lengths: np.ndarray, ids: np.ndarray) -> tuple[int, int]:
    """(sequences, tokens) of one split: a contiguous range of sequence ids."""
    if not len(ids):
        return 0, 0
    return len(ids), int(lengths[ids[0] : ids[-1] + 1].sum(dtype="int64"))


def _empty_split_message(
    prefix: str, sequences: int, split: str, index: int, count: int, source: str
) -> str:
    name = _SPLIT_NAMES[index]
    what = f"none of its {sequences} sequences" if count == 0 else f"{count} sequences, no tokens"
    fields = [f.strip() for f in split.replace("/", ",").split(",")]
    fields += ["0"] * (3 - len(fields))
    fields[index] = "0"
    if index == 0 or not any(float(f or 0) > 0 for f in fields):
        fix = "give the train split a larger share of --split, or train on larger datasets"
    else:
        fix = (
            f"give {name} no share (--split {','.join(fields)}), a larger share, or train on "
            "larger datasets"
        )
    return (
        f"{source} {prefix}: --split {split} gives its {name} split {what}; every split with "
        f"a share needs tokens in every dataset of the blend: {fix}"
    )
