"""The output folder, written atomically: everything goes to a hidden sibling folder,
which is renamed to ``--save`` only when complete (an interrupted run leaves no
``--save``; an existing one is replaced only with ``--overwrite``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from mg.core.checkpoint import RELEASE, mg_metadata, save_checkpoint_shards
from mg.core.io_paths import real_path, relation
from mg.core.models import TransformerConfig
from mg.core.quantization import QuantizationConfig
from mg.core.tokenizers.config import TokenizerConfig
from mg.quantize_export.errors import QuantizeInputError

TOKENIZER_DIR = "tokenizer"
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def check_target(save: Path, overwrite: bool) -> None:
    if save.exists() and not overwrite:
        raise QuantizeInputError(
            f"--save {save} already exists; choose another folder or pass --overwrite"
        )


@contextlib.contextmanager
def staged_output(save: Path, overwrite: bool) -> Iterator[Path]:
    """A folder to write into; renamed to ``save`` when the block ends without error."""
    check_target(save, overwrite)
    save.parent.mkdir(parents=True, exist_ok=True)
    staging = save.with_name(f".{save.name}.partial-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = save.with_name(f".{save.name}.old-{os.getpid()}")
    if save.exists():
        os.rename(save, old)
    os.rename(staging, save)
    shutil.rmtree(old, ignore_errors=True)


def staged_path(path: Path, save: Path, staging: Path) -> Path:
    """Where to write ``path`` during the run: one inside ``save`` goes into the staging
    folder and arrives with the output (written into ``save`` itself, it would block the
    final rename, or be deleted with the old ``save`` under --overwrite)."""
    if relation(path, save) != "inside":
        return path
    return staging / os.path.relpath(real_path(path), real_path(save))


def copy_tokenizer(config: TokenizerConfig | None, folder: Path) -> TokenizerConfig | None:
    """Copy the tokenizer's files into ``folder/tokenizer`` and name them relative to
    ``folder`` (core's loader resolves them), so the output is self-contained."""
    if config is None:
        return None
    config = dataclasses.replace(config)
    target = folder / TOKENIZER_DIR
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        value = getattr(config, name)
        if not value or not Path(value).exists():
            continue
        source = Path(value)
        target.mkdir(exist_ok=True)
        if source.is_dir():
            for file in _HF_TOKENIZER_FILES:
                if (source / file).is_file():
                    shutil.copy2(source / file, target / file)
            setattr(config, name, TOKENIZER_DIR)
        else:
            shutil.copy2(source, target / source.name)
            setattr(config, name, f"{TOKENIZER_DIR}/{source.name}")
    return config


def save_quantized(
    folder: Path,
    model: nn.Module,
    config: TransformerConfig,
    tokenizer_config: TokenizerConfig | None,
    quantization: QuantizationConfig,
    args: dict[str, Any],
) -> Path:
    """An mg `torch` checkpoint (iteration ``release``) whose metadata records the recipe."""
    meta = mg_metadata(config.to_dict(), tokenizer_config.to_dict() if tokenizer_config else None)
    meta["quantization"] = quantization.to_dict()
    state = {"model": model.state_dict(), "args": args, "iteration": 0, "mg": meta}
    return save_checkpoint_shards(folder, RELEASE, {(0, 0): state})
