"""A checkpoint carries its tokenizer: moved to another folder, it still loads and tokenizes."""

from __future__ import annotations

import shutil

from fault_helpers import train_argv

from mg.core.checkpoint import describe, load_model
from mg.core.fixtures import fixture_path
from mg.core.tokenizers import build_tokenizer
from mg.trainer.cli import main


def test_checkpoint_moves_with_its_tokenizer(tmp_path) -> None:
    vocab, merges = fixture_path("gpt2-bpe", "vocab.json"), fixture_path("gpt2-bpe", "merges.txt")
    staging = tmp_path / "fixtures"  # the tokenizer files live outside the checkpoint...
    staging.mkdir()
    shutil.copy(vocab, staging / "vocab.json")
    shutil.copy(merges, staging / "merges.txt")
    argv = train_argv(tmp_path / "cache", "--save", str(tmp_path / "ckpt"), iters=1)
    argv = [a for a in argv if a not in ("--vocab-size", "127")]
    argv += ["--tokenizer-type", "GPT2BPETokenizer"]
    argv += [
        "--vocab-file",
        str(staging / "vocab.json"),
        "--merge-file",
        str(staging / "merges.txt"),
    ]
    assert main(argv) == 0

    recorded = describe(tmp_path / "ckpt").tokenizer_config
    assert recorded["vocab_file"] == "tokenizer/vocab.json"
    assert recorded["merge_file"] == "tokenizer/merges.txt"
    assert (tmp_path / "ckpt/tokenizer/vocab.json").read_bytes() == vocab.read_bytes()

    shutil.rmtree(staging)  # ...which then disappear, and the checkpoint is moved
    moved = tmp_path / "elsewhere" / "ckpt"
    shutil.move(tmp_path / "ckpt", moved)
    _model, _config, tokenizer_config, _info = load_model(moved)
    tokenizer = build_tokenizer(tokenizer_config)
    assert tokenizer.tokenize("Hello world") == [15496, 995]  # GPT-2's ids
