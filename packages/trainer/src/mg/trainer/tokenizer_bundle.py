"""A checkpoint carries its tokenizer: the files are copied into `<save>/tokenizer/`.

Recording `--vocab-file /home/me/.cache/.../vocab.json` in a checkpoint ties it to
one machine; a Hugging Face folder instead holds its tokenizer files. So the
trainer copies the tokenizer's files (vocabulary, merges, SentencePiece model)
into the save folder once and records them relative to it (`tokenizer/vocab.json`);
the readers (`load_model`, `--use-checkpoint-args`, mg-convert export-hf) resolve
relative paths against the folder they load, so the checkpoint can be moved or
shared. A value that is not a local file (a Hugging Face Hub name) is kept as given.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from mg.core.tokenizers import TokenizerConfig

FOLDER = "tokenizer"
PATH_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")


def _local_file(value: str | None, save: Path) -> Path | None:
    if not value:
        return None
    path = Path(value)
    if not path.is_absolute() and (save / path).exists():
        path = save / path  # already inside this checkpoint folder (a resumed run)
    return path if path.is_file() else None


def bundled_config(save: str | Path, config: TokenizerConfig) -> dict[str, Any]:
    """`config` as saved: each local file named by its place under `<save>/tokenizer/`."""
    save = Path(save)
    data = config.to_dict()
    for field in PATH_FIELDS:
        if _local_file(data.get(field), save) is not None:
            data[field] = f"{FOLDER}/{Path(data[field]).name}"
    return data


def copy_tokenizer_files(save: str | Path, config: TokenizerConfig) -> list[Path]:
    """Copy the local tokenizer files into `<save>/tokenizer/` (atomically; skipped when
    the same file is already there). Returns the files in the checkpoint."""
    save = Path(save)
    target = save / FOLDER
    copied = []
    for field in PATH_FIELDS:
        source = _local_file(getattr(config, field), save)
        if source is None:
            continue
        dest = target / source.name
        copied.append(dest)
        if dest.exists() and os.path.samefile(source, dest):
            continue
        target.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        try:
            shutil.copyfile(source, partial)
            os.replace(partial, dest)
        finally:
            partial.unlink(missing_ok=True)
    return copied
