"""`mg-prep`: raw corpora to Megatron indexed datasets.

Each subcommand has a light module exposing ``register(subparsers)``, which
adds its parser and sets ``func`` (called with the parsed namespace, returning
the exit status); ``func`` is usually `run_later`, which imports the module
that does the work (numpy, the tokenizer stack, ftfy) only then, so that every
``--help`` answers at once. Only the chosen subcommand's module is imported.

With no subcommand, ``mg-prep`` is ``mg-prep tokenize``: the argument list of
a ``python tools/preprocess_data.py ...`` line works as ``mg-prep ...``.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from mg.corpus_prep import interrupts
from mg.corpus_prep.commands import UserError

# subcommand -> module under mg.corpus_prep that registers it
SUBCOMMANDS: dict[str, str] = {
    "tokenize": "tokenize_flags",
    "clean": "clean_flags",
    "dedup": "dedup_flags",
    "merge": "merge_cmd",
    "inspect": "inspect_flags",
    "train-tokenizer": "train_tokenizer_flags",
    "refresh": "refresh_flags",
    "sft": "sft_flags",
    "wikipedia": "wikipedia_flags",
    "retro": "retro_flags",
    "vlm": "vlm_flags",
}


# What `mg-prep FLAGS...` (no subcommand) runs: Megatron's preprocess_data.py.
DEFAULT_SUBCOMMAND = "tokenize"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mg-prep",
        description="Turn loose JSON corpora into Megatron .bin/.idx indexed datasets. "
        "With no COMMAND, the flags are those of `mg-prep tokenize` (Megatron's "
        "tools/preprocess_data.py command line, unchanged).",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in SUBCOMMANDS.items():
        if only is not None and name != only:
            subparsers.add_parser(name, help=f"see `mg-prep {name} --help`")
            continue
        module = importlib.import_module(f"mg.corpus_prep.{module_name}")
        module.register(subparsers)
    return parser


def with_subcommand(argv: list[str]) -> list[str]:
    """`argv` with `tokenize` put in front when it starts with a flag other than --help.

    `mg-prep --input c.jsonl --output-prefix p ...` is then preprocess_data.py's
    command line as it is; `mg-prep`, `mg-prep --help` and `mg-prep -h` still
    list the subcommands.
    """
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        return [DEFAULT_SUBCOMMAND, *argv]
    return argv


def main(argv: list[str] | None = None) -> None:
    argv = with_subcommand(sys.argv[1:] if argv is None else argv)
    # Import only the module of the chosen subcommand; `mg-prep --help` imports all.
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    interrupts.install()  # SIGINT and SIGTERM alike, from start-up on
    command = chosen or "mg-prep"
    try:
        parser = build_parser(chosen)
        args = parser.parse_args(argv)
        command = args.command
        status = args.func(args)
    except UserError as err:
        print(f"mg-prep {command}: error: {err}", file=sys.stderr)
        status = 2
    except KeyboardInterrupt as stop:
        signum = interrupts.received() or signal.SIGINT
        name = signal.Signals(signum).name
        print(f"mg-prep {command}: interrupted ({name}); nothing was published.", file=sys.stderr)
        status = getattr(stop, "exit_status", 128 + signum)
    sys.exit(status or 0)
