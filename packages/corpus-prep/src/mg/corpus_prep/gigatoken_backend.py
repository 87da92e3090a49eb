"""gigatoken (a Rust BPE tokenizer) as the encoder of mg-prep's workers, where its ids are ours.

`--tokenizer-backend` picks it: `gigatoken` requires it, `classic` keeps
mg.core's tokenizers, and `auto` (default) takes gigatoken for the types in
`AUTO`, where it was measured faster. Only the batch of a chunk's sentences
goes through gigatoken, its ids straight into numpy (never a Python int per
token); reading, JSON, sentence splitting, errors and long texts stay on the
classic path, so the output is the same bytes whichever backend runs (tested
on each supported type).

Measured in process CPU seconds (user + sys; the machine was shared, so not
wall time), `mg-prep tokenize --workers 1 --append-eod` on 20 MB of JSON
lines: GPT2BPETokenizer 2.1-2.2 s classic (tiktoken) vs 1.7-1.8 s gigatoken,
1.3-1.4 s where Python's bytecode cache holds awkward (imported by gigatoken:
0.7 s to compile without it); GPTSentencePieceTokenizer 4.8-5.1 s vs
1.7-2.5 s. Per MB beyond a worker's start-up: GPT-2 about 0.08 vs 0.02 s,
and 4-7x faster on text whose words it had never seen (the corpus with its
letters rotated); a worker's start-up costs gigatoken about 0.8 s more, so on
a few MB per worker the classic path is the cheaper one: `auto` takes it below
`AUTO_MIN_BYTES_PER_WORKER` of known (uncompressed) input a worker. Measured
end to end with `bench/bench_prep.py --workers 2` on a quiet machine, gigatoken
against classic: GPT-2 1 MiB 2.8 vs 1.2 s, 4 MiB 2.8 vs 1.4 s, 8 MiB 2.9 vs
2.9 s, 64 MiB 3.6 vs 4.9 s; SentencePiece 2 MiB 2.2 vs 1.1 s, 8 MiB 2.6 vs
2.7 s. Peak RSS: 195 vs
100 MB for GPT-2, 160 vs 73 MB for SentencePiece (gigatoken's word cache;
bounded, see encoder.GIGATOKEN_REFRESH_CHARS).

Supported, and why the others are not:
- GPT2BPETokenizer: the vocab.json + merges.txt as one
  byte-level BPE tokenizer.json without added tokens, so a literal
  `<|endoftext|>` stays text, as in Megatron.
- GPTSentencePieceTokenizer: the .model converted by gigatoken, its
  `<s>`/`</s>` added tokens removed so that they stay text, as `sp.encode`
  leaves them.
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

import numpy as np

from mg.core.tokenizers import TokenizerConfig

BACKENDS = ("auto", "gigatoken", "classic")
SUPPORTED = ("GPT2BPETokenizer", "GPTSentencePieceTokenizer")
AUTO = SUPPORTED  # where `auto` picks gigatoken: where it was measured faster (see above)
AUTO_MIN_BYTES_PER_WORKER = 4 << 20
"""Below this much input a worker, `auto` takes the classic path: gigatoken's start-up costs
more than it saves (both took the same time at 8 MiB on 2 workers; see above)."""

# A batch of sentences to their token ids back to back (one array) and each one's
# number of ids (int64), in order.
BatchEncoder = Callable[[list[str]], tuple[np.ndarray, np.ndarray]]


class BackendError(ValueError):
    """--tokenizer-backend gigatoken asked for where it cannot run."""


def installed() -> bool:
    return importlib.util.find_spec("gigatoken") is not None


def resolve_backend(
    choice: str, tokenizer_type: str, input_bytes: int | None = None, workers: int = 1
) -> str:
    """The backend that runs (`gigatoken` or `classic`) for --tokenizer-backend `choice`;
    `input_bytes`: the text to encode where known (`auto` keeps the classic path for less
    than `AUTO_MIN_BYTES_PER_WORKER` a worker)."""
    if choice == "classic":
        return "classic"
    small = input_bytes is not None and input_bytes < AUTO_MIN_BYTES_PER_WORKER * max(workers, 1)
    if choice == "auto" and small:
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
    import awkward as ak  # lazy: gigatoken's dependency
    import gigatoken  # lazy: an optional dependency, and `--help` stays instant

    tokenizer = gigatoken.Tokenizer.from_json(_tokenizer_json(config))

    def encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        # An awkward array of arrays: its flat ids and lengths go to numpy as they are,
        # never one Python int per token.
        ids = tokenizer.encode_batch(texts, parallel=False)
        return ak.to_numpy(ak.flatten(ids, axis=1)), ak.to_numpy(ak.num(ids, axis=1))

    return encode


# A worker rebuilds its encoder now and then (see encoder.GIGATOKEN_REFRESH_CHARS): the
# tokenizer.json is made once per process (0.14 s for GPT-2), only parsed again.
_json_made: dict[tuple[str | None, ...], str] = {}


def _tokenizer_json(config: TokenizerConfig) -> str:
    files = (config.tokenizer_type, config.vocab_file, config.merge_file, config.tokenizer_model)
    if files in _json_made:
        return _json_made[files]
    if config.tokenizer_type == "GPT2BPETokenizer":
        assert config.vocab_file is not None and config.merge_file is not None
        data = gpt2_tokenizer_json(config.vocab_file, config.merge_file)
    elif config.tokenizer_type == "GPTSentencePieceTokenizer":
        assert config.tokenizer_model is not None
        data = sentencepiece_tokenizer_json(config.tokenizer_model)
    else:
        raise BackendError(f"--tokenizer-backend gigatoken: {config.tokenizer_type} unsupported")
    _json_made.clear()  # one tokenizer per worker: keep only the latest
    _json_made[files] = data
    return data
