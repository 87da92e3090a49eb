"""`mg-prep dedup`: drop the exact and near duplicates of a loose-JSON corpus, nothing else.

    mg-prep dedup --input raw/*.jsonl.gz --output unique.jsonl.zst --dedup near \\
        --minhash-threshold 0.8 --engine ray --ray-address auto

`mg-prep clean`'s de-duplication with its rewriting rules and length filters
off: the texts are written back as they are (empty documents are dropped). The
first copy of each document is kept, in input order; exact duplicates are
judged on the case-folded, whitespace-collapsed text, near duplicates by
MinHash LSH on character shingles (see `mg.corpus_prep.dedup`). With
`--engine ray` the same documents are kept, found by Ray Data.
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.clean_flags import add_input_output_arguments
from mg.corpus_prep.commands import run_later


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "dedup",
        help="drop exact and near-duplicate documents of a JSONL corpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_input_output_arguments(parser, "fields compared (together) for duplicates")
    group = parser.add_argument_group("de-duplication")
    group.add_argument(
        "--dedup",
        choices=["exact", "near"],
        default="near",
        help="exact duplicates only, or exact and near duplicates (default)",
    )
    group.add_argument(
        "--minhash-threshold",
        type=float,
        default=0.8,
        help="near duplicate when the estimated Jaccard similarity is at least this (0.8)",
    )
    group.add_argument("--num-perm", type=int, default=128, help="MinHash permutations (128)")
    group.add_argument("--shingle-size", type=int, default=5, help="characters per shingle (5)")
    # clean's rewriting rules and length filters, all off
    parser.set_defaults(
        clean=False,
        no_repair=True,
        normalization="none",
        no_punctuation=True,
        no_whitespace=True,
        min_chars=0,
        max_chars=None,
        min_words=0,
        max_words=None,
        func=run_later("clean_cmd"),
    )
