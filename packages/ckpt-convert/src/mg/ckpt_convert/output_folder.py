"""`--save` and `--overwrite`, as mg-quantize has them: an existing output is refused, or
replaced only once the new one is complete.

Every writing subcommand stages its output and renames it into place, so a failed
run leaves nothing under `--save`. With `--overwrite` and an existing `--save`,
the subcommand writes a complete new folder beside it; only then is the old one
renamed away, the new one renamed in and the old one deleted. A failure at any
point before that leaves the old folder as it was.

`--overwrite` deletes, so it replaces only what looks like an earlier output (an
mg or Megatron checkpoint, a Hugging Face folder), never a folder with other
files. (A `--save` that is, holds or lies inside the input is refused before,
by core's `io_paths` check, with or without `--overwrite`.)

Standard library only: the CLI runs these checks before torch is imported.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mg.ckpt_convert.errors import ConvertError

# what an earlier output of mg-convert holds at its top level
_OUTPUT_MARKERS = (
    "latest_checkpointed_iteration.txt",
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
)


def _is_empty_folder(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _looks_like_output(folder: Path) -> bool:
    names = {p.name for p in folder.iterdir()}
    return bool(names & set(_OUTPUT_MARKERS)) or any(
        n.startswith("iter_") or n == "release" for n in names
    )


def check_save(save: str | Path, overwrite: bool) -> None:
    """Refuse an existing `--save` without `--overwrite`, and anything `--overwrite` must
    not delete; say what to do. Runs before anything is read."""
    save = Path(save)
    if not save.exists() or _is_empty_folder(save):
        return
    if not overwrite:
        raise ConvertError(
            f"--save {save} already exists and is not empty; choose a new folder, or pass "
            "--overwrite to replace it once the new output is complete"
        )
    if not save.is_dir():
        raise ConvertError(
            f"--save {save} is a file; --overwrite replaces only an output folder: choose "
            "another --save"
        )
    if not _looks_like_output(save):
        shown = ", ".join(sorted(p.name for p in save.iterdir())[:3])
        raise ConvertError(
            f"--save {save} holds files that are not a checkpoint or Hugging Face model "
            f"({shown}); --overwrite replaces only an earlier output: choose another --save, "
            "or move those files away yourself"
        )


@contextmanager
def replacing(save: str | Path, overwrite: bool) -> Iterator[Path]:
    """The folder to write: `save` itself, or, when `--overwrite` replaces an existing
    output, a hidden sibling that is swapped in for it once the block ends without error."""
    save = Path(save)
    if not overwrite or not save.exists() or _is_empty_folder(save):
        yield save
        return
    fresh = save.with_name(f".{save.name}.new-{os.getpid()}")
    old = save.with_name(f".{save.name}.old-{os.getpid()}")
    shutil.rmtree(fresh, ignore_errors=True)
    try:
        yield fresh
        os.rename(save, old)
        try:
            os.rename(fresh, save)
        except OSError:
            os.rename(old, save)  # put the earlier output back
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
