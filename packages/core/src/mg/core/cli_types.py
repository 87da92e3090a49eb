"""argparse value types the tools share (standard library only: `--help` stays instant)."""

from __future__ import annotations

import argparse


def ckpt_step(text: str) -> int | str:
    """A saved iteration (an int > 0) or 'release' (`--ckpt-step`); anything else is refused
    by argparse in one line naming the flag."""
    if text == "release":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a saved iteration: give an int > 0 or 'release'"
        )
    return value
