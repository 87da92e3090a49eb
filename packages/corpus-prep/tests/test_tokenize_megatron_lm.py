"""Byte-identity with Megatron-LM's real tools/preprocess_data.py, when a checkout is at hand.

Set MEGATRON_LM_DIR to a Megatron-LM checkout (core_v0.16.1 was used) to run
these; they are skipped otherwise (Megatron-LM is not on PyPI). The script
runs in this environment with two shims put on its PYTHONPATH, neither of
which changes what it computes:
- `six` (imported by its bert_tokenization.py, not installed here): PY3 = True;
- NLTK >= 3.9 refuses to unpickle `tokenizers/punkt/english.pickle` and
  `nltk.download` needs the network, so `nltk.load` of that pickle returns
  `PunktTokenizer("english")` (the same model as punkt_tab, from our
  fixture) and `nltk.download` does nothing.
With --split-sentences Megatron needs two runs (the first only writes the
`_ss` split copy of the input); both are made.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_dir, fixture_path
from mg.corpus_prep.cli import main
from mg.corpus_prep.sample_corpus import real_corpus, write_jsonl

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
pytestmark = [
    pytest.mark.compat,
    pytest.mark.skipif(not MEGATRON_LM_DIR, reason="set MEGATRON_LM_DIR to a Megatron-LM checkout"),
]

SITECUSTOMIZE = """
import nltk
from nltk.tokenize.punkt import PunktTokenizer

_load = nltk.load
nltk.download = lambda *args, **kwargs: True


def _punkt_tab_for_pickle(url, *args, **kwargs):
    if url.endswith("punkt/english.pickle"):
        return PunktTokenizer("english")
    return _load(url, *args, **kwargs)


nltk.load = _punkt_tab_for_pickle
"""

GPT2 = [
    "--tokenizer-type", "GPT2BPETokenizer",
    "--vocab-file", str(fixture_path("gpt2-bpe", "vocab.json")),
    "--merge-file", str(fixture_path("gpt2-bpe", "merges.txt")),
]  # fmt: skip
BERT = [
    "--tokenizer-type", "BertWordPieceLowerCase",
    "--vocab-file", str(fixture_dir("minilm-bert") / "vocab.txt"),
]  # fmt: skip


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from mg.core.tokenizers.punkt import install_punkt_tab

    root = tmp_path_factory.mktemp("megatron_lm")
    shims = root / "shims"
    shims.mkdir()
    (shims / "six.py").write_text("PY2 = False\nPY3 = True\n")
    (shims / "sitecustomize.py").write_text(SITECUSTOMIZE)
    install_punkt_tab(root / "nltk_data")
    corpus = root / "corpus.jsonl"
    write_jsonl(corpus, real_corpus(wikipedia_pages=40))
    return root, corpus


def run_megatron(root: Path, args: list[str], runs: int = 1) -> None:
    env = {**os.environ, "PYTHONPATH": str(root / "shims"), "NLTK_DATA": str(root / "nltk_data")}
    script = Path(MEGATRON_LM_DIR) / "tools" / "preprocess_data.py"
    for _ in range(runs):
        done = subprocess.run(
            [sys.executable, str(script), *args, "--legacy-tokenizer", "--workers", "2"],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert done.returncode == 0, done.stderr[-3000:]


def run_ours(root: Path, args: list[str]) -> None:
    with pytest.MonkeyPatch.context() as patch, pytest.raises(SystemExit) as exit_:
        patch.setenv("MG_NLTK_DATA", str(root / "nltk_data"))
        main(["tokenize", *args, "--workers", "2", "--no-progress-bar"])
    assert exit_.value.code == 0


def same(a: Path, b: Path) -> None:
    for suffix in (".bin", ".idx"):
        left, right = Path(f"{a}{suffix}").read_bytes(), Path(f"{b}{suffix}").read_bytes()
        assert left == right, f"{suffix} differs from Megatron-LM's"


def test_gpt2_append_eod_document_level(setup):
    root, corpus = setup
    common = ["--input", str(corpus), *GPT2, "--append-eod"]
    run_megatron(root, [*common, "--output-prefix", str(root / "megatron_gpt2")])
    run_ours(root, [*common, "--output-prefix", str(root / "ours_gpt2")])
    same(root / "ours_gpt2_text_document", root / "megatron_gpt2_text_document")


def test_bert_lowercase_split_sentences(setup):
    root, corpus = setup
    common = ["--input", str(corpus), *BERT, "--split-sentences"]
    run_megatron(root, [*common, "--output-prefix", str(root / "megatron_bert")], runs=2)
    run_ours(root, [*common, "--output-prefix", str(root / "ours_bert")])
    same(root / "ours_bert_text_sentence", root / "megatron_bert_text_sentence")
