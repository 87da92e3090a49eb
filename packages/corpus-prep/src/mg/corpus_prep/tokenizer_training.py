"""Train a tokenizer from a stream of texts, writing the files Megatron's tokenizers read.

- byte-level-bpe (HF tokenizers): vocab.json + merges.txt, read by GPT2BPETokenizer;
- wordpiece (HF tokenizers): vocab.txt with [PAD] [UNK] [CLS] [SEP] [MASK] first,
  read by BertWordPieceLowerCase (BertWordPieceCase when trained `cased`);
- sentencepiece: tokenizer.model (+ .vocab), read by SentencePieceTokenizer,
  GPTSentencePieceTokenizer and Llama2Tokenizer.

Texts are consumed as an iterator, never held as a list: the trainers keep
word/pair counts, which grow with the vocabulary of the corpus, not its size.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import sentencepiece as spm
from tokenizers import BertWordPieceTokenizer, ByteLevelBPETokenizer

TokenizerKind = Literal["byte-level-bpe", "wordpiece", "sentencepiece"]
KINDS: tuple[str, ...] = ("byte-level-bpe", "wordpiece", "sentencepiece")

GPT2_EOD = "<|endoftext|>"
BERT_SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SENTENCEPIECE_PREFIX = "tokenizer"
# SentencePiece skips "sentences" longer than this many bytes; we feed it lines.
SENTENCEPIECE_MAX_LINE_BYTES = 1 << 16


class TrainingError(Exception):
    """The trainer refused the corpus or the settings (e.g. a vocabulary the text cannot fill)."""


@dataclass(frozen=True)
class TrainOptions:
    kind: TokenizerKind
    vocab_size: int
    min_frequency: int = 2
    cased: bool = False  # wordpiece: keep case (BertWordPieceCase)
    spm_model_type: Literal["bpe", "unigram"] = "bpe"
    character_coverage: float = 0.9995
    byte_fallback: bool = False
    seed: int = 1234


def train_tokenizer(
    texts: Iterable[str], output_dir: str | os.PathLike[str], options: TrainOptions
) -> dict[str, str]:
    """Train on `texts`; return the written files as ``{megatron flag: path}``.

    The flags are those `mg-prep tokenize` / `mg-train` take to load the result,
    e.g. ``{"--vocab-file": ".../vocab.json", "--merge-file": ".../merges.txt"}``.
    """
    directory = Path(output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    if options.kind == "byte-level-bpe":
        return _train_byte_level_bpe(iter(texts), directory, options)
    if options.kind == "wordpiece":
        return _train_wordpiece(iter(texts), directory, options)
    if options.kind == "sentencepiece":
        return _train_sentencepiece(iter(texts), directory, options)
    raise ValueError(f"unknown tokenizer type {options.kind!r}; choose from {', '.join(KINDS)}")


def megatron_tokenizer_type(options: TrainOptions) -> str:
    """The `--tokenizer-type` that reads what `options` trains."""
    if options.kind == "byte-level-bpe":
        return "GPT2BPETokenizer"
    if options.kind == "wordpiece":
        return "BertWordPieceCase" if options.cased else "BertWordPieceLowerCase"
    return "GPTSentencePieceTokenizer"


def _train_byte_level_bpe(
    texts: Iterator[str], directory: Path, options: TrainOptions
) -> dict[str, str]:
    # GPT-2's byte-level pre-tokenisation (its regex, no prefix space), so that
    # Megatron's GPT2BPETokenizer splits text the same way the trainer did.
    tokenizer = ByteLevelBPETokenizer(add_prefix_space=False)
    tokenizer.train_from_iterator(
        texts,
        vocab_size=options.vocab_size,
        min_frequency=options.min_frequency,
        special_tokens=[GPT2_EOD],
        show_progress=False,
    )
    vocab, merges = tokenizer.save_model(str(directory))
    return {"--vocab-file": vocab, "--merge-file": merges}


def _train_wordpiece(
    texts: Iterator[str], directory: Path, options: TrainOptions
) -> dict[str, str]:
    # Same normalisation as BERT's BasicTokenizer: lowercasing strips accents too.
    tokenizer = BertWordPieceTokenizer(lowercase=not options.cased, strip_accents=not options.cased)
    tokenizer.train_from_iterator(
        texts,
        vocab_size=options.vocab_size,
        min_frequency=options.min_frequency,
        special_tokens=BERT_SPECIAL_TOKENS,
        show_progress=False,
    )
    (vocab,) = tokenizer.save_model(str(directory))
    return {"--vocab-file": vocab}


def _lines(texts: Iterator[str]) -> Iterator[str]:
    """Non-empty lines: SentencePiece trains on sentences and drops very long ones."""
    for text in texts:
        for line in text.splitlines():
            if line.strip():
                yield line


def _train_sentencepiece(
    texts: Iterator[str], directory: Path, options: TrainOptions
) -> dict[str, str]:
    prefix = directory / SENTENCEPIECE_PREFIX
    spm.set_random_generator_seed(options.seed)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_lines(texts),
            model_prefix=str(prefix),
            vocab_size=options.vocab_size,
            model_type=options.spm_model_type,
            character_coverage=options.character_coverage,
            byte_fallback=options.byte_fallback,
            max_sentence_length=SENTENCEPIECE_MAX_LINE_BYTES,
            # Megatron's SentencePiece tokenizers take eod = eos and need ids for
            # unk/bos/eos; pad stays off as in Llama's model.
            unk_id=0,
            bos_id=1,
            eos_id=2,
            pad_id=-1,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise TrainingError(f"sentencepiece: {err}") from err
    return {"--tokenizer-model": f"{prefix}.model"}
