"""What each `mg-prep` subcommand module shares with the command line: the error a user's
input raises, the check that no output is one of its inputs, and the lazy runner.

Kept apart from `cli`, which imports the subcommand modules by name (so that only the
chosen one loads): they import this, never `cli`, and the two never import each other.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable

from mg.core.io_paths import Named, output_clash


class UserError(Exception):
    """A problem with the user's input; printed as ``mg-prep: error: ...`` without a traceback."""


def refuse_own_input(outputs: list[Named], inputs: list[Named], files_into: bool = False) -> None:
    """Raise UserError when an output is, holds or lies inside an input (nothing written yet);
    `files_into`: output folders that files are written into may hold an input."""
    clash = output_clash(outputs, inputs, files_into=files_into)
    if clash:
        raise UserError(clash)


def run_later(module_name: str) -> Callable[[argparse.Namespace], int]:
    """A subcommand's ``func``: ``mg.corpus_prep.<module_name>.run``, imported when called."""

    def run(args: argparse.Namespace) -> int:
        return importlib.import_module(f"mg.corpus_prep.{module_name}").run(args)

    return run
