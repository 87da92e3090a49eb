"""Megatron's tokenizer types behind one ``Tokenizer`` interface.

    from mg.core.tokenizers import TokenizerConfig, build_tokenizer
    tok = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=..., merge_file=...))
    ids = tok.tokenize("Hello world")          # [15496, 995]
    tok.detokenize(ids), tok.eod, tok.vocab_size

Ids match Megatron-LM's classic (``--legacy-tokenizer``) tokenizers, so
datasets written here and by Megatron's preprocess_data.py are identical.
"""

import importlib
from typing import TYPE_CHECKING

from .config import TOKENIZER_TYPES, TokenizerConfig, vocab_size_with_padding

if TYPE_CHECKING:
    from .base import BaseTokenizer, Tokenizer
    from .build import build_tokenizer
    from .gpt2_bpe import GPT2BPETokenizer
    from .huggingface import HuggingFaceTokenizer
    from .null import NullTokenizer
    from .spm import GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer
    from .tiktoken_bpe import TikTokenizer
    from .wordpiece import BertWordPieceTokenizer

# The engines (tokenizers, tiktoken, sentencepiece) load on first use of a name below,
# so that a command's --help, which only needs TOKENIZER_TYPES, stays instant.
_LAZY = {
    "BaseTokenizer": "base",
    "Tokenizer": "base",
    "build_tokenizer": "build",
    "GPT2BPETokenizer": "gpt2_bpe",
    "HuggingFaceTokenizer": "huggingface",
    "NullTokenizer": "null",
    "GPTSentencePieceTokenizer": "spm",
    "Llama2Tokenizer": "spm",
    "SentencePieceTokenizer": "spm",
    "TikTokenizer": "tiktoken_bpe",
    "BertWordPieceTokenizer": "wordpiece",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


__all__ = [
    "TOKENIZER_TYPES",
    "BaseTokenizer",
    "BertWordPieceTokenizer",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TikTokenizer",
    "Tokenizer",
    "TokenizerConfig",
    "build_tokenizer",
    "vocab_size_with_padding",
]
