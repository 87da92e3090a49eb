"""An output must never be, hold or sit inside an input: the check every writing tool runs.

Tools write atomically: they stage the output beside its target, then rename it
into place and delete whatever the target held. A ``--save`` equal to ``--load``,
or a folder above it, would therefore delete the very checkpoint being read (and
an output written inside an input folder changes the input, or is read back as
input by the next run). Each tool names its outputs and inputs with their flags;
:func:`output_clash` compares every pair after resolving symbolic links and says
what is wrong in one line, naming both flags.

Standard library only, so a tool runs it before importing torch.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterable

PathLike = str | os.PathLike[str]
# (flag, path or None): a flag the user did not give is None and is skipped
Named = tuple[str, PathLike | None]

_PHRASES = {
    "is": ("is", "overwrite it"),
    "contains": ("contains", "delete the input inside it"),
    "inside": ("lies inside", "write into it"),
}


def real_path(path: PathLike) -> str:
    """The absolute path with every symbolic link resolved (the file it names, if any)."""
    return os.path.realpath(os.path.abspath(os.fspath(path)))


def _within(path: str, folder: str) -> bool:
    return path != folder and os.path.commonpath([path, folder]) == folder


def _same_file(a: str, b: str) -> bool:
    """Hard links and bind mounts name one file under two paths."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def relation(output: PathLike, source: PathLike) -> str | None:
    """How ``output`` lies against ``source``: "is", "contains", "inside", or None."""
    out, src = real_path(output), real_path(source)
    if out == src or _same_file(out, src):
        return "is"
    if _within(src, out):
        return "contains"
    if _within(out, src):
        return "inside"
    return None


def expand(path: PathLike) -> list[str]:
    """A glob pattern's matches (a pattern that exists as a file is that file), else the path."""
    text = os.fspath(path)
    if any(c in text for c in "*?[") and not os.path.exists(text):
        return sorted(glob.glob(text, recursive=True))
    return [text]


def output_clash(
    outputs: Iterable[Named], inputs: Iterable[Named], *, files_into: bool = False
) -> str | None:
    """The first output that is, contains or lies inside an input, as a one-line message
    naming both flags and what to do; None when every output stands apart.

    ``files_into``: the outputs are folders the tool writes named files into and never
    replaces whole (a tokenizer's files, refresh's shards), so one may hold an input.
    """
    sources = [(flag, path) for flag, path in inputs if path is not None]
    for out_flag, output in outputs:
        if output is None:
            continue
        for in_flag, given in sources:
            for source in expand(given):
                kind = relation(output, source)
                if kind is None or (files_into and kind == "contains"):
                    continue
                phrase, harm = _PHRASES[kind]
                named = os.fspath(given) if source == os.fspath(given) else f"{given} ({source})"
                return (
                    f"{out_flag} {os.fspath(output)} {phrase} the input {in_flag} {named}; "
                    f"writing there would {harm}: choose a {out_flag} outside {in_flag}"
                )
    return None
