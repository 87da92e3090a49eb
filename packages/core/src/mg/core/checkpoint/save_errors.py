"""One message for a save that could not be written (a full disk), in either format.

Both writers stage a save in ``iter_XXXXXXX.tmp/`` and rename it into place only
once it is complete; when a write fails they remove the staging folder and raise
:class:`SaveError`, which says why, that the previous checkpoint and the tracker
are as they were, and how much room the disk has left.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from mg.core.checkpoint.layout import (
    CheckpointError,
    Iteration,
    read_latest_iteration,
    tracker_file,
)


class SaveError(CheckpointError):
    """A save that could not be written: discarded, nothing else touched."""


def describe_write_error(error: BaseException) -> str:
    """A failed write in a few words: the OS's reason, or the first line of the error.

    ``torch.save`` reports a full disk as a RuntimeError, DCP as a CheckpointException
    holding each rank's exception; both are unwrapped to the first OS error inside.
    """
    failures = getattr(error, "failures", None)  # DCP's CheckpointException: rank -> error
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) and first else first  # (error, traceback)
        first = getattr(first, "exc", first)  # DCP's _WrappedException
        if isinstance(first, BaseException):
            return describe_write_error(first)
    if isinstance(error, OSError) and error.strerror:
        return error.strerror.lower() if error.errno == errno.ENOSPC else error.strerror
    cause = error.__cause__ or error.__context__
    if isinstance(cause, OSError):
        return describe_write_error(cause)
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:160]


def save_failed(save_dir: Path, iteration: Iteration, staging: Path, reason: str) -> SaveError:
    """The error of a save whose staging folder was removed."""
    previous = read_latest_iteration(save_dir)
    if previous is not None:
        kept = (
            f"the previous checkpoint (iteration {previous}) and "
            f"{tracker_file(save_dir).name} are as they were"
        )
    else:
        kept = f"no checkpoint was in {save_dir} before"
    return SaveError(
        f"{save_dir}: could not save the checkpoint of iteration {iteration} ({reason}); its "
        f"partial {staging.name} folder was removed and {kept}. {_space_hint(save_dir)}"
    )


def _space_hint(folder: Path) -> str:
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return "Check the disk, then save again."
    return f"Its disk has {free:,} bytes free: free some space or save elsewhere."
