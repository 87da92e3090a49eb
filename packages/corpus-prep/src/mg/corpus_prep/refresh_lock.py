"""The refresh lock: one `mg-prep refresh` per output folder at a time.

`fcntl.flock` on ``OUT/.refresh.lock``. The kernel drops the lock when the
holder's descriptor closes, including when the process is killed (-9
included), so a crashed run never leaves a stale lock behind and there is no
pid file to clean up. flock works on local filesystems and on NFSv4; on other
network filesystems use a local lock file with cron's `flock(1)` as well (see
workflows/cron/README.md).
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

LOCK_NAME = ".refresh.lock"
POLL_SECONDS = 0.1


class LockTimeout(Exception):
    """Another process held the lock for the whole wait."""


@contextmanager
def refresh_lock(output_dir: str | os.PathLike[str], timeout: float) -> Iterator[None]:
    """Hold an exclusive lock on `output_dir` for the block; wait at most `timeout` seconds."""
    path = os.path.join(output_dir, LOCK_NAME)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LockTimeout(path) from None
                time.sleep(POLL_SECONDS)
        # For people looking at the folder: who holds it. Not used for locking.
        os.ftruncate(descriptor, 0)
        os.pwrite(descriptor, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(descriptor)  # releases the lock
