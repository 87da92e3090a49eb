"""Lines between Megatron's log lines, so a slow run never looks hung.

Megatron prints one line per ``--log-interval`` iterations; on a slow machine
that is many minutes of silence. Two lines fill it, printed by the log rank
only, in the log line's format (timestamp, iteration, consumed samples):

- when the first iteration completes, its time (it includes the warm-up:
  allocation, kernel selection, the first batches read), unless the first
  iteration is a log line already;
- a heartbeat when no line has appeared for ``interval`` seconds (60 by
  default), with the mean time of the iterations since the last line and when
  the next log line is due.

They are checked after each iteration, so they never interleave with other
output.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime

HEARTBEAT_SECONDS = 60.0


def _stamp() -> str:
    return datetime.now().strftime("%Y-%m-%d %H:%M:%S")


def first_iteration_line(
    iteration: int, train_iters: int, consumed_samples: int, elapsed_ms: float
) -> str:
    return (
        f" [{_stamp()}] iteration {iteration:8d}/{train_iters:8d} |"
        f" consumed samples: {consumed_samples:12d} |"
        f" first iteration done, elapsed time (ms): {elapsed_ms:.1f} (includes warm-up) |"
    )


def heartbeat_line(
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    silent_s: float,
    next_log: int,
) -> str:
    return (
        f" [{_stamp()}] iteration {iteration:8d}/{train_iters:8d} |"
        f" consumed samples: {consumed_samples:12d} |"
        f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
        f" still training: no log line for {silent_s:.0f} s, next at iteration {next_log} |"
    )


class Heartbeat:
    """Decides, after each iteration, whether to print the first-iteration or heartbeat line.

    ``log_interval`` is ``--log-interval``; ``emit`` prints (a no-op off the log rank);
    ``clock`` is ``time.monotonic`` (a test's own clock otherwise).
    """

    def __init__(
        self,
        log_interval: int,
        train_iters: int,
        emit: Callable[[str], None],
        interval: float = HEARTBEAT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log_interval, self.train_iters = log_interval, train_iters
        self.emit, self.interval, self.clock = emit, interval, clock
        self.started = self.last_line = clock()
        self.iterations_since_line = 0
        self.first_done = False

    def logged(self) -> None:
        """A log line (or a validation line) was printed: the silence starts again."""
        self.last_line = self.clock()
        self.iterations_since_line = 0

    def after_iteration(self, iteration: int, consumed_samples: int) -> None:
        now = self.clock()
        self.iterations_since_line += 1
        if not self.first_done:
            self.first_done = True
            if iteration % self.log_interval != 0:
                elapsed_ms = (now - self.started) * 1000.0
                self.emit(
                    first_iteration_line(iteration, self.train_iters, consumed_samples, elapsed_ms)
                )
                self.last_line, self.iterations_since_line = now, 0
            return
        silent = now - self.last_line
        if silent < self.interval or iteration % self.log_interval == 0:
            return
        per_iteration_ms = silent * 1000.0 / max(self.iterations_since_line, 1)
        next_log = (iteration // self.log_interval + 1) * self.log_interval
        self.emit(
            heartbeat_line(
                iteration,
                self.train_iters,
                consumed_samples,
                per_iteration_ms,
                silent,
                min(next_log, self.train_iters),
            )
        )
        self.last_line, self.iterations_since_line = now, 0
