"""Golden sha256 of `mg-prep tokenize` outputs on a fixed real corpus.

The corpus is `sample_corpus.real_corpus(wikipedia_pages=40)` (edge cases,
six Shakespeare plays and Botchan in paragraphs, 40 Wikipedia pages), built
from checksum-verified fixtures, so its own sha256 is recorded too. The
expected hashes live in data/tokenize_golden.json; regenerate them, after a
deliberate change only, with

    uv run --frozen python packages/corpus-prep/tests/test_tokenize_golden.py --regenerate

When they were recorded, the same runs were byte-identical to the Megatron
reference of test_tokenize_megatron_compat.py (see "checked" in the file).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_dir, fixture_path
from mg.corpus_prep.cli import main
from mg.corpus_prep.sample_corpus import real_corpus, write_jsonl
from mg.indexed_dataset.format import IndexedDataset

GOLDEN = Path(__file__).parent / "data" / "tokenize_golden.json"
WIKIPEDIA_PAGES = 40

# name -> (tokenizer flags, other flags, output level)
RUNS: dict[str, tuple[list[str], list[str], str]] = {
    "gpt2_document_append_eod": (
        [
            "--tokenizer-type",
            "GPT2BPETokenizer",
            "--vocab-file",
            "{gpt2-bpe}/vocab.json",
            "--merge-file",
            "{gpt2-bpe}/merges.txt",
        ],
        ["--append-eod"],
        "document",
    ),
    "bert_lowercase_sentence": (
        ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "{minilm-bert}/vocab.txt"],
        ["--split-sentences"],
        "sentence",
    ),
    "bert_lowercase_sentence_nltk310": (
        ["--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", "{minilm-bert}/vocab.txt"],
        ["--split-sentences", "--punkt-rules", "nltk-3.10"],
        "sentence",
    ),
}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _expand(flags: list[str]) -> list[str]:
    folders = {"{gpt2-bpe}": fixture_path("gpt2-bpe", "vocab.json").parent}
    folders["{minilm-bert}"] = fixture_dir("minilm-bert")
    out = []
    for flag in flags:
        for name, folder in folders.items():
            flag = flag.replace(name, str(folder))
        out.append(flag)
    return out


def produce(workdir: Path) -> dict:
    """Build the corpus, run every golden run, return what the golden file records."""
    from mg.corpus_prep.splitter import install_fixture_punkt

    corpus = workdir / "golden.jsonl"
    documents = write_jsonl(corpus, real_corpus(wikipedia_pages=WIKIPEDIA_PAGES))
    record = {
        "corpus": {
            "built_by": f"sample_corpus.real_corpus(wikipedia_pages={WIKIPEDIA_PAGES})",
            "documents": documents,
            "bytes": corpus.stat().st_size,
            "sha256": _sha256(corpus),
        },
        "runs": {},
    }
    nltk_data = workdir / "nltk_data"
    install_fixture_punkt(nltk_data)
    for name, (tokenizer, flags, level) in RUNS.items():
        prefix = workdir / name
        args = ["tokenize", "--input", str(corpus), "--output-prefix", str(prefix)]
        args += [*_expand(tokenizer), *flags, "--workers", "2", "--no-progress-bar"]
        try:
            main(args)
        except SystemExit as exit_:
            assert not exit_.code, f"mg-prep {' '.join(args)} failed"
        dataset_prefix = f"{prefix}_text_{level}"
        dataset = IndexedDataset(dataset_prefix)
        record["runs"][name] = {
            "command": ["mg-prep", "tokenize", "--input", "golden.jsonl", *tokenizer, *flags],
            "documents": dataset.num_documents,
            "sequences": len(dataset),
            "tokens": dataset.num_tokens,
            "bin_sha256": _sha256(Path(dataset_prefix + ".bin")),
            "idx_sha256": _sha256(Path(dataset_prefix + ".idx")),
        }
    return record


@pytest.fixture
def private_nltk_data(tmp_path, monkeypatch):
    monkeypatch.setenv("MG_NLTK_DATA", str(tmp_path / "nltk_data"))


def test_outputs_match_the_golden_hashes(tmp_path, private_nltk_data):
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    produced = produce(tmp_path)
    assert produced["corpus"] == golden["corpus"], "the corpus builder or the fixtures changed"
    for name, expected in golden["runs"].items():
        got = produced["runs"][name]
        for field in ("documents", "sequences", "tokens", "bin_sha256", "idx_sha256"):
            assert got[field] == expected[field], f"{name}: {field}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit(f"usage: python {sys.argv[0]} --regenerate")
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MG_NLTK_DATA"] = str(Path(tmp) / "nltk_data")
        record = produce(Path(tmp))
    old = json.loads(GOLDEN.read_text(encoding="utf-8")) if GOLDEN.exists() else {}
    record = {
        "about": old.get("about", __doc__.strip().split("\n\n")[0]),
        "produced_by": "uv run --frozen python packages/corpus-prep/tests/"
        "test_tokenize_golden.py --regenerate",
        "checked": old.get("checked", ""),
        **record,
    }
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {GOLDEN}")
