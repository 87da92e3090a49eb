"""`mg-prep inspect`: what is in an indexed dataset, checked, with decoded samples.

    mg-prep inspect data/corpus_text_document --tokenizer-type GPT2BPETokenizer \\
        --vocab-file vocab.json --merge-file merges.txt --samples 3

prints the counts (documents, sequences, tokens), dtype and file sizes, the
length distribution of documents and sequences (percentiles and a histogram
in powers of two), and, given a tokenizer, a few documents decoded. Opening
the dataset validates it in full; a broken file is reported by name, with
what is wrong, instead of a traceback.
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.commands import run_later
from mg.corpus_prep.tokenizer_args import add_tokenizer_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="summarise and validate an indexed dataset, decode samples",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prefix", help="dataset prefix (or its .bin/.idx path)")
    parser.add_argument(
        "--samples",
        type=int,
        default=3,
        help="documents to show, evenly spaced (default 3; decoded with a tokenizer, else as ids)",
    )
    parser.add_argument(
        "--max-chars", type=int, default=300, help="characters shown per sample (default 300)"
    )
    parser.add_argument("--multimodal", action="store_true", help="the dataset has modes")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_tokenizer_args(parser, required=False)
    parser.set_defaults(func=run_later("inspect_cmd"))
