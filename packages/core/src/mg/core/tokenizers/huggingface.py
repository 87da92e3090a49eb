"""HuggingFaceTokenizer: a local Hugging Face tokenizer folder, offline.

Megatron calls ``transformers.AutoTokenizer.from_pretrained(path)`` and
tokenizes with ``tokenizer(text).input_ids``, i.e. *with* the model's
special tokens (BOS for Llama, [CLS]/[SEP] for BERT). We load the folder's
``tokenizer.json`` with ``tokenizers`` directly, which is what a fast
transformers tokenizer runs, and read the special tokens from
``tokenizer_config.json`` / ``special_tokens_map.json``. Only a folder with no
``tokenizer.json`` needs ``transformers`` (imported then, offline).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from .base import BaseTokenizer, as_id_list, clean_up_tokenization

_FLAG = "--tokenizer-model"


class HuggingFaceTokenizer(BaseTokenizer):
    """Megatron's ``_HuggingFaceTokenizer``: eod = eos_token_id, vocab_size = len(tokenizer)."""

    name = "HuggingFaceTokenizer"

    def __init__(self, path: str | Path | None) -> None:
        super().__init__()
        if path is None or str(path) == "":
            raise ValueError(
                f"{self.name} needs {_FLAG} (a folder with tokenizer.json); none was given"
            )
        location = Path(path).expanduser()
        if location.is_dir():
            folder, tokenizer_json = location, location / "tokenizer.json"
        elif location.is_file() and location.suffix == ".json":
            folder, tokenizer_json = location.parent, location
        else:
            problem = "does not exist" if not location.exists() else "is not a folder nor a .json"
            raise ValueError(f"{_FLAG} {path}: {problem} (a folder with tokenizer.json)")
        config = _read_special_config(folder)
        self._cleanup = bool(config.get("clean_up_tokenization_spaces", False))
        self._transformers: Any = None

        if tokenizer_json.is_file():
            try:
                self._tokenizer: HFTokenizer | None = HFTokenizer.from_file(str(tokenizer_json))
            except Exception as err:  # the Rust side raises a bare Exception
                raise ValueError(
                    f"{_FLAG} {tokenizer_json}: not a tokenizers file ({err})"
                ) from err
            # transformers' tokenizer(text) neither pads nor truncates unless asked,
            # whatever tokenizer.json says (sentence-transformers files pad to 128),
            # but it takes the pad token from there when the config has none.
            padding = self._tokenizer.padding
            if padding and "pad_token" not in config:
                config["pad_token"] = padding["pad_token"]
            self._tokenizer.no_padding()
            self._tokenizer.no_truncation()
            self._cleanup = self._cleanup and type(self._tokenizer.model).__name__ != "BPE"
            self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
            token_id = self._tokenizer.token_to_id
        elif (folder / "tokenizer_config.json").is_file():  # a slow-only tokenizer
            self._tokenizer = None
            self._transformers = _load_with_transformers(folder)
            self.vocab_size = len(self._transformers)
            token_id = self._transformers.convert_tokens_to_ids
        else:
            raise ValueError(f"{_FLAG} {path}: has no tokenizer.json (nor tokenizer_config.json)")

        def special(key: str) -> int | None:
            token = _token_text(config.get(key))
            if token is None and self._transformers is not None:
                return getattr(self._transformers, f"{key}_id", None)
            return None if token is None else token_id(token)

        self.bos = special("bos_token")
        self.eos = special("eos_token")
        self.eod = self.eos
        self.pad = special("pad_token")
        self.cls = special("cls_token")
        self.sep = special("sep_token")
        self.mask = special("mask_token")
        extra = [_token_text(t) for t in config.get("additional_special_tokens") or []]
        ids = [token_id(t) for t in extra if t is not None]
        self.additional_special_tokens_ids = [i for i in ids if i is not None]

    def tokenize(self, text: str) -> list[int]:
        if self._tokenizer is not None:
            return self._tokenizer.encode(text, add_special_tokens=True).ids
        return list(self._transformers(text).input_ids)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self._tokenizer is not None:
            encodings = self._tokenizer.encode_batch_fast(texts, add_special_tokens=True)
            return [e.ids for e in encodings]
        return [list(ids) for ids in self._transformers(list(texts)).input_ids]

    def detokenize(self, ids: Sequence[int]) -> str:
        ids = as_id_list(ids)
        if self._tokenizer is None:
            return self._transformers.decode(ids)
        text = self._tokenizer.decode(ids, skip_special_tokens=False)
        return clean_up_tokenization(text) if self._cleanup else text

    def id_to_token(self, i: int) -> str:
        """The raw vocabulary entry, as Megatron's server (``tokenizer.decoder[id]``)."""
        if self._tokenizer is None:
            return self._transformers.convert_ids_to_tokens(i)
        token = self._tokenizer.id_to_token(i)
        if token is None:
            raise KeyError(f"token id {i} is not in the vocabulary (size {self.vocab_size})")
        return token


def _read_special_config(folder: Path) -> dict[str, Any]:
    """special_tokens_map.json overlaid with tokenizer_config.json, as transformers reads them."""
    merged: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        file = folder / name
        if not file.is_file():
            continue
        try:
            with file.open(encoding="utf-8") as f:
                data = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{_FLAG} {file}: not valid JSON ({err})") from err
        merged.update({k: v for k, v in data.items() if v is not None})
    return merged


def _token_text(value: Any) -> str | None:
    # A token is stored as a string or as a serialized AddedToken {"content": ...}.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _load_with_transformers(folder: Path) -> Any:
    try:
        from transformers import AutoTokenizer  # lazy: transformers is optional
    except ImportError:
        raise ValueError(
            f"{_FLAG} {folder}: has no tokenizer.json; reading a slow-only Hugging Face "
            "tokenizer needs the transformers package (pip install transformers)"
        ) from None
    try:
        return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"{_FLAG} {folder}: transformers could not load it ({err})") from err
