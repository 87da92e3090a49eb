"""``build_tokenizer``: a TokenizerConfig (Megatron's flags) to a Tokenizer."""

from __future__ import annotations

import difflib

from .base import BaseTokenizer
from .config import TOKENIZER_TYPES, TokenizerConfig
from .gpt2_bpe import GPT2BPETokenizer
from .huggingface import HuggingFaceTokenizer
from .null import NullTokenizer
from .spm import GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer
from .tiktoken_bpe import TikTokenizer
from .wordpiece import BertWordPieceTokenizer


def build_tokenizer(config: TokenizerConfig) -> BaseTokenizer:
    """The tokenizer that Megatron builds for the same flags.

    Raises ValueError naming the flag (``--vocab-file`` ...) and the path when
    a file is missing or unreadable, and listing the known types when the type
    is unknown. The result carries ``config``, for checkpoints to record.
    """
    kind = config.tokenizer_type
    if kind not in TOKENIZER_TYPES:
        close = difflib.get_close_matches(str(kind), TOKENIZER_TYPES, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ValueError(
            f"unknown --tokenizer-type {kind!r}{hint}; known types: {', '.join(TOKENIZER_TYPES)}"
        )
    tokenizer: BaseTokenizer
    if kind in ("BertWordPieceLowerCase", "BertWordPieceCase"):
        tokenizer = BertWordPieceTokenizer(
            config.vocab_file,
            lower_case=kind == "BertWordPieceLowerCase",
            vocab_extra_ids=config.vocab_extra_ids,
        )
    elif kind == "GPT2BPETokenizer":
        tokenizer = GPT2BPETokenizer(config.vocab_file, config.merge_file)
    elif kind == "SentencePieceTokenizer":
        tokenizer = SentencePieceTokenizer(
            config.tokenizer_model, vocab_extra_ids=config.vocab_extra_ids
        )
    elif kind == "GPTSentencePieceTokenizer":
        tokenizer = GPTSentencePieceTokenizer(config.tokenizer_model)
    elif kind == "Llama2Tokenizer":
        tokenizer = Llama2Tokenizer(config.tokenizer_model)
    elif kind == "HuggingFaceTokenizer":
        tokenizer = HuggingFaceTokenizer(config.tokenizer_model)
    elif kind == "TikTokenizer":
        tokenizer = TikTokenizer(
            config.tokenizer_model,
            pattern=config.tiktoken_pattern,
            vocab_size=config.vocab_size,
            num_special_tokens=config.tiktoken_num_special_tokens,
            special_tokens=config.tokenizer_special_tokens,
        )
    else:  # NullTokenizer
        tokenizer = NullTokenizer(config.vocab_size)
    tokenizer.config = config
    return tokenizer
