"""A progress bar when tqdm is installed and stderr is a terminal; nothing otherwise."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: the numbers do not depend on it
        yield from items
        return
    # disable=None: shown on a terminal, silent in logs and CI.
    yield from tqdm(items, total=total, desc=desc, unit="batch", disable=None)
