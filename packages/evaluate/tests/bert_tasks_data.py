"""A tiny BERT checkpoint and small RACE / MNLI / QQP files in the real formats, built from
real text (Botchan, FIXTURES.md), whose labels a tiny model can learn: each label is
carried by a keyword, while the columns the parser must skip hold misleading keywords."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

from mg.core.checkpoint.model_io import save_model
from mg.core.fixtures import fixture_path
from mg.core.models import BertModel, TransformerConfig, pad_vocab_size
from mg.core.tokenizers import TokenizerConfig

SEQ_LENGTH = 32
MNLI_KEYWORDS = {"contradiction": "never", "entailment": "certainly", "neutral": "perhaps"}
MNLI_TRAIN_HEADER = [
    "index",
    "promptID",
    "pairID",
    "genre",
    "sentence1_binary_parse",
    "sentence2_binary_parse",
    "sentence1_parse",
    "sentence2_parse",
    "sentence1",
    "sentence2",
    "label1",
    "gold_label",
]
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER[:-1] + ["label2", "label3", "label4", "label5", "gold_label"]
GOOD_WORDS = ["apple", "river", "garden"]
BAD_WORDS = ["stone", "cloud", "table", "window", "paper"]


def sentences(count: int, seed: int) -> list[str]:
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")[20000:120000]
    words = text.split()
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        start = rng.randrange(0, len(words) - 12)
        out.append(" ".join(words[start : start + rng.randint(5, 10)]))
    return out


def tokenizer_config() -> TokenizerConfig:
    return TokenizerConfig(
        "BertWordPieceLowerCase", vocab_file=str(fixture_path("minilm-bert", "vocab.txt"))
    )


def save_tiny_bert(folder: Path, seed: int = 0) -> Path:
    """A randomly initialised pre-LN BERT (Megatron-Core's layout, as mg-train bert saves)."""
    torch.manual_seed(seed)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=pad_vocab_size(30522),
        seq_length=SEQ_LENGTH,
        max_position_embeddings=SEQ_LENGTH,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    save_model(folder, BertModel(config), config, tokenizer_config(), iteration=10)
    return folder


def write_mnli(path: Path, count: int, seed: int, dev: bool = False) -> list[tuple[str, str, int]]:
    rng = random.Random(seed)
    labels = list(MNLI_KEYWORDS)
    rows, expected = ["\t".join(MNLI_DEV_HEADER if dev else MNLI_TRAIN_HEADER)], []
    for i, text in enumerate(sentences(count, seed)):
        label = rng.choice(labels)
        # the keyword fills most of sentence2: a strong signal for a tiny model
        premise = text
        hypothesis = " ".join([MNLI_KEYWORDS[label]] * 5 + text.split()[:2])
        decoy = MNLI_KEYWORDS[rng.choice(labels)]  # parse columns mislead a wrong reader
        parses = [f"( {decoy} )", f"( {decoy} x )", f"(ROOT {decoy})", f"(ROOT {decoy} y)"]
        extra = [rng.choice(labels)] * (5 if dev else 1)
        row = [str(i), str(1000 + i), f"{i}e", "fiction", *parses, premise, hypothesis]
        rows.append("\t".join([*row, *extra, label]))
        expected.append((premise, hypothesis, label))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return [
        (p, h, {"contradiction": 0, "entailment": 1, "neutral": 2}[lab]) for p, h, lab in expected
    ]


def write_qqp(path: Path, count: int, seed: int) -> list[tuple[str, str, int]]:
    rng = random.Random(seed)
    rows, expected = ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"], []
    for i, question in enumerate(sentences(count, seed + 1)):
        label = rng.randint(0, 1)
        first = question
        other = " ".join(["indeed" if label else "no"] * 5 + question.split()[:2])
        rows.append(f"{i}\t{2 * i}\t{2 * i + 1}\t{first}?\t{other}?\t{label}")
        expected.append((f"{first}?", f"{other}?", label))
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return expected


def write_race(folder: Path, documents: int, seed: int) -> int:
    """`documents` files of one JSON line each, two questions per article."""
    rng = random.Random(seed)
    folder.mkdir(parents=True)
    articles = sentences(documents, seed + 2)
    for d, article in enumerate(articles):
        questions, options, answers = [], [], []
        for q in range(2):
            choices = rng.sample(BAD_WORDS, 3)
            answer = rng.randrange(4)
            choices.insert(answer, rng.choice(GOOD_WORDS))
            questions.append("What did he find near the _ ?" if q else "Which word fits best?")
            options.append(choices)
            answers.append("ABCD"[answer])
        record = {
            "article": article,
            "questions": questions,
            "options": options,
            "answers": answers,
            "id": f"{d}.txt",
        }
        (folder / f"{d}.txt").write_text(json.dumps(record) + "\n", encoding="utf-8")
    return 2 * documents
