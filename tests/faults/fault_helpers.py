"""Helpers of the fault-injection suite: tiny training flags, file digests, exit codes.

Every tool runs in this process (its `main`), so a case costs a load, not a
Python start-up; an exception that escapes `main` fails the case (a traceback
is exactly what the suite guards against).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

TINY_MODEL = [
    "--num-layers",
    "1",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--max-position-embeddings",
    "32",
]


def train_argv(cache: Path, *extra: str, iters: int = 2) -> list[str]:
    """`mg-train gpt` on mock data (NullTokenizer, 127 ids): a tiny model in a second."""
    return [
        "gpt",
        *TINY_MODEL,
        "--lr",
        "1e-3",
        "--mock-data",
        "--vocab-size",
        "127",
        "--data-cache-path",
        str(cache),
        "--micro-batch-size",
        "2",
        "--train-iters",
        str(iters),
        "--eval-iters",
        "0",
        "--log-interval",
        "1000",
        *extra,
    ]


def tree_digest(root: Path) -> dict[str, str]:
    """sha256 of every file under `root` (relative names): 'nothing changed' in one compare."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def exit_code(call: Callable[[], int | None]) -> int:
    """A tool's `main` as a process would end: its return value or its SystemExit code."""
    try:
        result = call()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 1
    return 0 if result is None else result
