"""The one error type users see from mg-eval: a message that names the file and line."""

from __future__ import annotations

from pathlib import Path


class EvalInputError(Exception):
    """Bad input (data file, flags, checkpoint) explained for a user, without a traceback.

    The CLI prints it as ``mg-eval <task>: error: FILE:LINE: what is wrong``.
    """

    def __init__(self, message: str, path: str | Path | None = None, line: int | None = None):
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)


def read_text(path: str | Path, task: str) -> str:
    """A data file as UTF-8 text; binary files, missing files and empty files are errors."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise EvalInputError("no such file", path) from None
    except IsADirectoryError:
        raise EvalInputError(f"is a directory; {task} needs a file", path) from None
    except OSError as exc:
        raise EvalInputError(f"cannot read: {exc.strerror}", path) from None
    if not data.strip():
        raise EvalInputError(f"the file is empty; {task} has nothing to evaluate", path)
    if b"\x00" in data:
        line = data[: data.index(b"\x00")].count(b"\n") + 1
        raise EvalInputError(
            f"binary data (a NUL byte); {task} reads a UTF-8 text file. "
            "For an indexed dataset (.bin/.idx) use `mg-eval ppl --data-path PREFIX`",
            path,
            line,
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise EvalInputError(
            f"not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})", path, line
        ) from None
