"""One-line messages for outputs that could not be written, and for datasets replaced.

A full disk, a read-only folder or an output path that runs through a file
reach the commands as `OSError`s from deep inside the builders; these turn
them into a sentence that names the output, says what went wrong and what to
do, and tells the truth about the temporary files (the builders record on the
error any they could not delete, as `left_behind`).
"""

from __future__ import annotations

import errno
import os
import re

# The builders' temporary names: FINAL.<pid>-<8 hex>.tmp
_TEMPORARY = re.compile(r"\.\d+-[0-9a-f]{8}\.tmp$")

_ADVICE = {
    errno.ENOSPC: "free some space or write elsewhere",
    errno.EDQUOT: "free some space or write elsewhere",
    errno.EROFS: "choose a writable folder",
    errno.EACCES: "choose a folder you can write to",
    errno.EPERM: "choose a folder you can write to",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EEXIST: "a part of the path is a file, not a folder",
}


def final_name(path: str) -> str:
    """The output a temporary file stands for (the path itself if it is not one)."""
    return _TEMPORARY.sub("", path)


def cannot_write(output: str, err: OSError) -> str:
    """`output: cannot write (reason); advice; what happened to the temporary files`."""
    reason = err.strerror or str(err)
    advice = _ADVICE.get(err.errno or 0)
    left = getattr(err, "left_behind", [])
    if left:
        cleanup = f"nothing was published, but could not remove {', '.join(left)}: delete it"
    else:
        cleanup = "nothing was published and the temporary files were removed"
    return f"{output}: cannot write ({reason}){'; ' + advice if advice else ''}; {cleanup}"


def missing_folders(path: str) -> list[str]:
    """The folders that creating `path` (a folder) would create, innermost first."""
    missing = []
    path = os.path.abspath(path)
    while not os.path.exists(path):
        missing.append(path)
        path = os.path.dirname(path)
    return missing


def remove_folders(folders: list[str]) -> None:
    """Remove these folders (innermost first) where a failed run left them empty."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            return


def existing_dataset(prefix: str) -> bool:
    """Whether `prefix.bin` or `prefix.idx` exists (and would be replaced)."""
    return os.path.exists(prefix + ".bin") or os.path.exists(prefix + ".idx")
