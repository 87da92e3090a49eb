"""Reading and writing one ``.pt`` file: safe loading and crash-safe writing.

Loading. Every file is first read with ``torch.load(weights_only=True)`` and a
small allowlist of plain-data classes that checkpoints legitimately hold:
``argparse.Namespace`` (Megatron pickles its ``args`` as one) and the numpy
pieces of ``np.random.get_state()`` (Megatron's ``rng_state``). Our own saves
need nothing more. A real Megatron-LM run also pickles enums into ``args``
(``AttnBackend``, ``signal.Signals``): those are read again, still weights-only,
as their members' names (see :mod:`.foreign_enums`), so every tool loads
Megatron-LM's checkpoints without megatron-core and without running code from
the file. A file that names any other class is refused with the list of
classes it asks for, unless the caller passes ``allow_pickle=True``, which falls
back to ``weights_only=False`` — full pickle, so only for files you trust.

Writing. ``torch.save`` goes to a temporary name beside the target, is flushed
and fsynced, then renamed over the target, so a reader sees the old file or the
whole new one, never half of one.
"""

from __future__ import annotations

import argparse
import os
import pickle
import types
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mg.core.checkpoint.foreign_enums import is_foreign, stand_ins
from mg.core.checkpoint.layout import CheckpointError
from mg.core.checkpoint.reader_guard import corrupt_file_error, describe_exception

_np_core = getattr(np, "_core", None) or np.core  # numpy >= 2 renamed numpy.core


def _safe_globals() -> list[Any]:
    allowed: list[Any] = [
        argparse.Namespace,
        types.SimpleNamespace,  # Megatron-LM's rerun state machine keeps one
        _np_core.multiarray._reconstruct,
        _np_core.multiarray.scalar,
        np.ndarray,
        np.dtype,
    ]
    # numpy >= 1.25 pickles a dtype through its class (np.dtypes.UInt32DType, ...)
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        allowed += [
            getattr(dtypes, name)
            for name in dir(dtypes)
            if name.endswith("DType") and isinstance(getattr(dtypes, name), type)
        ]
    return allowed


SAFE_GLOBALS = _safe_globals()

_CORRUPT_ERRORS = (
    RuntimeError,
    EOFError,
    OSError,
    pickle.UnpicklingError,
    zipfile.BadZipFile,
    ValueError,
    KeyError,
    AttributeError,
    ModuleNotFoundError,
    ImportError,
    TypeError,
)


def _is_weights_only_refusal(exc: BaseException) -> bool:
    return isinstance(exc, pickle.UnpicklingError) and "Weights only load failed" in str(exc)


def unsafe_globals(path: Path) -> list[str]:
    """Classes/functions the pickle in ``path`` names beyond torch's and our allowlist."""
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        found = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    allowed = {f"{g.__module__}.{g.__qualname__}" for g in SAFE_GLOBALS}
    return [name for name in found if name not in allowed]


def load_file(
    path: Path,
    *,
    map_location: Any = "cpu",
    allow_pickle: bool = False,
    mmap: bool = False,
) -> dict[str, Any]:
    """Load one checkpoint file; every failure becomes a :class:`CheckpointError` naming it."""
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except Exception as exc:
        if not _is_weights_only_refusal(exc):
            raise _corrupt(path, exc) from exc
        refusal = exc
    try:
        found = unsafe_globals(path)
    except Exception as exc:
        if not allow_pickle:  # not a zip archive: garbage, or a pre-1.6 torch.save file
            raise _corrupt(path, refusal) from exc
        found = []
    others = [name for name in found if not is_foreign(name)]
    if found and not others:  # Megatron-LM's enums only: read as names, weights-only
        try:
            with torch.serialization.safe_globals(SAFE_GLOBALS + stand_ins(found)):
                return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except Exception as exc:
            if not _is_weights_only_refusal(exc):
                raise _corrupt(path, exc) from exc
            others = found  # one of them is not an enum value (a pickled object)
    if not allow_pickle:
        names = ", ".join(others) or "(unknown)"
        raise CheckpointError(
            f"{path}: this file pickles Python objects outside the safe allowlist: {names}; "
            "mg tools read only plain data, tensors and Megatron-LM's enums from a "
            "checkpoint. Re-save it with plain-data args, or, if you trust the file, load it "
            "with allow_pickle=True (torch.load weights_only=False, which can run code from "
            "the file)."
        ) from refusal
    try:
        return torch.load(path, map_location=map_location, weights_only=False, mmap=mmap)
    except ModuleNotFoundError as exc:
        raise CheckpointError(
            f"{path}: the pickled args need the module {exc.name!r}, which is not installed. "
            "Install the package that wrote the checkpoint (e.g. megatron-core), or re-save "
            "the checkpoint with args as a plain dict."
        ) from exc
    except Exception as exc:
        raise _corrupt(path, exc) from exc


def _corrupt(path: Path, exc: BaseException) -> CheckpointError:
    """Not a zip archive is garbage to every tool (a pre-1.6 torch.save file, full pickle,
    is read only with allow_pickle=True, which no tool's flag sets: not offered here)."""
    return corrupt_file_error(path, describe_exception(exc))


def fsync_dir(path: Path) -> None:
    """Make a rename/creation inside ``path`` durable (no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: Path, write: Callable[[Any], None], *, binary: bool = True) -> None:
    """Write ``path`` via ``<path>.tmp-<pid>``: write, flush, fsync, ``os.replace``, fsync dir."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb" if binary else "w") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def save_file(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` ``state`` to ``path`` atomically."""
    atomic_write(path, lambda handle: torch.save(state, handle))
