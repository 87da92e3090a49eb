"""`mg-prep clean`: repair, normalise, filter and de-duplicate a loose-JSON corpus.

The run; the flags and the command's description are in `clean_flags`, which
`mg-prep clean --help` reads without importing this module's dependencies.
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
from mg.corpus_prep.commands import UserError, refuse_own_input
from mg.corpus_prep.corpus_texts import BadLine, SkipReporter, iter_documents
from mg.corpus_prep.engine_flags import check_ray_arguments
from mg.corpus_prep.jsonl_writer import AtomicJsonlWriter
from mg.corpus_prep.progress import Progress
from mg.corpus_prep.ray_clean import ShardFailedError, clean_on_ray
from mg.corpus_prep.ray_cluster import RayConnectError
from mg.corpus_prep.reader import InputError, find_sources, split_segments
from mg.corpus_prep.refresh_files import write_atomic
from mg.corpus_prep.tokenize_flags import default_workers

INVALID_LINE = "invalid_line"


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


def clean_corpus(args: argparse.Namespace, options: CleanOptions) -> dict[str, Any]:
    """Stream the inputs through a `Cleaner` into the output; return the summary."""
    if getattr(args, "engine", "local") == "ray":
        return clean_corpus_on_ray(args, options)
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


def clean_corpus_on_ray(args: argparse.Namespace, options: CleanOptions) -> dict[str, Any]:
    """`clean_corpus` on Ray (`mg.corpus_prep.ray_clean`): the same output and summary."""
    started = time.monotonic()
    sources = find_sources(args.input)
    shards = args.partitions or 4 * default_workers()
    total = sum(s.size for s in sources) if all(s.compression == "none" for s in sources) else None
    command = "dedup" if getattr(args, "command", "clean") == "dedup" else "clean"
    progress = Progress(total, 0, None, plain_every=0.0, label=command, counts_tokens=False)

    with AtomicJsonlWriter(args.output) as out:
        result = clean_on_ray(
            split_segments(sources, shards),
            tuple(args.json_keys),
            options,
            args.on_error,
            args.output,
            out.write,
            progress.update,
            args.ray_address,
            args.ray_connect_timeout,
        )
    progress.close()
    skips = SkipReporter()
    for message in result.skip_messages[: skips.limit]:
        skips(BadLine(message))
    dropped: Counter[str] = Counter({reason: 0 for reason in REASONS})
    dropped.update(result.dropped)
    dropped[INVALID_LINE] = result.skipped
    changed: Counter[str] = Counter({rule: 0 for rule in RULES})
    changed.update(result.changed)
    return {
        "inputs": list(args.input),
        "output": args.output,
        "json_keys": list(args.json_keys),
        "documents_read": result.read,
        "documents_kept": result.kept,
        "documents_dropped": result.read - result.kept,
        "lines_skipped": result.skipped,
        "dropped": dict(dropped),
        "changed_by_rule": dict(changed),
        "characters_read": result.characters_read,
        "characters_kept": result.characters_kept,
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
    check_ray_arguments(args)
    if args.partitions is not None and args.partitions < 1:
        raise UserError(f"--partitions {args.partitions}: must be 1 or more")
    if os.path.dirname(os.path.abspath(args.output)):
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    try:
        summary = clean_corpus(args, options)
    except (BadLine, InputError) as err:
        hint = " (or rerun with --on-error skip)" if isinstance(err, BadLine) else ""
        raise UserError(f"{err}{hint}; nothing was written") from err
    except (RayConnectError, ShardFailedError) as err:
        raise UserError(f"{err}; nothing was written") from err
    print(format_summary(summary))
    if args.summary_json:
        write_atomic(args.summary_json, (json.dumps(summary, indent=2) + "\n").encode())
    return 0
