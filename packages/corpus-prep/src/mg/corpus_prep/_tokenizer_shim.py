# ruff: noqa
"""TEMPORARY stand-in for mg.core.tokenizers until it lands; delete afterwards."""

from __future__ import annotations

import json
from dataclasses import dataclass

TOKENIZER_TYPES = ("BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer")


@dataclass
class TokenizerConfig:
    tokenizer_type: str
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_extra_ids: int = 0
    tiktoken_pattern: str | None = None
    tiktoken_num_special_tokens: int = 1000
    tokenizer_special_tokens: list[str] | None = None


class _Tok:
    def tokenize(self, text):
        return self._tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts):
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids):
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def id_to_token(self, i):
        return self._tok.id_to_token(i)


def build_tokenizer(config):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    t = _Tok()
    t.name = config.tokenizer_type
    if config.tokenizer_type == "GPT2BPETokenizer":
        vocab = json.load(open(config.vocab_file, encoding="utf-8"))
        merges = []
        for line in open(config.merge_file, encoding="utf-8").read().split("\n")[1:]:
            if line:
                a, b = line.split(" ")
                merges.append((a, b))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        t._tok = tok
        t.vocab_size = len(vocab)
        t.eod = vocab["<|endoftext|>"]
    else:
        lower = config.tokenizer_type == "BertWordPieceLowerCase"
        vocab = {}
        for i, line in enumerate(open(config.vocab_file, encoding="utf-8")):
            vocab[line.rstrip("\n")] = i
        tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=200))
        tok.normalizer = normalizers.BertNormalizer(
            clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lower
        )
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        t._tok = tok
        t.vocab_size = len(vocab) + 2
        t.eod = len(vocab) + 1
    return t
