"""gigatoken (a Rust BPE tokenizer) as the encoder of mg-prep's workers, where its ids are ours.

`--tokenizer-backend` picks it: `gigatoken` requires it, `classic` keeps
mg.core's tokenizers, and `auto` (default) takes gigatoken for the types in
`AUTO` — none for now: measured end to end (20 MiB of non-repeating GPT-2 text,
2 workers, AVX-512 machine, load 5), the classic path (tiktoken) ran at 4.7 MB/s
and 290 MB, the gigatoken backend at 3.5 MB/s and 475 MB. Only the batch of a
chunk's sentences goes through gigatoken; reading, JSON, sentence splitting,
errors and long texts stay on the classic path, so the output is the same
bytes whichever backend runs (tested on each supported type).

Supported, and why the others are not:
- GPT2BPETokenizer: the vocab.json + merges.txt as one
  byte-level BPE tokenizer.json without added tokens, so a literal
  `<|endoftext|>` stays text, as in Megatron.
- GPTSentencePieceTokenizer (only when asked for): the .model converted by
  gigatoken, its `<s>`/`</s>` added tokens removed so that they stay text, as
  `sp.encode` leaves them. Not under `auto`: on this machine it was 2-4x
  sentencepiece's speed on text it had seen and 10x slower on text it had not
  (its caches warming), so which is faster depends on the corpus.
- not yet: HuggingFaceTokenizer (added tokens found in the text and
  normalizers must first be shown to match `tokenizers`), Llama2Tokenizer
  (bos per sentence), SentencePieceTokenizer (Megatron's looks for its special
  tokens in the text itself), TikTokenizer (tiktoken is already Rust),
  WordPiece.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

from mg.core.tokenizers import TokenizerConfig

BACKENDS = ("auto", "gigatoken", "classic")
SUPPORTED = ("GPT2BPETokenizer", "GPTSentencePieceTokenizer")
AUTO: tuple[str, ...] = ()  # where `auto` picks gigatoken: where it was measured faster

# A batch of sentences to their token ids, in order.
BatchEncoder = Callable[[list[str]], list[list[int]]]


class BackendError(ValueError):
    """--tokenizer-backend gigatoken asked for where it cannot run."""


def installed() -> bool:
    return importlib.util.find_spec("gigatoken") is not None


def resolve_backend(choice: str, tokenizer_type: str) -> str:
    """The backend that runs (`gigatoken` or `classic`) for --tokenizer-backend `choice`."""
    if choice == "classic":
        return "classic"
    if tokenizer_type not in SUPPORTED:
        if choice == "gigatoken":
            raise BackendError(
                f"--tokenizer-backend gigatoken: not available for {tokenizer_type} (only "
                f"{', '.join(SUPPORTED)}); use --tokenizer-backend classic or auto"
            )
        return "classic"
    if choice == "auto" and tokenizer_type not in AUTO:
        return "classic"
    if not installed():
        if choice == "gigatoken":
            raise BackendError(
                "--tokenizer-backend gigatoken: the gigatoken package is not installed; "
                "install mg-corpus-prep[gigatoken] or use --tokenizer-backend classic"
            )
        return "classic"
    return "gigatoken"


def gpt2_tokenizer_json(vocab_file: str, merge_file: str) -> str:
    """GPT-2's vocab.json + merges.txt as a Hugging Face tokenizer.json, without added tokens."""
    from mg.core.tokenizers.gpt2_bpe import read_merges  # lazy: pulls tiktoken and tokenizers

    vocab = json.loads(Path(vocab_file).read_text(encoding="utf-8"))
    merges = [f"{a} {b}" for a, b in read_merges(Path(merge_file))]
    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": True,
        "use_regex": True,
    }
    return json.dumps(
        {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [],
            "normalizer": None,
            "pre_tokenizer": byte_level,
            "post_processor": None,
            "decoder": byte_level,
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": "",
                "end_of_word_suffix": "",
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": vocab,
                "merges": merges,
            },
        }
    )


def sentencepiece_tokenizer_json(model_file: str) -> str:
    """A SentencePiece .model as gigatoken's tokenizer.json, with no added tokens: `sp.encode`
    reads `<s>` and `</s>` in a text as text."""
    # The converter gigatoken.Tokenizer.from_sentencepiece uses, before it is loaded.
    from gigatoken._load.sentencepiece import sentencepiece_to_tokenizer_json  # lazy: optional

    data = json.loads(sentencepiece_to_tokenizer_json(Path(model_file).read_bytes()))
    data["added_tokens"] = []
    return json.dumps(data)


def build_batch_encoder(config: TokenizerConfig) -> BatchEncoder:
    """gigatoken's encoder for `config`, one core: the workers are the parallelism."""
    import gigatoken  # lazy: an optional dependency, and `--help` stays instant

    if config.tokenizer_type == "GPT2BPETokenizer":
        assert config.vocab_file is not None and config.merge_file is not None
        data = gpt2_tokenizer_json(config.vocab_file, config.merge_file)
    elif config.tokenizer_type == "GPTSentencePieceTokenizer":
        assert config.tokenizer_model is not None
        data = sentencepiece_tokenizer_json(config.tokenizer_model)
    else:
        raise BackendError(f"--tokenizer-backend gigatoken: {config.tokenizer_type} unsupported")
    tokenizer = gigatoken.Tokenizer.from_json(data)

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer.encode_batch_list(texts, parallel=False)

    return encode
