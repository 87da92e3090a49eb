"""Reading a Hugging Face model folder: where it is, its config, its tensors one by one.

Weights are never loaded as a whole. `HFWeights` knows which file holds each
tensor (from `model.safetensors.index.json`, or the single file's header) and
`open_group` reads only the tensors asked for, through a `safe_open` handle
that is closed afterwards, so the memory-mapped pages are released after each
layer and peak memory stays near one copy of the model (the converted one).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from torch import Tensor

from mg.ckpt_convert.architectures import SUPPORTED_MODEL_TYPES
from mg.ckpt_convert.errors import ConvertError
from mg.core.checkpoint.reader_guard import open_safetensors, read_json, read_weight_map, torch_load
from mg.core.models.hf_mapping import UNSUPPORTED_MODEL_TYPES

SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_INDEX = "pytorch_model.bin.index.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def resolve_source(src: str) -> Path:
    """A local folder as is; otherwise a Hub repo id, from the local cache when offline."""
    path = Path(src).expanduser()
    if path.is_dir():
        return path
    if path.exists() or src.startswith((".", "/", "~")) or src.count("/") > 1:
        raise ConvertError(f"{src} is not a folder with a Hugging Face model (config.json)")
    # lazy: huggingface_hub brings its HTTP stack; only a Hub repo id needs it
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt"]
    attempts = [True] if _offline() else [False, True]
    last: Exception | None = None
    for local_only in attempts:
        try:
            return Path(
                snapshot_download(src, allow_patterns=patterns, local_files_only=local_only)
            )
        except Exception as exc:  # hub errors have many types; all mean "not available"
            last = exc
    raise ConvertError(
        f"{src!r} is not a local folder, and as a Hugging Face repo id it is not in the "
        f"local cache and no network is available ({type(last).__name__}). Download it on a "
        "machine with network (huggingface-cli download REPO) or pass a local folder."
    )


def read_hf_config(folder: Path) -> dict[str, Any]:
    """config.json, checked to be an architecture we convert."""
    path = folder / "config.json"
    if not path.is_file():
        raise ConvertError(f"{folder} has no config.json: not a Hugging Face model folder")
    config = read_json(path)
    if not isinstance(config, dict):
        raise ConvertError(f"{path}: expected a JSON object (a Hugging Face config)")
    model_type = config.get("model_type")
    if model_type in UNSUPPORTED_MODEL_TYPES:
        raise ConvertError(
            f"{path}: model_type {model_type!r} is not supported yet "
            f"({UNSUPPORTED_MODEL_TYPES[model_type]}); supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    if model_type not in SUPPORTED_MODEL_TYPES and _is_vision(config):
        name = (config.get("architectures") or [model_type])[0]
        raise ConvertError(
            f"{path}: {name} (model_type {model_type!r}) is a vision model import-hf does "
            "not convert; the vision towers it converts are CLIPVisionModel and "
            "SiglipVisionModel (and LlavaForConditionalGeneration with either)"
        )
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConvertError(
            f"{path}: unsupported architecture {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def _is_vision(config: dict[str, Any]) -> bool:
    """A vision model's (or an image-text pair's) config: a patch size, or a tower's."""
    return "patch_size" in config or "vision_config" in config


class HFWeights:
    """Names of the tensors in a model folder and the file each one is in."""

    def __init__(
        self, folder: Path, prefix: str = "", head_prefixes: tuple[str, ...] = ("lm_head.",)
    ) -> None:
        self.folder = folder
        self.files: dict[str, Path] = {}  # tensor name (prefixed) -> file
        self._stored: dict[str, str] = {}  # tensor name (prefixed) -> name in the file
        for name, file in self._scan().items():
            self.files[name] = file
            self._stored[name] = name
        # Checkpoints saved from the base class (openai-community/gpt2, a BertModel)
        # lack the "transformer."/"model."/"bert." prefix: add it, keep the stored
        # name for reading.
        if prefix and not any(n.startswith(prefix) for n in self.files):
            self.files = {
                (n if n.startswith(head_prefixes) else prefix + n): f for n, f in self.files.items()
            }
            self._stored = {
                (n if n.startswith(head_prefixes) else prefix + n): n for n in self._stored
            }

    def _scan(self) -> dict[str, Path]:
        folder = self.folder
        for index_name in (SAFETENSORS_INDEX, BIN_INDEX):
            index = folder / index_name
            if index.is_file():
                weight_map = read_weight_map(index)
                missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
                if missing:
                    raise ConvertError(
                        f"{index} lists {len(missing)} shard(s) that are not in {folder}: "
                        f"{', '.join(missing[:5])} (incomplete download?)"
                    )
                return {name: folder / file for name, file in weight_map.items()}
        single = folder / "model.safetensors"
        if single.is_file():
            with open_safetensors(single) as handle:
                return dict.fromkeys(handle.keys(), single)
        single = folder / "pytorch_model.bin"
        if single.is_file():
            state = torch_load(single, mmap=True)
            return dict.fromkeys(state, single)
        raise ConvertError(
            f"{folder} has no weights: expected model.safetensors, {SAFETENSORS_INDEX} with "
            "its shards, or pytorch_model.bin"
        )

    def names(self) -> list[str]:
        return list(self.files)

    @contextmanager
    def open_group(self, names: Iterable[str]) -> Iterator[dict[str, Tensor]]:
        """Read `names` (and only them); the files are closed when the block ends."""
        names = list(names)
        out: dict[str, Tensor] = {}
        with ExitStack() as stack:
            handles: dict[Path, Any] = {}
            for name in names:
                file = self.files[name]
                if file not in handles:
                    handles[file] = self._open(file, stack)
                out[name] = self._read(handles[file], self._stored[name], file)
            yield out

    @staticmethod
    def _open(file: Path, stack: ExitStack) -> Any:
        if file.suffix == ".safetensors":
            return stack.enter_context(open_safetensors(file))
        return torch_load(file, mmap=True)

    @staticmethod
    def _read(handle: Any, name: str, file: Path) -> Tensor:
        try:
            return handle.get_tensor(name) if hasattr(handle, "get_tensor") else handle[name]
        except Exception as exc:
            raise ConvertError(
                f"{file}: tensor {name!r} is missing or unreadable ({exc})"
            ) from None


def tokenizer_files(folder: Path) -> list[Path]:
    """The tokenizer files present in a model folder."""
    return [folder / name for name in TOKENIZER_FILES if (folder / name).is_file()]
