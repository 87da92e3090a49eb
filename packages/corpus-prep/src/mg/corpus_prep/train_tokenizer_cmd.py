"""`mg-prep train-tokenizer`: train a BPE, WordPiece or SentencePiece tokenizer on a corpus.

The run; the flags and the command's description are in `train_tokenizer_flags`, which
`mg-prep train-tokenizer --help` reads without importing this module's dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Iterator
from dataclasses import asdict

from mg.corpus_prep.commands import UserError, refuse_own_input
from mg.corpus_prep.corpus_texts import BadLine, SkipReporter, iter_documents
from mg.corpus_prep.reader import InputError
from mg.corpus_prep.refresh_files import write_atomic
from mg.corpus_prep.tokenizer_training import (
    TrainingError,
    TrainOptions,
    megatron_tokenizer_type,
    train_tokenizer,
)

RECORD_NAME = "train_tokenizer.json"


def options_from_args(args: argparse.Namespace) -> TrainOptions:
    return TrainOptions(
        kind=args.kind,
        vocab_size=args.vocab_size,
        min_frequency=args.min_frequency,
        cased=args.cased,
        spm_model_type=args.spm_model_type,
        character_coverage=args.character_coverage,
        byte_fallback=args.byte_fallback,
    )


class CountingTexts:
    """The corpus texts, counted on the way to the trainer."""

    def __init__(self, args: argparse.Namespace, skips: SkipReporter) -> None:
        self.args, self.skips = args, skips
        self.documents = self.characters = 0

    def __iter__(self) -> Iterator[str]:
        for document in iter_documents(
            self.args.input, self.args.json_keys, self.args.on_error, self.skips
        ):
            self.documents += 1
            for text in document.texts:
                self.characters += len(text)
                yield text


def run(args: argparse.Namespace) -> int:
    refuse_own_input(
        [("--output-dir", args.output_dir)], [("--input", i) for i in args.input], files_into=True
    )
    if args.vocab_size < 1:
        raise UserError(f"--vocab-size must be positive, got {args.vocab_size}")
    options = options_from_args(args)
    skips = SkipReporter()
    texts = CountingTexts(args, skips)
    started = time.monotonic()
    try:
        files = train_tokenizer(texts, args.output_dir, options)
    except (BadLine, InputError) as err:
        raise UserError(str(err)) from err
    except TrainingError as err:
        raise UserError(f"{err}") from err
    if texts.documents == 0:
        raise UserError("the input holds no documents to train on")
    flags = {"--tokenizer-type": megatron_tokenizer_type(options), **files}
    record = {
        "type": args.kind,
        "vocab_size": args.vocab_size,
        "options": asdict(options),
        "inputs": list(args.input),
        "json_keys": list(args.json_keys),
        "documents": texts.documents,
        "characters": texts.characters,
        "lines_skipped": skips.count,
        "seconds": round(time.monotonic() - started, 3),
        "flags": flags,
    }
    write_atomic(
        os.path.join(args.output_dir, RECORD_NAME), (json.dumps(record, indent=2) + "\n").encode()
    )
    print(f"trained on {texts.documents} documents ({texts.characters} characters)")
    print("use it with: " + " ".join(f"{flag} {value}" for flag, value in flags.items()))
    return 0
