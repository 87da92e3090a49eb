"""`mg-prep wikipedia`: run WikiExtractor on a dump into a JSON-lines file, atomically.

The extractor runs as its own command (`python -m wikiextractor.WikiExtractor
--json -o -`), its output streamed into a temporary file beside `--output`,
renamed into place once the extractor has finished without error.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile

from mg.corpus_prep.commands import UserError, refuse_own_input
from mg.corpus_prep.progress import info, warn

EXTRACTOR = "wikiextractor.WikiExtractor"


def extractor_command(args: argparse.Namespace) -> list[str]:
    command = [sys.executable, "-m", EXTRACTOR, args.input, "--json", "-o", "-"]
    command += ["--processes", str(args.processes), "--quiet"]
    return command + (["--no-templates"] if args.no_templates else [])


def _check(args: argparse.Namespace) -> str:
    if importlib.util.find_spec("wikiextractor") is None:
        raise UserError("mg-prep wikipedia needs WikiExtractor: install mg-corpus-prep[wikipedia]")
    if not os.path.isfile(args.input):
        raise UserError(f"--input {args.input}: no such file")
    if args.processes < 1:
        raise UserError(f"--processes {args.processes}: must be 1 or more")
    refuse_own_input([("--output", args.output)], [("--input", args.input)])
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise UserError(f"--output {args.output}: {folder} is not a writable folder")
    return folder


def run(args: argparse.Namespace) -> int:
    folder = _check(args)
    handle, temporary = tempfile.mkstemp(
        prefix=os.path.basename(args.output) + ".", suffix=".tmp", dir=folder
    )
    try:
        with os.fdopen(handle, "wb") as out:
            done = subprocess.run(extractor_command(args), stdout=out, stderr=subprocess.PIPE)
        if done.returncode != 0:
            lines = done.stderr.decode("utf-8", "replace").strip().splitlines()
            last = lines[-1] if lines else f"exit status {done.returncode}"
            raise UserError(f"--input {args.input}: WikiExtractor failed ({last})")
        with open(temporary, "rb") as written:
            articles = sum(1 for _ in written)
        os.replace(temporary, args.output)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    info(f"mg-prep wikipedia: {articles:,} articles from {args.input} into {args.output}")
    if articles == 0:
        warn(f"--input {args.input}: no articles found; is it a pages-articles XML dump?")
    return 0
