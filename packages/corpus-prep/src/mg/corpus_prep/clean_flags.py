"""`mg-prep clean`: repair, normalise, filter and de-duplicate a loose-JSON corpus.

    mg-prep clean --input raw/*.jsonl.gz --output clean.jsonl.zst --json-keys text \\
        --min-words 50 --dedup near --minhash-threshold 0.8 --summary-json clean.json

One streaming pass in input order; the output keeps every other field of the
kept records. The rules are described in `mg.corpus_prep.cleaning`. Memory is
bounded by the de-duplication state (16 bytes per kept document for exact,
about 1.5 KB for near; see `mg.corpus_prep.dedup`), not by the corpus.

The cleaning flags are also offered to other subcommands through
`add_cleaning_arguments` / `cleaning_options`.
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.commands import run_later
from mg.corpus_prep.engine_flags import add_ray_arguments


def add_cleaning_arguments(
    parser: argparse.ArgumentParser, enabled_by_default: bool = True
) -> None:
    """The cleaning flags. With ``enabled_by_default=False`` (for `tokenize`), a ``--clean``
    switch turns the rewriting rules on and de-duplication defaults to none."""
    group = parser.add_argument_group("cleaning")
    if not enabled_by_default:
        group.add_argument(
            "--clean",
            action="store_true",
            help="repair and normalise text (ftfy, unicode, punctuation, whitespace) first",
        )
    group.add_argument(
        "--normalization",
        choices=["NFC", "NFKC", "none"],
        default="NFC",
        help="unicode normal form (default NFC; NFKC also folds width, ligatures, '…')",
    )
    group.add_argument("--no-repair", action="store_true", help="skip ftfy's mojibake repair")
    group.add_argument(
        "--no-punctuation",
        action="store_true",
        help="keep curly quotes, dashes and ellipses as they are",
    )
    group.add_argument("--no-whitespace", action="store_true", help="keep whitespace as it is")
    group.add_argument("--min-chars", type=int, default=0, help="drop shorter documents")
    group.add_argument("--max-chars", type=int, default=None, help="drop longer documents")
    group.add_argument("--min-words", type=int, default=0, help="drop documents with fewer words")
    group.add_argument("--max-words", type=int, default=None, help="drop documents with more words")
    group.add_argument(
        "--dedup",
        choices=["none", "exact", "near"],
        default="exact" if enabled_by_default else "none",
        help="drop exact duplicates (case/whitespace-insensitive content hash), or exact and "
        "near duplicates (MinHash LSH on character 5-grams)",
    )
    group.add_argument(
        "--minhash-threshold",
        type=float,
        default=0.8,
        help="near duplicate when the estimated Jaccard similarity is at least this (0.8)",
    )
    group.add_argument("--num-perm", type=int, default=128, help="MinHash permutations (128)")
    group.add_argument("--shingle-size", type=int, default=5, help="characters per shingle (5)")


def add_input_output_arguments(parser: argparse.ArgumentParser, keys_help: str) -> None:
    """--input, --output, --json-keys, --on-error, --summary-json, --log-interval and the
    engine flags: what `clean` and `dedup` share."""
    parser.add_argument(
        "--input", nargs="+", required=True, help="JSONL files (.gz/.zst too), globs or folders"
    )
    parser.add_argument("--output", required=True, help="output JSONL; .gz or .zst compresses it")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help=keys_help)
    parser.add_argument(
        "--on-error",
        choices=["fail", "skip"],
        default="fail",
        help="on a line that is not a JSON object with the keys: stop (default) or skip it",
    )
    parser.add_argument("--summary-json", help="also write the summary to this JSON file")
    parser.add_argument(
        "--log-interval", type=int, default=100_000, help="print progress every N documents"
    )
    group = parser.add_argument_group("engine")
    add_ray_arguments(
        group,
        "local: one streaming pass on this machine (default); ray: Ray tasks clean shards of "
        "the input and Ray Data finds the duplicates (the ray extra); the output is the same",
    )
    group.add_argument(
        "--partitions",
        type=int,
        default=None,
        metavar="N",
        help="with --engine ray: cut the input into N shards (default: 4 per CPU here)",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "clean",
        help="repair, normalise, filter and de-duplicate a JSONL corpus",
        description=__doc__.split("\n\n")[0],
    )
    add_input_output_arguments(parser, "fields to clean")
    add_cleaning_arguments(parser)
    parser.set_defaults(func=run_later("clean_cmd"))
