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
import json
import os
import sys
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

from mg.corpus_prep.cleaning import REASONS, RULES, Cleaner, CleanOptions
from mg.corpus_prep.cli import UserError, refuse_own_input
from mg.corpus_prep.corpus_texts import BadLine, SkipReporter, iter_documents
from mg.corpus_prep.jsonl_writer import AtomicJsonlWriter
from mg.corpus_prep.reader import InputError
from mg.corpus_prep.refresh_files import write_atomic

INVALID_LINE = "invalid_line"


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


def cleaning_options(args: argparse.Namespace) -> CleanOptions | None:
    """The `CleanOptions` the flags ask for; None when they ask for nothing at all."""
    rules_on = getattr(args, "clean", True)
    try:
        options = CleanOptions(
            repair=rules_on and not args.no_repair,
            normalization=args.normalization if rules_on else "none",
            punctuation=rules_on and not args.no_punctuation,
            whitespace=rules_on and not args.no_whitespace,
            min_chars=args.min_chars,
            max_chars=args.max_chars,
            min_words=args.min_words,
            max_words=args.max_words,
            dedup=args.dedup,
            minhash_threshold=args.minhash_threshold,
            num_perm=args.num_perm,
            shingle_size=args.shingle_size,
        )
    except ValueError as err:
        raise UserError(str(err)) from err
    return None if options == _NOTHING else options


_NOTHING = CleanOptions(repair=False, normalization="none", punctuation=False, whitespace=False)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "clean",
        help="repair, normalise, filter and de-duplicate a JSONL corpus",
        description=__doc__.split("\n\n")[0],
    )
    parser.add_argument(
        "--input", nargs="+", required=True, help="JSONL files (.gz/.zst too), globs or folders"
    )
    parser.add_argument("--output", required=True, help="output JSONL; .gz or .zst compresses it")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="fields to clean")
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
    add_cleaning_arguments(parser)
    parser.set_defaults(func=run)


def clean_corpus(args: argparse.Namespace, options: CleanOptions) -> dict[str, Any]:
    """Stream the inputs through a `Cleaner` into the output; return the summary."""
    cleaner = Cleaner(options)
    dropped: Counter[str] = Counter({reason: 0 for reason in REASONS})
    changed: Counter[str] = Counter({rule: 0 for rule in RULES})
    skips = SkipReporter()
    read = chars_in = chars_out = 0
    started = time.monotonic()
    with AtomicJsonlWriter(args.output) as out:
        for document in iter_documents(args.input, args.json_keys, args.on_error, skips):
            read += 1
            chars_in += sum(map(len, document.texts))
            result = cleaner.clean_fields(document.texts)
            changed.update(result.changed_by)
            if result.texts is None:
                dropped[result.reason or "unknown"] += 1
            else:
                record = dict(document.record)
                record.update(zip(args.json_keys, result.texts, strict=True))
                out.write(record)
                chars_out += sum(map(len, result.texts))
            if args.log_interval and read % args.log_interval == 0:
                rate = read / max(time.monotonic() - started, 1e-9)
                print(f"{read} documents, {out.lines} kept ({rate:.0f} docs/s)", file=sys.stderr)
        kept = out.lines
    dropped[INVALID_LINE] = skips.count
    return {
        "inputs": list(args.input),
        "output": args.output,
        "json_keys": list(args.json_keys),
        "documents_read": read,
        "documents_kept": kept,
        "documents_dropped": read - kept,
        "lines_skipped": skips.count,
        "dropped": dict(dropped),
        "changed_by_rule": dict(changed),
        "characters_read": chars_in,
        "characters_kept": chars_out,
        "seconds": round(time.monotonic() - started, 3),
        "options": asdict(options),
    }


def format_summary(summary: dict[str, Any]) -> str:
    lines = [
        f"read {summary['documents_read']} documents, kept {summary['documents_kept']}, "
        f"dropped {summary['documents_dropped']}"
        + (f"; skipped {summary['lines_skipped']} bad lines" if summary["lines_skipped"] else "")
    ]
    for reason, count in summary["dropped"].items():
        if count and reason != INVALID_LINE:
            lines.append(f"  dropped {count:>10}  {reason}")
    for rule, count in summary["changed_by_rule"].items():
        lines.append(f"  changed {count:>10}  by {rule}")
    lines.append(f"wrote {summary['output']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    refuse_own_input(
        [("--output", args.output), ("--summary-json", args.summary_json)],
        [("--input", item) for item in args.input],
    )
    options = cleaning_options(args) or _NOTHING
    if os.path.dirname(os.path.abspath(args.output)):
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    try:
        summary = clean_corpus(args, options)
    except (BadLine, InputError) as err:
        hint = " (or rerun with --on-error skip)" if isinstance(err, BadLine) else ""
        raise UserError(f"{err}{hint}; nothing was written") from err
    print(format_summary(summary))
    if args.summary_json:
        write_atomic(args.summary_json, (json.dumps(summary, indent=2) + "\n").encode())
    return 0
