"""A progress bar on a terminal; nothing at all in logs and CI.

A bar redraws itself with carriage returns, which a log file keeps as clutter.
It is drawn only when stderr is a terminal (``isatty()``); a stream that cannot
say, such as a wrapper that captures output, counts as a log.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def on_terminal() -> bool:
    """Whether stderr is a terminal a bar can redraw on."""
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


def progress(items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    if not on_terminal():
        yield from items
        return
    yield from tqdm(items, total=total, desc=desc, unit="batch", file=sys.stderr)
