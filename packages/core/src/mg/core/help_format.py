"""Every command's `--help`: show a flag's default only where it says something.

argparse's ArgumentDefaultsHelpFormatter appends "(default: X)" to every flag,
which prints "(default: None)" for flags whose default is derived from others
and "(default: True)" for ``--bert-no-binary-head`` (a ``store_false`` flag,
whose default is the *opposite* of what the flag does). This one appends the
default only when it is a real value, the flag is not an on/off switch, and
the help text does not already state it.
"""

from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Like ArgumentDefaultsHelpFormatter, without None, switches, or a repeated default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            default is None
            or default is argparse.SUPPRESS
            or isinstance(default, bool)
            or action.nargs == 0
            or "default" in text.lower()
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"
