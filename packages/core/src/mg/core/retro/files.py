"""Atomic writes of the project folder's files: write beside the target, fsync, rename.

A block that exists is complete, which is what lets every stage resume after an
interruption by skipping the blocks already on disk.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary name beside ``path``; on success it is fsynced and renamed to ``path``.

    For writers that want a file name (Faiss' ``write_index``); on an exception the
    temporary file is removed and ``path`` is left as it was.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a folder be fsynced
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def save_array(path: str | os.PathLike[str], array: np.ndarray) -> None:
    """``np.save`` ``array`` to ``path`` (which should end in ``.npy``) atomically."""
    with atomic_path(path) as tmp, open(tmp, "wb") as handle:
        np.save(handle, np.ascontiguousarray(array), allow_pickle=False)


def load_array(path: str | os.PathLike[str], mmap: bool = False) -> np.ndarray:
    """A ``.npy`` file written by :func:`save_array` (memory-mapped when ``mmap``)."""
    return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)


def write_json(path: str | os.PathLike[str], data: Any) -> None:
    """``data`` as indented, key-sorted JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def read_json(path: str | os.PathLike[str]) -> Any:
    return json.loads(Path(path).read_text())
