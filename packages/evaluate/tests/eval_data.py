"""Data and checkpoints the evaluate tests share: real Botchan paragraphs and a saved
tiny GPT. A module of its own (not conftest) so that tests import it by a name no other
test folder uses."""

from __future__ import annotations

import re
from pathlib import Path

from mg.core.checkpoint import mg_metadata, save_checkpoint
from mg.core.fixtures import fixture_path
from mg.core.models import GPTModel
from mg.core.tokenizers import TokenizerConfig

SEQ_LENGTH = 64


def botchan_paragraphs(count: int, skip: int = 40) -> list[str]:
    """Real prose of Botchan (past the Gutenberg front matter) as ~50-word paragraphs.

    The file has no blank lines, so paragraphs are runs of whole sentences."""
    text = fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text[5000:].split()))
    paras, current = [], []
    for sentence in sentences:
        current.append(sentence)
        if sum(len(x.split()) for x in current) >= 50:
            paras.append(" ".join(current))
            current = []
    return paras[skip : skip + count]


def save_gpt(save_dir: Path, model: GPTModel, tokenizer_config: TokenizerConfig | None) -> Path:
    state = {
        "model": model.state_dict(),
        "iteration": 40,
        "mg": mg_metadata(
            model.config.to_dict(), tokenizer_config.to_dict() if tokenizer_config else None
        ),
    }
    save_checkpoint(save_dir, 40, state)
    return save_dir
