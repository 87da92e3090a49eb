"""Megatron's data and tokenizer flags: where samples come from and which tokenizer made them."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
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
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    fail(
                        f"{source}: {prefix}{ext} not found (a prefix is the path without "
                        ".bin/.idx, as mg-prep writes it)"
                    )
