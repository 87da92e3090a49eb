"""`mg-prep refresh`: keep an output folder of shards in step with a growing input folder.

    mg-prep refresh --input-dir incoming/ --output-dir data/ \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2 --lock-timeout 60

Made to run from cron (workflows/cron/): each run tokenizes only the new and
changed input files (one `.bin/.idx` shard per file and json key), then
publishes ``data/blend.txt`` (``weight prefix`` lines, weight = tokens, for
``mg-train --data-args-path``) and ``data/manifest.json`` atomically. A second
run while one is going waits `--lock-timeout` seconds, then exits with status
0 saying "another refresh is running". See `mg.corpus_prep.refresh` for what
happens when a run is killed.
"""

from __future__ import annotations

import argparse

from mg.corpus_prep.commands import run_later
from mg.corpus_prep.refresh_plan import DEFAULT_PATTERNS
from mg.corpus_prep.refresh_tokenize import add_tokenize_arguments


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "refresh",
        help="tokenize new/changed files of a folder into shards and publish a blend (cron)",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    group = parser.add_argument_group("refresh")
    group.add_argument("--input-dir", required=True, help="folder of JSONL files; it may grow")
    group.add_argument("--output-dir", required=True, help="shards, blend.txt and manifest.json")
    group.add_argument(
        "--pattern",
        nargs="+",
        default=list(DEFAULT_PATTERNS),
        help="file name globs taken from the input folder, recursively "
        f"(default: {' '.join(DEFAULT_PATTERNS)})",
    )
    group.add_argument(
        "--lock-timeout",
        type=float,
        default=0.0,
        help="seconds to wait for a running refresh before exiting with status 0 (default 0)",
    )
    group.add_argument(
        "--dry-run", action="store_true", help="print what would be done; change nothing"
    )
    group.add_argument(
        "--prune",
        action="store_true",
        help="delete shards no longer in the blend (of removed or changed input files)",
    )
    group.add_argument(
        "--rehash",
        action="store_true",
        help="hash every input file, even those whose size and mtime are unchanged",
    )
    dests = add_tokenize_arguments(parser)
    parser.set_defaults(func=run_later("refresh_cmd"), tokenize_dests=dests)
