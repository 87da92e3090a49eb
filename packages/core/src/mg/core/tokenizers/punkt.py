"""Install NLTK's punkt_tab sentence-splitting data from a Python-module copy of it.

``mg-prep --split-sentences`` uses NLTK punkt, whose model files normally
come from ``nltk.download("punkt_tab")`` (a web download; a misconfigured
data path is one of Megatron's known hangs). The ``punkt-english`` fixture
is the same English model expressed as Python literals; this writes it back
out in the punkt_tab layout NLTK reads:

    <nltk_data>/tokenizers/punkt_tab/english/
        abbrev_types.txt  sent_starters.txt  collocations.tab  ortho_context.tab

The module is read with ``ast`` (no code from it is executed).
"""

from __future__ import annotations

import ast
import os
import tempfile
from pathlib import Path
from typing import Any

from mg.core.fixtures import fixture_path

_FIELDS = ("ABBREV_TYPES", "SENT_STARTERS", "COLLOCATIONS", "ORTHO_CONTEXT")


def read_punkt_module(path: str | Path) -> dict[str, Any]:
    """The punkt parameters (and LANGUAGE) assigned as literals in a converted model module."""
    source = Path(path).read_text(encoding="utf-8")
    values: dict[str, Any] = {}
    for node in ast.parse(source, filename=str(path)).body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1):
            continue
        target = node.targets[0]
        if isinstance(target, ast.Name) and target.id in (*_FIELDS, "LANGUAGE"):
            values[target.id] = _literal(node.value, path)
    missing = [name for name in _FIELDS if name not in values]
    if missing:
        raise ValueError(f"{path}: not a punkt model module (no {', '.join(missing)})")
    return values


def _literal(node: ast.expr, path: str | Path) -> Any:
    # frozenset((...)) / set((...)) wrap a literal; everything else must be one.
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("frozenset", "set")
        and len(node.args) <= 1
        and not node.keywords
    ):
        return set(ast.literal_eval(node.args[0])) if node.args else set()
    try:
        return ast.literal_eval(node)
    except ValueError as err:
        raise ValueError(f"{path}, line {node.lineno}: not a literal ({err})") from None


def install_punkt_tab(
    nltk_data_dir: str | Path, model_module: str | Path | None = None, language: str | None = None
) -> Path:
    """Write the punkt_tab files under ``nltk_data_dir``; return the language folder.

    ``model_module`` defaults to the ``punkt-english`` fixture. Point
    ``NLTK_DATA`` (or ``nltk.data.path``) at ``nltk_data_dir`` and
    ``nltk.sent_tokenize(text, language="english")`` uses it. Files are
    written to a temporary name and renamed, so a concurrent reader never
    sees a half-written model.
    """
    if model_module is None:
        model_module = fixture_path("punkt-english", "english.py")
    params = read_punkt_module(model_module)
    language = language or params.get("LANGUAGE") or "english"
    target = Path(nltk_data_dir) / "tokenizers" / "punkt_tab" / language
    target.mkdir(parents=True, exist_ok=True)

    # One entry per line, sorted so that the files are reproducible. NLTK
    # strips only the trailing newline, so entries keep their inner spaces.
    files = {
        "abbrev_types.txt": _lines(sorted(params["ABBREV_TYPES"])),
        "sent_starters.txt": _lines(sorted(params["SENT_STARTERS"])),
        "collocations.tab": _lines("\t".join(pair) for pair in sorted(params["COLLOCATIONS"])),
        "ortho_context.tab": _lines(
            f"{typ}\t{int(flags)}" for typ, flags in sorted(params["ORTHO_CONTEXT"].items())
        ),
    }
    for name, text in files.items():
        _write_atomic(target / name, text)
    return target


def _lines(entries: Any) -> str:
    out = []
    for entry in entries:
        if "\n" in entry:
            raise ValueError(f"punkt entry {entry!r} contains a newline")
        out.append(entry + "\n")
    return "".join(out)


def _write_atomic(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes it private; data files are for everyone
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
