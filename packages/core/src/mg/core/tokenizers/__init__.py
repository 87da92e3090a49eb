"""Megatron's tokenizer types behind one ``Tokenizer`` interface.

    from mg.core.tokenizers import TokenizerConfig, build_tokenizer
    tok = build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=..., merge_file=...))
    ids = tok.tokenize("Hello world")          # [15496, 995]
    tok.detokenize(ids), tok.eod, tok.vocab_size

Ids match Megatron-LM's classic (``--legacy-tokenizer``) tokenizers, so
datasets written here and by Megatron's preprocess_data.py are identical.
"""

from .base import BaseTokenizer, Tokenizer
from .build import build_tokenizer
from .config import TOKENIZER_TYPES, TokenizerConfig, vocab_size_with_padding
from .gpt2_bpe import GPT2BPETokenizer
from .huggingface import HuggingFaceTokenizer
from .null import NullTokenizer
from .spm import GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer
from .tiktoken_bpe import TikTokenizer
from .wordpiece import BertWordPieceTokenizer

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
