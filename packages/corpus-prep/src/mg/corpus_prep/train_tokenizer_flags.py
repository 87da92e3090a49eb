"""`mg-prep train-tokenizer`: train a BPE, WordPiece or SentencePiece tokenizer on a corpus.

    mg-prep train-tokenizer --input corpus.jsonl --json-keys text \\
        --type byte-level-bpe --vocab-size 32000 --output-dir tok/

The texts stream from the input files into the trainer. The output folder
gets the tokenizer files and `train_tokenizer.json`, which records how they
were made and the flags that load them (`--tokenizer-type ... --vocab-file ...`).
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.commands import run_later

# tokenizer_training.KINDS (which imports the trainers): the kinds it can train.
KINDS = ("byte-level-bpe", "wordpiece", "sentencepiece")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-tokenizer",
        help="train a tokenizer (byte-level BPE, WordPiece, SentencePiece) on a JSONL corpus",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument("--input", nargs="+", required=True, help="JSONL files, globs or folders")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="fields to train on")
    parser.add_argument("--type", choices=KINDS, required=True, dest="kind")
    parser.add_argument("--vocab-size", type=int, required=True)
    parser.add_argument("--output-dir", required=True)
    parser.add_argument(
        "--min-frequency", type=int, default=2, help="BPE/WordPiece: least count of a merge (2)"
    )
    parser.add_argument(
        "--cased", action="store_true", help="WordPiece: keep case (for BertWordPieceCase)"
    )
    parser.add_argument(
        "--spm-model-type", choices=["bpe", "unigram"], default="bpe", help="SentencePiece model"
    )
    parser.add_argument(
        "--character-coverage",
        type=float,
        default=0.9995,
        help="SentencePiece: share of characters covered (0.9995; 1.0 for small alphabets)",
    )
    parser.add_argument(
        "--byte-fallback",
        action="store_true",
        help="SentencePiece: unknown characters become bytes (as Llama)",
    )
    parser.add_argument("--on-error", choices=["fail", "skip"], default="fail")
    parser.set_defaults(func=run_later("train_tokenizer_cmd"))
