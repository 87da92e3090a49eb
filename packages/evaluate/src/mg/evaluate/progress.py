"""A progress bar on a terminal; silent in logs and CI."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


def progress(items: Iterable[T], total: int, desc: str) -> Iterator[T]:
    # disable=None: shown on a terminal, silent in logs and CI.
    yield from tqdm(items, total=total, desc=desc, unit="batch", disable=None)
