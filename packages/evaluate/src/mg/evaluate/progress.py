"""A progress bar on a terminal; nothing at all in logs and CI.

A bar redraws itself with carriage returns, which a log file keeps as clutter.
It is drawn only when stderr is a terminal (``isatty()``); a stream that cannot
say, such as a wrapper that captures output, counts as a log. Libraries that
draw their own bars (lm-eval's request building and tokenizing) are quieted the
same way around their calls.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

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


@contextmanager
def library_bars_on_terminal_only() -> Iterator[None]:
    """Within the block every tqdm bar is disabled unless stderr is a terminal.

    lm-eval creates its bars with tqdm's default ``disable=False`` (drawn even into a
    log), and tqdm reads its settings once, at import; so tqdm's constructor is wrapped
    for the block and restored after it."""
    if on_terminal():
        yield
        return
    original = tqdm.__init__

    def quiet(self: tqdm, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    tqdm.__init__ = quiet  # type: ignore[method-assign]
    try:
        yield
    finally:
        tqdm.__init__ = original  # type: ignore[method-assign]
