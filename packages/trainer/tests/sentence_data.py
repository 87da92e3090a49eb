"""A tiny `_text_sentence` corpus for BERT/T5: Botchan, MiniLM's WordPiece vocab.

What `mg-prep tokenize --split-sentences` writes (one item per sentence, one
document per paragraph), built in-process with a plain sentence regex so the
tests and the golden script need no NLTK data.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

DOCUMENTS = 120


def vocab_file() -> str:
    from mg.core.fixtures import fixture_dir

    return str(fixture_dir("minilm-bert") / "vocab.txt")


def tokenizer_flags(extra_ids: int = 0) -> list[str]:
    flags = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab_file()]
    return [*flags, "--vocab-extra-ids", str(extra_ids)] if extra_ids else flags


def build_sentence_corpus(folder: Path) -> str:
    """Write `<folder>/botchan_text_sentence.{bin,idx}`; returns the prefix."""
    from mg.core.fixtures import fixture_path
    from mg.core.tokenizers import TokenizerConfig, build_tokenizer
    from mg.indexed_dataset import IndexedDatasetBuilder

    tok = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file()))
    text = fixture_path("botchan", "botchan.txt").read_text("utf-8")
    lines = [line.strip() for line in text.splitlines() if line.strip()][200:]
    prefix = str(folder / "botchan_text_sentence")
    with IndexedDatasetBuilder(prefix + ".bin", np.uint16) as builder:
        for i in range(DOCUMENTS):
            paragraph = " ".join(lines[i * 8 : (i + 1) * 8])
            sentences = [s for s in re.split(r"(?<=[.!?])\s+", paragraph) if s.strip()]
            ids = [tok.tokenize(s) for s in sentences]
            ids = [s for s in ids if s]
            builder.add_document([t for s in ids for t in s], [len(s) for s in ids])
        builder.finalize(prefix + ".idx")
    return prefix


TINY = [
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "3",
    "--train-iters",
    "30",
    "--seed",
    "1234",
    "--split",
    "949,50,1",
    "--eval-iters",
    "0",
    "--log-interval",
    "10",
    "--deterministic-mode",
]
"""A tiny model, MBS 4 x 2 = GBS 8, 30 iterations (the golden curves' flags)."""

SHAPE = {
    "bert": ["--seq-length", "64"],
    "t5": [
        "--encoder-seq-length",
        "64",
        "--decoder-seq-length",
        "32",
        "--max-position-embeddings",
        "64",
    ],
}

DATA = "{data_prefix}"
VOCAB = "{vocab_file}"


def template_argv(family: str) -> list[str]:
    """The flags with placeholders for the corpus prefix and the vocab file."""
    tokenizer = ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", VOCAB]
    if family == "t5":
        tokenizer += ["--vocab-extra-ids", "100"]
    return [family, *TINY, *SHAPE[family], *tokenizer, "--data-path", DATA]


def fill(argv: list[str], prefix: str, cache: str) -> list[str]:
    out = [{DATA: prefix, VOCAB: vocab_file()}.get(a, a) for a in argv]
    return [*out, "--data-cache-path", cache]
