"""Megatron's tokenizer flags for `mg-prep tokenize` and `mg-prep inspect`, and building one.

The flag names are Megatron's (`_add_tokenizer_args`), so a preprocess_data.py
command line works unchanged; they fill one `TokenizerConfig` that the worker
processes rebuild the tokenizer from.
"""

from __future__ import annotations

import argparse
import os

from mg.core import tokenizers as core_tokenizers
from mg.corpus_prep.cli import UserError


def add_tokenizer_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Add --tokenizer-type, --vocab-file, --merge-file, ... (Megatron's names and meanings)."""
    group = parser.add_argument_group("tokenizer (Megatron's flags)")
    group.add_argument(
        "--tokenizer-type",
        required=required,
        choices=core_tokenizers.TOKENIZER_TYPES,
        metavar="TYPE",
        help=f"one of: {', '.join(core_tokenizers.TOKENIZER_TYPES)}",
    )
    group.add_argument("--vocab-file", help="vocabulary: GPT-2 vocab.json or BERT vocab.txt")
    group.add_argument("--merge-file", help="GPT-2 BPE merges.txt")
    group.add_argument(
        "--tokenizer-model",
        help="SentencePiece .model, tiktoken file, or Hugging Face tokenizer folder",
    )
    group.add_argument("--vocab-size", type=int, help="vocabulary size (NullTokenizer)")
    group.add_argument(
        "--vocab-extra-ids", type=int, default=0, help="number of T5 <extra_id_N> sentinels"
    )
    group.add_argument("--tiktoken-pattern", choices=("v1", "v2"), help="TikTokenizer pattern")
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids reserved for special tokens",
    )
    group.add_argument(
        "--tokenizer-special-tokens",
        "--tiktoken-special-tokens",
        nargs="+",
        dest="tokenizer_special_tokens",
        help="TikTokenizer special tokens",
    )
    group.add_argument(
        "--legacy-tokenizer",
        action="store_true",
        help="accepted for Megatron compatibility: the classic tokenizers are always used",
    )


def config_from_args(args: argparse.Namespace) -> core_tokenizers.TokenizerConfig:
    """The `TokenizerConfig` for the parsed flags, checking that named files exist."""
    for flag in ("vocab_file", "merge_file", "tokenizer_model"):
        path = getattr(args, flag, None)
        if path is not None and not os.path.exists(path):
            option = "--" + flag.replace("_", "-")
            raise UserError(f"{option} {path}: no such file")
    return core_tokenizers.TokenizerConfig(
        tokenizer_type=args.tokenizer_type,
        vocab_file=args.vocab_file,
        merge_file=args.merge_file,
        tokenizer_model=args.tokenizer_model,
        vocab_size=args.vocab_size,
        vocab_extra_ids=args.vocab_extra_ids,
        tiktoken_pattern=args.tiktoken_pattern,
        tiktoken_num_special_tokens=args.tiktoken_num_special_tokens,
        tokenizer_special_tokens=args.tokenizer_special_tokens,
    )


def build_tokenizer_from_config(
    config: core_tokenizers.TokenizerConfig,
) -> core_tokenizers.Tokenizer:
    """Build the tokenizer; a bad or mismatched vocabulary file becomes a `UserError`."""
    try:
        return core_tokenizers.build_tokenizer(config)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        kind = getattr(config, "tokenizer_type", "?")
        raise UserError(f"cannot build the {kind} tokenizer: {err}") from err
