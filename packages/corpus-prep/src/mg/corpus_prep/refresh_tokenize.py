"""How `mg-prep refresh` uses `mg-prep tokenize`: its flags, its run, its fingerprint.

Refresh takes every tokenize flag except ``--input`` and ``--output-prefix``
(those are per input file) and runs tokenize's own `run` once per file, in
process, so a shard is byte for byte what ``mg-prep tokenize --input FILE``
writes.

The fingerprint says which tokens the flags produce: it covers every flag
that changes the output and, for flags naming files (vocab.json, merges.txt,
a SentencePiece model, a Hugging Face folder), the sha256 of their content,
so replacing a vocabulary file in place also counts as a new tokenizer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
from typing import Any

from mg.corpus_prep import tokenize_flags
from mg.corpus_prep.refresh_plan import sha256_of_file

# Per-file flags that refresh sets itself.
# Flags that change how fast tokens are made, not which. (--on-error too: a file that
# went through with "fail" has no bad lines, so "skip" would give the same tokens.)
NOT_IN_FINGERPRINT = {
    "on_error",
    "workers",
    "partitions",
    "log_interval",
    "progress_bar",
    "keep_sequential_samples",
    "legacy_tokenizer",
    "ray_connect_timeout",
}


def add_tokenize_arguments(parser: argparse.ArgumentParser) -> list[str]:
    """Give `parser` tokenize's flags (minus the per-file ones); return their dests."""
    before = {action.dest for action in parser._actions}
    tokenize_flags.add_tokenize_arguments(parser, input_output=False)
    return [action.dest for action in parser._actions if action.dest not in before]


def tokenize_file(args: argparse.Namespace, path: str, output_prefix: str) -> None:
    """`mg-prep tokenize --input path --output-prefix output_prefix <the other flags>`."""
    per_file = argparse.Namespace(**vars(args))
    per_file.input = [path]
    per_file.output_prefix = output_prefix
    from mg.corpus_prep import tokenize_cmd  # lazy: `mg-prep refresh --help` stays instant

    status = tokenize_cmd.run(per_file)
    if status:
        raise RuntimeError(f"mg-prep tokenize exited with status {status} on {path}")


def dataset_names(args: argparse.Namespace) -> list[str]:
    """The `{key}_{level}` suffixes tokenize writes for these flags."""
    level = "sentence" if args.split_sentences else "document"
    return [f"{key}_{level}" for key in args.json_keys]


def _content_hash(path: str) -> str:
    if os.path.isdir(path):
        digest = hashlib.sha256()
        for folder, subfolders, names in os.walk(path):
            subfolders.sort()
            for name in sorted(names):
                full = os.path.join(folder, name)
                digest.update(os.path.relpath(full, path).encode() + b"\0")
                digest.update(sha256_of_file(full).encode())
        return digest.hexdigest()
    return sha256_of_file(path)


def output_options(args: argparse.Namespace, dests: list[str]) -> dict[str, Any]:
    """The flags that decide the tokens, files replaced by ``{"path", "sha256"}``."""
    options: dict[str, Any] = {}
    for dest in sorted(dests):
        if dest in NOT_IN_FINGERPRINT:
            continue
        value = getattr(args, dest, None)
        if isinstance(value, str) and dest != "tokenizer_type" and os.path.exists(value):
            value = {"path": os.path.abspath(value), "sha256": _content_hash(value)}
        options[dest] = value
    return options


def fingerprint(options: dict[str, Any]) -> str:
    """sha256 of the options, minus file paths (moving a vocab file is not a new tokenizer)."""

    def without_paths(value: Any) -> Any:
        if isinstance(value, dict) and set(value) == {"path", "sha256"}:
            return value["sha256"]
        return value

    canonical = {key: without_paths(value) for key, value in options.items()}
    return hashlib.sha256(json.dumps(canonical, sort_keys=True).encode()).hexdigest()
