"""Megatron's tokenizer flags for `mg-prep tokenize` and `mg-prep inspect`, and building one.

The flag names are Megatron's (`_add_tokenizer_args`), so a preprocess_data.py
command line works unchanged; they fill one `TokenizerConfig` that the worker
processes rebuild the tokenizer from.

Every flag of Megatron core_v0.16.1's `_add_tokenizer_args` is recognised. The
tokenizers are Megatron's classic (`--legacy-tokenizer`) ones; the flags that
only steer its newer `MegatronTokenizer` system, and the tokenizer types that
are not for text corpora, are refused by name (`refuse_unsupported`).
"""

from __future__ import annotations

import argparse
import os

from mg.core import tokenizers as core_tokenizers
from mg.corpus_prep.commands import UserError

# Megatron's tokenizer types that mg-prep recognises and refuses, with the reason.
REFUSED_TOKENIZER_TYPES = {
    "MultimodalTokenizer": "it tokenizes image-text conversations (pretrain_vlm.py), not "
    "loose JSON text",
    "NullMultimodalTokenizer": "it is the multimodal NullTokenizer (pretrain_vlm.py); use "
    "NullTokenizer",
    "SFTTokenizer": "it applies a chat template to conversations for fine-tuning, not to "
    "pretraining text",
}

# Flags of Megatron's newer MegatronTokenizer system (used there without
# --legacy-tokenizer) that would change the token ids; the reason mg-prep refuses each.
REFUSED_TOKENIZER_FLAGS = {
    "tokenizer_metadata": (
        "--tokenizer-metadata",
        "a MegatronTokenizer metadata file is not read; give --tokenizer-type and its files",
    ),
    "tokenizer_sentencepiece_legacy": (
        "--tokenizer-sentencepiece-legacy",
        "the classic SentencePiece tokenizers are used, which have no legacy switch",
    ),
    "tokenizer_hf_include_special_tokens": (
        "--tokenizer-hf-include-special-tokens",
        "HuggingFaceTokenizer documents are tokenized without special tokens, as Megatron's "
        "classic tokenizer does",
    ),
    "trust_remote_code": (
        "--trust-remote-code",
        "mg-prep does not run code from a tokenizer folder; use a tokenizer.json folder",
    ),
}


def add_tokenizer_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """Add --tokenizer-type, --vocab-file, --merge-file, ... (Megatron's names and meanings)."""
    group = parser.add_argument_group("tokenizer (Megatron's flags)")
    group.add_argument(
        "--tokenizer-type",
        required=required,
        choices=(*core_tokenizers.TOKENIZER_TYPES, *REFUSED_TOKENIZER_TYPES),
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
    group.add_argument(
        "--padded-vocab-size",
        type=int,
        help="accepted for Megatron compatibility: the model's padded vocabulary does not "
        "change the tokens (the dtype follows the tokenizer's vocabulary)",
    )
    group.add_argument(
        "--tokenizer-hf-use-fast",
        action="store_true",
        help="accepted for Megatron compatibility: HuggingFaceTokenizer is always the fast "
        "(tokenizers) implementation",
    )
    for dest, (flag, reason) in REFUSED_TOKENIZER_FLAGS.items():
        if dest == "tokenizer_metadata":  # the one that takes a value
            group.add_argument(flag, dest=dest, metavar="PATH", help=f"refused: {reason}")
        else:
            group.add_argument(flag, dest=dest, action="store_true", help=f"refused: {reason}")


def config_from_args(args: argparse.Namespace) -> core_tokenizers.TokenizerConfig:
    """The `TokenizerConfig` for the parsed flags, checking that named files exist."""
    refuse_unsupported(args)
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


def refuse_unsupported(args: argparse.Namespace) -> None:
    """A `UserError` naming the first refused tokenizer type or flag that was given."""
    kind = getattr(args, "tokenizer_type", None)
    if kind in REFUSED_TOKENIZER_TYPES:
        raise UserError(
            f"--tokenizer-type {kind}: not supported by mg-prep: {REFUSED_TOKENIZER_TYPES[kind]}"
        )
    for dest, (flag, reason) in REFUSED_TOKENIZER_FLAGS.items():
        if getattr(args, dest, None):
            raise UserError(f"{flag}: not supported by mg-prep: {reason}")


def build_tokenizer_from_config(
    config: core_tokenizers.TokenizerConfig,
) -> core_tokenizers.Tokenizer:
    """Build the tokenizer; a bad or mismatched vocabulary file becomes a `UserError`."""
    try:
        return core_tokenizers.build_tokenizer(config)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        kind = getattr(config, "tokenizer_type", "?")
        raise UserError(f"cannot build the {kind} tokenizer: {err}") from err
