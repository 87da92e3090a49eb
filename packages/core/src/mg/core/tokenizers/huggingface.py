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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from .base import BaseTokenizer, as_id_list, clean_up_tokenization
from .long_text import cut_points
from .tiktoken_bpe import PATTERN_V1, PATTERN_V2

_FLAG = "--tokenizer-model"

# Steps of tokenizer.json under which a cut before a space between two ordinary
# characters is a pre-token boundary (long_text's argument); a tokenizer made of
# anything else is encoded whole. Normalizers that map one character at a time:
_LOCAL_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "BertNormalizer", "StripAccents"}
# Pre-tokenizers that split at every space, or split by one of these patterns:
_SPACE_SPLITTERS = {"BertPreTokenizer", "Whitespace", "WhitespaceSplit"}
_GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_KNOWN_PATTERNS = {
    _GPT2_PATTERN,
    _LLAMA3_PATTERN,
    _LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}"),  # Qwen2
    PATTERN_V1,
    PATTERN_V2,
}


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
            self._cuttable = cuttable(json.loads(self._tokenizer.to_str()))
            added = self._tokenizer.get_added_tokens_decoder().values()
            self._added = tuple(token.content for token in added)
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
            if len(text) > self.piece_chars and self._cuttable:
                return [i for ids in self._iter_pieces(text) for i in ids]
            return self._tokenizer.encode(text, add_special_tokens=True).ids
        return list(self._transformers(text).input_ids)

    def tokenize_in_pieces(self, text: str) -> Iterator[list[int]]:
        if self._tokenizer is not None and len(text) > self.piece_chars and self._cuttable:
            return self._iter_pieces(text)
        return iter([self.tokenize(text)])

    def _iter_pieces(self, text: str) -> Iterator[list[int]]:
        """The ids of ``encode(text)``, a piece at a time (long_text): the special tokens
        the post-processor puts before the text come with the first piece, those after it
        with the last."""
        assert self._tokenizer is not None
        bounds = [0, *cut_points(text, self.piece_chars, self._added), len(text)]
        last = len(bounds) - 2
        for k, (start, end) in enumerate(zip(bounds, bounds[1:], strict=False)):
            encoding = self._tokenizer.encode(text[start:end], add_special_tokens=k in (0, last))
            piece_ids, sequence = encoding.ids, encoding.sequence_ids
            begin, stop = 0, len(piece_ids)
            if k == 0 and last:  # keep the specials in front, drop those after
                while stop and sequence[stop - 1] is None:
                    stop -= 1
            elif k == last and k:  # keep the specials after, drop those in front
                while begin < stop and sequence[begin] is None:
                    begin += 1
            yield piece_ids[begin:stop]

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if self.has_long_text(texts):
            return [self.tokenize(text) for text in texts]
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


def cuttable(spec: dict[str, Any]) -> bool:
    """Whether a tokenizer.json's normalizer and pre-tokenizer allow long_text's cuts."""

    def normalizer_ok(step: dict[str, Any] | None) -> bool:
        if step is None:
            return True
        if step.get("type") == "Sequence":
            return all(normalizer_ok(s) for s in step.get("normalizers", []))
        return step.get("type") in _LOCAL_NORMALIZERS

    def splits_at_spaces(step: dict[str, Any] | None) -> bool:
        kind = step and step.get("type")
        if kind in _SPACE_SPLITTERS:
            return True
        if kind == "ByteLevel":
            return step.get("use_regex", True)  # GPT-2's pattern
        if kind == "Metaspace":
            return step.get("split", True)
        if kind == "Split":
            pattern = step.get("pattern", {}).get("Regex")
            isolated = step.get("behavior") == "Isolated" and not step.get("invert", False)
            return isolated and pattern in _KNOWN_PATTERNS
        return False

    def harmless(step: dict[str, Any]) -> bool:  # maps pre-tokens one by one
        return step.get("type") == "ByteLevel" and not step.get("use_regex", True)

    pre = spec.get("pre_tokenizer")
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre]
    if not steps or not splits_at_spaces(steps[0]):
        return False
    rest_ok = all(splits_at_spaces(s) or harmless(s) for s in steps[1:])
    return rest_ok and normalizer_ok(spec.get("normalizer"))


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
