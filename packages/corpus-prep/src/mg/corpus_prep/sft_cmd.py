"""`mg-prep sft`'s work: read conversations, encode them, write the two datasets."""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from mg.corpus_prep.chat_format import ChatFormatError, load_encoder, messages_of
from mg.corpus_prep.commands import UserError
from mg.indexed_dataset import IndexedDatasetBuilder, best_dtype

LOSS_MASK_SUFFIX = "_loss_mask"
"""The loss mask of dataset PREFIX is dataset PREFIX + this (what mg-train --sft reads)."""
RECORD_SUFFIX = "_sft.json"
"""PREFIX + this records how the data was rendered (mg-train checks
--sft-tokenizer-prompt-format against it)."""


def run(args: argparse.Namespace) -> int:
    for path in args.input:
        if not os.path.isfile(path):
            raise UserError(f"--input {path}: file not found")
    folder = os.path.dirname(os.path.abspath(args.output_prefix))
    if not os.path.isdir(folder):
        raise UserError(f"--output-prefix {args.output_prefix}: folder {folder} does not exist")
    try:
        encoder = load_encoder(args.tokenizer_model, args.sft_tokenizer_prompt_format)
    except ChatFormatError as exc:
        raise UserError(str(exc)) from None
    prefix = f"{args.output_prefix}_text_document"
    dtype = best_dtype(encoder.tokenizer.get_vocab_size(with_added_tokens=True))
    counts = {"conversations": 0, "tokens": 0, "assistant_tokens": 0, "no_assistant": 0}
    with (
        IndexedDatasetBuilder(f"{prefix}.bin", dtype) as tokens,
        IndexedDatasetBuilder(f"{prefix}{LOSS_MASK_SUFFIX}.bin", np.uint8) as masks,
    ):
        for ids, mask in _encoded(args.input, encoder):
            if not mask.any():
                counts["no_assistant"] += 1  # nothing to learn from it
                continue
            tokens.add_document(ids, [len(ids)])
            masks.add_document(mask, [len(mask)])
            counts["conversations"] += 1
            counts["tokens"] += len(ids)
            counts["assistant_tokens"] += int(mask.sum())
        tokens.finalize(f"{prefix}.idx")
        masks.finalize(f"{prefix}{LOSS_MASK_SUFFIX}.idx")
    record = {"prompt_format": encoder.prompt_format, "tokenizer_model": args.tokenizer_model}
    with open(f"{prefix}{RECORD_SUFFIX}", "w", encoding="utf-8") as stream:
        json.dump({**record, **counts}, stream, indent=2)
    print(
        f"mg-prep sft: {counts['conversations']:,} conversations, {counts['tokens']:,} tokens "
        f"({counts['assistant_tokens']:,} assistant) -> {prefix} and {prefix}{LOSS_MASK_SUFFIX} "
        f"[{encoder.prompt_format}]; {counts['no_assistant']} without an assistant turn skipped"
    )
    return 0


def _encoded(paths: list[str], encoder):
    """(ids, mask) of each conversation, in file and line order; errors name file:line."""
    for path in paths:
        with open(path, encoding="utf-8") as stream:
            for number, line in enumerate(stream, 1):
                if not line.strip():
                    continue
                try:
                    yield encoder.encode(messages_of(json.loads(line)))
                except json.JSONDecodeError as exc:
                    raise UserError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
                except ChatFormatError as exc:
                    raise UserError(f"{path}:{number}: {exc}") from None
