"""`just detoxify` (workflows/detoxify/run_detoxify.py): its commands parse with their
tools' own parsers, the caller's training flags come after the defaults, and prompts are
the first words of corpus lines, the same for the same seed."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "workflows" / "detoxify" / "run_detoxify.py"


def _module():
    spec = importlib.util.spec_from_file_location("run_detoxify", RECIPE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_commands_parse_and_flags_after_the_defaults_win(tmp_path):
    from mg.corpus_prep.cli import build_parser as prep_parser
    from mg.trainer.arguments.parser import build_parser as train_parser

    result = subprocess.run(
        [sys.executable, str(RECIPE), "--load", "ckpt", "--prompts-from", "p.jsonl",
         "--output-dir", str(tmp_path / "out"), "--dry-run", "--train-iters", "5", "--bf16"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    prep, train = (line.split() for line in result.stdout.splitlines())
    assert prep_parser().parse_args(prep[1:]).tokenizer_model == "ckpt/tokenizer"
    args = train_parser().parse_args(train[1:])
    assert (args.train_iters, args.bf16, args.load) == (5, True, "ckpt")
    assert args.data_path == [str(tmp_path / "out" / "data" / "kept_text_document")]
    assert not (tmp_path / "out").exists()


def test_keep_outside_0_1_is_refused_in_one_line():
    result = subprocess.run(
        [sys.executable, str(RECIPE), "--prompts-from", "p.jsonl", "--keep", "1.5"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["--keep 1.5: a share in (0, 1]"]


def test_prompts_are_the_first_words_of_lines(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    texts = ["To be, or not to be, that is the question:\n[Enter Ophelia]\nshort line",
             "Whether 'tis nobler in the mind to suffer\nThe slings and arrows"]  # fmt: skip
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    prompts = _module().prompts_from(corpus, 10, 4, seed=1)
    assert sorted(prompts) == ["The slings and arrows", "To be, or not", "Whether 'tis nobler in"]
    assert _module().prompts_from(corpus, 1, 4, seed=1) == _module().prompts_from(
        corpus, 1, 4, seed=1
    )
