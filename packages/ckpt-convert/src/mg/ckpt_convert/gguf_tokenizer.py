"""A GGUF file's vocabulary (``tokenizer.ggml.*``) as a Hugging Face ``tokenizer.json`` +
``tokenizer_config.json``, which mg's HuggingFaceTokenizer (and transformers) load.

Two kinds of vocabulary, as llama.cpp has them:

- ``gpt2``: byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen2/3). Tokens and merges are
  stored as they are; ``tokenizer.ggml.pre`` names the pre-tokenizer regex, which we
  rebuild as the model's own tokenizer.json has it.
- ``llama``: SentencePiece BPE (Llama 2, Mistral). GGUF keeps pieces and scores but no
  merges; a merge is every split of a piece into two pieces, ranked by the piece's
  score (what sentencepiece's BPE does, and transformers' converter writes).

Control tokens become special added tokens, user-defined ones plain added tokens, so
both are matched in raw text as llama.cpp matches them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mg.ckpt_convert.errors import ConvertError

# llama.cpp's token types (gguf.TokenType)
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
# tokenizer.ggml.pre → (digits split one by one first, regex or None for GPT-2's own)
_BPE_PRE = {
    "default": (False, None),
    "gpt-2": (False, None),
    "smollm": (True, None),
    "starcoder": (True, None),
    "refact": (True, None),
    "llama-bpe": (False, _LLAMA3_REGEX),
    "llama3": (False, _LLAMA3_REGEX),
    "qwen2": (False, _QWEN2_REGEX),
}
_IGNORE_MERGES = ("llama-bpe", "llama3")  # whole-word vocabulary entries win (llama.cpp)


def _pre_tokenizer(pre: str, path: Path) -> Any:
    # lazy: tokenizers only when a GGUF file is converted
    from tokenizers import Regex, pre_tokenizers

    if pre not in _BPE_PRE:
        raise ConvertError(
            f"{path}: tokenizer.ggml.pre {pre!r} is not a pre-tokenizer import-gguf knows; "
            f"known: {', '.join(_BPE_PRE)}"
        )
    digits, regex = _BPE_PRE[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if regex is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE's merges: each split of a piece into two pieces, the pieces with
    the highest score merged first (ties: the lower ids first)."""
    ids = {token: i for i, token in enumerate(tokens)}
    ranked = []
    for token, score in zip(tokens, scores, strict=True):
        local = [(token[:cut], token[cut:]) for cut in range(1, len(token)) if token[:cut] in ids]
        local = [pair for pair in local if pair[1] in ids]
        local.sort(key=lambda pair: (ids[pair[0]], ids[pair[1]]))
        ranked.extend((score, pair) for pair in local)
    ranked.sort(key=lambda item: -item[0])  # stable: equal scores keep their order
    return [pair for _, pair in ranked]


def _special(meta: dict[str, Any], tokens: list[str], name: str) -> str | None:
    index = meta.get(f"tokenizer.ggml.{name}_token_id")
    if index is None or not 0 <= int(index) < len(tokens):
        return None
    return tokens[int(index)]


def adds_bos(meta: dict[str, Any]) -> bool:
    """tokenizer.ggml.add_bos_token, else llama.cpp's default: on for SentencePiece and
    Llama 3's BPE, off for other BPE vocabularies."""
    if "tokenizer.ggml.add_bos_token" in meta:
        return bool(meta["tokenizer.ggml.add_bos_token"])
    model, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre")
    return model == "llama" or pre in _IGNORE_MERGES


def _post_processor(bos: str | None, eos: str | None, meta: dict[str, Any], ids: dict) -> Any:
    """BOS / EOS added to every text as the file says (llama.cpp's add_bos/add_eos)."""
    # lazy: tokenizers only when a GGUF file is converted
    from tokenizers import processors

    model = meta.get("tokenizer.ggml.model")
    add_bos = adds_bos(meta) and bos
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos
    if not add_bos and not add_eos:
        return processors.ByteLevel(trim_offsets=False) if model == "gpt2" else None
    first = [bos] if add_bos else []
    last = [eos] if add_eos else []
    single = " ".join([*first, "$A", *last])
    pair = " ".join([*first, "$A", *last, *first, "$B", *last])
    special = [(t, ids[t]) for t in dict.fromkeys([*first, *last])]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_tokenizer(meta: dict[str, Any], path: Path) -> Any:
    """The `tokenizers.Tokenizer` the file's vocabulary describes (None: it has none)."""
    # lazy: tokenizers only when a GGUF file is converted
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    model = meta.get("tokenizer.ggml.model")
    if model in (None, "none", "no_vocab"):
        return None
    tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens") or []]
    if not tokens:
        raise ConvertError(f"{path}: tokenizer.ggml.tokens is missing or empty")
    types = list(meta.get("tokenizer.ggml.token_type") or [_NORMAL] * len(tokens))
    ids = {token: i for i, token in enumerate(tokens)}
    if len(ids) != len(tokens):
        raise ConvertError(f"{path}: tokenizer.ggml.tokens holds the same token twice")
    unk = _special(meta, tokens, "unknown")
    if model == "gpt2":
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or []]
        pre = str(meta.get("tokenizer.ggml.pre", "default"))
        bpe = models.BPE(vocab=ids, merges=merges, ignore_merges=pre in _IGNORE_MERGES)
        tokenizer = Tokenizer(bpe)
        tokenizer.pre_tokenizer = _pre_tokenizer(pre, path)
        tokenizer.decoder = decoders.ByteLevel()
    elif model == "llama":
        scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)]
        bpe = models.BPE(
            vocab=ids,
            merges=spm_merges(tokens, scores),
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=True,
        )
        tokenizer = Tokenizer(bpe)
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
        steps = [normalizers.Prepend("▁")] if prefix else []
        tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
        decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        if prefix:
            decode.append(decoders.Strip(" ", 1, 0))
        tokenizer.decoder = decoders.Sequence(decode)
    else:
        raise ConvertError(
            f"{path}: tokenizer.ggml.model {model!r} is not supported; import-gguf reads "
            "'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)"
        )
    special = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
    user = [t for t, kind in zip(tokens, types, strict=True) if kind == _USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    post = _post_processor(_special(meta, tokens, "bos"), _special(meta, tokens, "eos"), meta, ids)
    if post is not None:
        tokenizer.post_processor = post
    return tokenizer


def tokenizer_config(meta: dict[str, Any], context: int) -> dict[str, Any]:
    """tokenizer_config.json: the special tokens by text and the chat template."""
    tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens") or []]
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": adds_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context,
    }
    for name, key in (
        ("bos", "bos_token"),
        ("eos", "eos_token"),
        ("unknown", "unk_token"),
        ("padding", "pad_token"),
    ):
        token = _special(meta, tokens, name)
        if token is not None:
            config[key] = token
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return config


def write_tokenizer(meta: dict[str, Any], path: Path, folder: Path, context: int) -> bool:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into
    `folder` (created); False when the file carries no vocabulary."""
    tokenizer = build_tokenizer(meta, path)
    if tokenizer is None:
        return False
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = tokenizer_config(meta, context)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {k: v for k, v in config.items() if k.endswith("_token") and isinstance(v, str)}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return True
