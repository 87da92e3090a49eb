"""Write a whole output folder elsewhere, then rename it into place.

A conversion writes many files (weights, tokenizer, pointers). If it fails half
way, nothing must exist under the target name, or a later tool would take the
half for a model. So everything goes to a hidden sibling folder (same file
system, so the final `os.rename` is atomic) that is removed on any error.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mg.ckpt_convert.errors import ConvertError


def check_target(target: str | Path) -> Path:
    """The target must not exist, or be an empty folder: conversions never overwrite."""
    target = Path(target)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConvertError(f"{target} already exists and is not empty; choose a new --save path")
    return target


@contextmanager
def staged_dir(target: str | Path) -> Iterator[Path]:
    """Yield a fresh folder next to `target`; on success it becomes `target`."""
    target = check_target(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.with_name(f".{target.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        check_target(target)
        if target.exists():
            target.rmdir()
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
