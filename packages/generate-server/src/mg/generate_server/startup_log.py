"""Start-up progress: each loading step as it begins, with the seconds since mg-serve started.

Reading a large checkpoint, building a C++ kernel or compiling decode steps can
take minutes before the server listens; without a line per step a user cannot
tell a slow start from a hung one. The lines go to the log (stderr, at info
level), from one rank under torchrun.

Progress bars of the libraries underneath (tqdm, huggingface_hub) are drawn
only on a terminal: in a log file their carriage-return redraws are clutter.
"""

from __future__ import annotations

import logging
import os
import sys
import time

log = logging.getLogger("mg.generate_server")

QUIET_PROGRESS_BARS = ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")
"""The switches tqdm and huggingface_hub read (once, when imported)."""


class StartupLog:
    """`step("reading checkpoint %s", path)` logs `reading checkpoint ckpt [2.1 s]`."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.enabled = os.environ.get("RANK", "0") == "0"  # torchrun: rank 0 speaks

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def step(self, message: str, *args: object) -> None:
        if self.enabled:
            log.info(f"{message} [%.1f s]", *args, self.elapsed())


def stderr_is_terminal() -> bool:
    """Whether stderr is a terminal a bar can redraw on (a stream that cannot say is a log)."""
    isatty = getattr(sys.stderr, "isatty", None)
    try:
        return bool(isatty is not None and isatty())
    except (OSError, ValueError):  # a closed or detached stream
        return False


def quiet_progress_bars_in_logs() -> None:
    """Turn the libraries' progress bars off unless stderr is a terminal; call it before
    they are imported. A switch the user set stays as it is."""
    if stderr_is_terminal():
        return
    for name in QUIET_PROGRESS_BARS:
        os.environ.setdefault(name, "1")
