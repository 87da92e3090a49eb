"""Ctrl-C and SIGTERM: stop at any moment, clean up, never publish after an interrupt.

The main process handles SIGINT and SIGTERM alike: the first one raises
:class:`Interrupted` (a ``KeyboardInterrupt``) so the writers' context managers
delete their temporary files and the worker pool is shut down; the signal is
also *remembered*, and :func:`check` is called right before anything is
published, so an interrupt that some library swallowed still stops the run.
While the finished datasets are renamed into place (:func:`publishing`) a signal
is only recorded: the few renames complete, so a ``.bin`` never sits beside
another run's ``.idx``, and the command then exits non-zero saying so.

Worker processes (:func:`become_worker`) ignore SIGINT (a Ctrl-C in a terminal
reaches the whole process group; the parent decides), die on SIGTERM, and on
Linux are killed when their parent dies (``PR_SET_PDEATHSIG``), so even a
``kill -9`` of mg-prep leaves no orphan tokenizers behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from types import FrameType

HANDLED = (signal.SIGINT, signal.SIGTERM)
_PR_SET_PDEATHSIG = 1

_received: int | None = None
_count = 0
_deferring = False


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM reached mg-prep; `exit_status` is 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


def _handle(signum: int, frame: FrameType | None) -> None:
    global _received, _count
    _received = signum
    _count += 1
    if _count >= 3:  # a third signal while cleaning up: the user means it
        os._exit(128 + signum)
    if _count == 1 and not _deferring:
        raise Interrupted(signum)


def install() -> None:
    """Handle SIGINT and SIGTERM in this (the main) process."""
    global _received, _count
    _received, _count = None, 0
    for signum in HANDLED:
        signal.signal(signum, _handle)


def received() -> int | None:
    """The signal that interrupted the run, if any."""
    return _received


def check() -> None:
    """Raise :class:`Interrupted` if a signal arrived: call before publishing anything."""
    if _received is not None:
        raise Interrupted(_received)


@contextlib.contextmanager
def publishing() -> Iterator[None]:
    """Record, do not raise, signals while finished files are renamed into place."""
    global _deferring
    check()
    _deferring = True
    try:
        yield
    finally:
        _deferring = False


def become_worker(parent_pid: int) -> None:
    """In a child process: ignore Ctrl-C, die on SIGTERM and when the parent dies."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent_pid:  # the parent died before the line above
        os._exit(1)
