"""One guard that turns a corrupt or truncated model file into a named error.

Every tool that opens a model artifact (mg-train, mg-eval, mg-serve, mg-convert)
goes through these readers, so a half-copied ``.distcp``, a ``common.pt`` cut
short by a full disk, an HTML error page saved as ``model.safetensors`` or an
empty ``model.safetensors.index.json`` all read the same way to the user::

    ckpt/iter_0000200/__0_0.distcp: truncated or not a torch.distributed.checkpoint
    shard file (the index needs 1,048,576 bytes, the file has 524,288): an
    interrupted save or copy, or an incomplete download? Copy it again, or load
    another iteration (--ckpt-step N).

The error is a :class:`CorruptFileError` (a :class:`CheckpointError`) carrying the
path; :func:`user_message` adds the flag that picks another iteration in the
calling tool (``--ckpt-step`` in mg-eval, ``--iteration`` in mg-convert and
mg-serve), since the guard itself cannot know which tool it runs in.

DCP shards are checked against the index before anything is read: the index
(``.metadata``) records where every item lives (file, offset, length), so a
file shorter than the furthest item is truncated, whichever items a tool asks
for. Importing this module costs nothing (torch, safetensors and DCP are
imported by the functions that need them).
"""

from __future__ import annotations

import json
import pickle
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mg.core.checkpoint.layout import CheckpointError

# what a file is, by its name, for "not a ... file"
_KINDS = {
    ".distcp": "torch.distributed.checkpoint shard",
    ".metadata": "torch.distributed.checkpoint index (.metadata)",
    ".safetensors": "safetensors",
    ".json": "JSON",
    ".pt": "torch.save",
    ".bin": "torch.save (pytorch_model.bin)",
}


class CorruptFileError(CheckpointError):
    """A model file exists but cannot be read: truncated, empty or something else entirely."""

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


def kind_of(path: Path) -> str:
    """The file type a reader expects at `path`, from its name."""
    if path.name == "common.pt":
        return "torch.save (torch_dist common.pt)"
    return _KINDS.get(path.suffix, "checkpoint")


def _size(path: Path) -> int | None:
    try:
        return path.stat().st_size
    except OSError:
        return None


def corrupt_file_error(
    path: Path | str, detail: str, *, kind: str | None = None
) -> CorruptFileError:
    """The one message for an unreadable model file: path, what it should be, why, what to do."""
    path = Path(path)
    size = _size(path)
    what = kind or kind_of(path)
    seen = "the file is empty" if size == 0 else detail
    if size and "file has" not in seen:
        seen += f"; file size {size:,} bytes"
    return CorruptFileError(
        f"{path}: truncated or not a {what} file ({seen}): an interrupted save or copy, a full "
        "disk, or an incomplete download? Copy or download it again, or load another "
        "iteration.",
        path,
    )


def describe_exception(exc: BaseException) -> str:
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    if "Weights only load failed" in line:  # torch's hint for a file that is not a zip archive
        line = "not a zip archive"
    return f"{type(exc).__name__}: {line}"[:200]


@contextmanager
def guard_read(path: Path | str, *, kind: str | None = None) -> Iterator[None]:
    """Re-raise any failure while reading `path` as a :class:`CorruptFileError`.

    A missing file stays a plain :class:`CheckpointError` ("no such file"), and
    errors that are already :class:`CheckpointError`s pass through unchanged.
    """
    try:
        yield
    except CheckpointError:
        raise
    except FileNotFoundError as exc:
        raise CheckpointError(f"{path}: no such file ({exc.strerror})") from None
    except PermissionError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror})") from None
    except Exception as exc:  # MemoryError too: a garbage length field in a small file
        raise corrupt_file_error(path, describe_exception(exc), kind=kind) from exc


def user_message(exc: BaseException, iteration_flag: str | None = None) -> str:
    """The error text for the user; for a corrupt file, name the tool's iteration flag."""
    text = str(exc)
    if iteration_flag and isinstance(exc, CorruptFileError):
        text = text.rstrip(".") + f" ({iteration_flag})."
    return text


# --------------------------------------------------------------------------- readers


def read_json(path: Path | str) -> Any:
    """A JSON file (config.json, model.safetensors.index.json, metadata.json), parsed."""
    path = Path(path)
    with guard_read(path, kind="JSON"):
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError("no JSON in it")
        return json.loads(text)


def read_weight_map(index: Path | str) -> dict[str, str]:
    """The ``weight_map`` of a sharded Hugging Face checkpoint's index file."""
    index = Path(index)
    data = read_json(index)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise corrupt_file_error(index, "no weight_map in it", kind="Hugging Face index JSON")
    return weight_map


def open_safetensors(path: Path | str, framework: str = "pt") -> Any:
    """``safetensors.safe_open`` (a context manager); its header is checked against the size."""
    from safetensors import safe_open  # lazy: importing the guard costs nothing (--help)

    path = Path(path)
    with guard_read(path, kind="safetensors"):
        return safe_open(path, framework=framework)


def torch_load(path: Path | str, **kwargs: Any) -> Any:
    """``torch.load(path, weights_only=True, ...)``, failures named (e.g. pytorch_model.bin)."""
    import torch  # lazy: importing the guard costs nothing (the tools' --help stays instant)

    path = Path(path)
    kwargs.setdefault("weights_only", True)
    kwargs.setdefault("map_location", "cpu")
    with guard_read(path):
        return torch.load(path, **kwargs)


def read_dcp_metadata(folder: Path | str) -> Any:
    """DCP's index of a ``torch_dist`` folder, after checking every shard file's length."""
    # lazy: DCP is heavy; importing the guard costs nothing (the tools' --help stays instant)
    from torch.distributed.checkpoint import FileSystemReader

    folder = Path(folder)
    with guard_read(folder / ".metadata"):
        metadata = FileSystemReader(folder).read_metadata()
    check_dcp_files(folder, metadata)
    return metadata


def check_dcp_files(folder: Path, metadata: Any) -> None:
    """Each ``.distcp`` file must exist and reach the end of the furthest item it holds."""
    needed: dict[str, int] = {}
    for info in (getattr(metadata, "storage_data", None) or {}).values():
        relative = getattr(info, "relative_path", None)
        if relative is None:
            continue
        end = int(info.offset) + int(info.length)
        needed[relative] = max(needed.get(relative, 0), end)
    for relative, end in sorted(needed.items()):
        path = folder / relative
        size = _size(path)
        if size is None:
            raise CheckpointError(
                f"{path}: missing; the checkpoint's index (.metadata) lists it. The folder is "
                "incomplete (an interrupted copy or download?): copy it again, or load another "
                "iteration."
            )
        if size < end:
            raise corrupt_file_error(
                path, f"the index needs {end:,} bytes, the file has {size:,}", kind=kind_of(path)
            )


@contextmanager
def guard_dcp_load(folder: Path | str) -> Iterator[None]:
    """Around ``dcp.load``: a shard whose bytes do not deserialize is named with its folder.

    DCP reports per-rank failures as one ``CheckpointException``; the files' lengths
    were already checked, so what is left is content that is not what the index says.
    """
    folder = Path(folder)
    try:
        yield
    except CheckpointError:
        raise
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as exc:  # DCP's CheckpointException derives from BaseException
        if not _looks_like_read_failure(exc):
            raise
        shards = sorted(p.name for p in folder.glob("*.distcp"))
        raise CorruptFileError(
            f"{folder}: a shard ({', '.join(shards[:4]) or 'no .distcp files'}) is corrupt or "
            f"not a torch.distributed.checkpoint shard file ({describe_exception(exc)}): an "
            "interrupted save or copy, or an incomplete download? Copy the folder again, or "
            "load another iteration.",
            folder,
        ) from exc


def _looks_like_read_failure(exc: BaseException) -> bool:
    """DCP's wrapper of per-rank read errors, or the deserialization errors themselves."""
    name = type(exc).__name__
    if name == "CheckpointException":
        return True
    return isinstance(exc, (pickle.UnpicklingError, zipfile.BadZipFile, EOFError)) or (
        isinstance(exc, RuntimeError)
        and any(
            s in str(exc)
            for s in ("PytorchStreamReader", "zip archive", "unexpected EOF", "storage")
        )
    )
