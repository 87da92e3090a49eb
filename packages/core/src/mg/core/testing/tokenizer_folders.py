"""Hugging Face tokenizer folders for chat tests, built offline from real vocabularies."""

from __future__ import annotations

import json
from pathlib import Path

from mg.core.fixtures import FixtureError, fixture_path


def chatml_tokenizer_folder(
    folder: Path, chat_template: str | None, eos_token: str = "<|endoftext|>"
) -> Path:
    """GPT-2's real byte-level BPE (the gpt2-bpe fixture) plus ChatML's <|im_start|> and
    <|im_end|>, saved as a `PreTrainedTokenizerFast` folder with `chat_template` (none:
    a folder without one). Skips the calling test when `tokenizers` or the fixture is
    missing."""
    # lazy: pytest and tokenizers are test-only here
    import pytest

    tokenizers = pytest.importorskip("tokenizers")
    try:
        vocab = fixture_path("gpt2-bpe", "vocab.json")
        merges = fixture_path("gpt2-bpe", "merges.txt")
    except FixtureError as exc:
        pytest.skip(f"fixture gpt2-bpe cannot be fetched: {exc}")
    from tokenizers import decoders, models, pre_tokenizers  # lazy: as above

    tok = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos_token,
        "pad_token": "<|endoftext|>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder
