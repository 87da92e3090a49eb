"""Hang handling: a distributed operation that fails or stalls ends the job with a clear message.

Megatron's `--distributed-timeout-minutes` (default 10) is the process-group
timeout; on top of it every guarded operation (`Watchdog.operation`) is
watched by a daemon thread. Whatever way a rank gets stuck, the job ends
within the timeout and says where:

- a peer died: gloo raises at once ("Connection closed by peer"); the error
  is re-raised as `DistributedOperationError` naming this rank, its pipeline
  stage and the operation, so the rank exits non-zero and torchrun stops the
  others;
- a peer is alive but never answers: the backend's own timeout raises (same
  message), and if it does not (a collective that ignores it, a wedged
  driver) the watchdog thread prints the message and ends the process with
  exit status `HANG_EXIT_CODE` once the operation has run longer than the
  timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch.distributed as dist

HANG_EXIT_CODE = 124
DEFAULT_TIMEOUT_MINUTES = 10.0


class DistributedOperationError(RuntimeError):
    """A distributed operation failed or did not complete within the timeout."""


def timeout_from_minutes(minutes: float) -> timedelta:
    """`--distributed-timeout-minutes` as the timedelta init_process_group takes."""
    if minutes <= 0:
        raise ValueError(f"--distributed-timeout-minutes must be > 0, got {minutes}")
    return timedelta(minutes=minutes)


class Watchdog:
    """Names and times this rank's distributed operations; ends a hung process.

    `where` describes the rank ("pipeline stage 1 of 2"); `on_hang` is called
    with the message after it is printed (default: `os._exit(HANG_EXIT_CODE)`,
    which does not wait for the hung thread)."""

    def __init__(
        self,
        timeout: timedelta,
        rank: int,
        where: str = "",
        on_hang: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout = timeout
        self.rank = rank
        self.where = where
        self._on_hang = on_hang or (lambda message: os._exit(HANG_EXIT_CODE))
        self._lock = threading.Lock()
        self._current: tuple[str, float] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def describe(self, operation: str) -> str:
        where = f" ({self.where})" if self.where else ""
        return f"rank {self.rank}{where}: {operation}"

    def _timeout_message(self, operation: str) -> str:
        minutes = self.timeout.total_seconds() / 60.0
        return (
            f"{self.describe(operation)} did not complete within --distributed-timeout-minutes "
            f"{minutes:g}; another rank has died or is stuck. Ending this process."
        )

    def start(self) -> Watchdog:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="mg-watchdog", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _watch(self) -> None:
        limit = self.timeout.total_seconds()
        period = min(1.0, max(limit / 20.0, 0.01))
        while not self._stop.wait(period):
            with self._lock:
                current = self._current
            if current is not None and time.monotonic() - current[1] > limit:
                message = self._timeout_message(current[0])
                print(message, file=sys.stderr, flush=True)
                self._on_hang(message)
                return

    @contextlib.contextmanager
    def operation(self, name: str) -> Iterator[None]:
        """Run a distributed operation under the watchdog; errors name rank, stage, operation."""
        with self._lock:
            outer = self._current
            if outer is None:
                self._current = (name, time.monotonic())
        try:
            yield
        except DistributedOperationError:
            raise
        except (RuntimeError, dist.DistBackendError) as err:
            text = str(err)
            if "timeout" in text.lower() or "timed out" in text.lower():
                message = self._timeout_message(name)
            else:
                message = f"{self.describe(name)} failed: {text.splitlines()[0] if text else err!r}"
            raise DistributedOperationError(message) from err
        finally:
            if outer is None:
                with self._lock:
                    self._current = None

    def wait(self, work: dist.Work, name: str) -> None:
        """Wait for an async operation (isend/irecv/collective) with the timeout."""
        with self.operation(name):
            if not work.wait(timeout=self.timeout):
                raise DistributedOperationError(self._timeout_message(name))


_default: Watchdog | None = None


def install(timeout: timedelta, rank: int, where: str = "") -> Watchdog:
    """Start this process's watchdog (replacing an earlier one) and return it."""
    global _default
    if _default is not None:
        _default.stop()
    _default = Watchdog(timeout, rank, where).start()
    return _default


def current() -> Watchdog:
    """The installed watchdog, or an unstarted one with the default timeout (tests, tools)."""
    global _default
    if _default is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        _default = Watchdog(timeout_from_minutes(DEFAULT_TIMEOUT_MINUTES), rank)
    return _default


@contextlib.contextmanager
def exit_on_distributed_error(exit_code: int = 1) -> Iterator[None]:
    """Print a `DistributedOperationError`'s message and end the process at once.

    A plain exit would run the process group's teardown, which can block on
    the very peer that failed; `os._exit` does not, so torchrun sees this rank
    fail within the timeout and stops the rest of the job."""
    try:
        yield
    except DistributedOperationError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(exit_code)
