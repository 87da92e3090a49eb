"""`mg-prep`: raw corpora to Megatron indexed datasets.

Each subcommand lives in its own module exposing ``register(subparsers)``,
which adds its parser and sets ``func`` (called with the parsed namespace,
returning the exit status). Modules are imported lazily so that
``mg-prep inspect`` does not pay for the tokenizer stack.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from mg.corpus_prep import interrupts

# subcommand -> module under mg.corpus_prep that registers it
SUBCOMMANDS: dict[str, str] = {
    "tokenize": "tokenize_cmd",
    "clean": "clean_cmd",
    "merge": "merge_cmd",
    "inspect": "inspect_cmd",
    "train-tokenizer": "train_tokenizer_cmd",
    "refresh": "refresh_cmd",
}


class UserError(Exception):
    """A problem with the user's input; printed as ``mg-prep: error: ...`` without a traceback."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mg-prep",
        description="Turn loose JSON corpora into Megatron .bin/.idx indexed datasets.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in SUBCOMMANDS.items():
        if only is not None and name != only:
            subparsers.add_parser(name, help=f"see `mg-prep {name} --help`")
            continue
        module = importlib.import_module(f"mg.corpus_prep.{module_name}")
        module.register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
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
