"""Durable, atomic file operations for publishing refresh results.

A file is published by writing it under a temporary name in the same folder,
fsyncing it, renaming it over the final name (atomic on POSIX) and fsyncing
the folder so that the rename itself survives a crash. Readers therefore see
either the old or the new file, never a partial one.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil

# Temporary names: "<final name>.<pid>-<hex>.tmp", the same pattern as
# mg.indexed_dataset's builder, so one sweep finds both kinds.
TEMPORARY_PATTERN = re.compile(r"\.\d+-[0-9a-f]+\.tmp$")


def temporary_name(path: str | os.PathLike[str]) -> str:
    return f"{os.fspath(path)}.{os.getpid()}-{secrets.token_hex(4)}.tmp"


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's (or a folder's) data and metadata to stable storage."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Replace `path` with `data` so that readers see the old or the new bytes, nothing between."""
    temporary = temporary_name(path)
    try:
        with open(temporary, "xb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    fsync_path(os.path.dirname(os.path.abspath(path)))


def move_durably(source: str, target: str) -> None:
    """fsync `source`, then rename it to `target` (same filesystem)."""
    fsync_path(source)
    os.replace(source, target)


def remove_stale_temporaries(folder: str | os.PathLike[str]) -> list[str]:
    """Delete temporaries left in `folder` (not recursive) by a killed run; return their paths.

    Only safe while holding the refresh lock: then no live writer owns them.
    """
    removed = []
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return removed
    for name in names:
        path = os.path.join(folder, name)
        if TEMPORARY_PATTERN.search(name) and os.path.isfile(path):
            os.remove(path)
            removed.append(path)
    return removed


def remove_tree(path: str | os.PathLike[str]) -> bool:
    """Delete a folder and everything in it; False if it was not there."""
    if not os.path.lexists(path):
        return False
    shutil.rmtree(path)
    return True
