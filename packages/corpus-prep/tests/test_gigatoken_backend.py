"""`--tokenizer-backend gigatoken` writes the same bytes as the classic tokenizers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_path
from mg.core.tokenizers import TokenizerConfig
from mg.core.tokenizers.gpt2_bpe import GPT2BPETokenizer
from mg.corpus_prep import gigatoken_backend
from mg.corpus_prep.cli import main
from mg.corpus_prep.sample_corpus import real_corpus, write_jsonl

pytest.importorskip("gigatoken")

VOCAB = str(fixture_path("gpt2-bpe", "vocab.json"))
MERGES = str(fixture_path("gpt2-bpe", "merges.txt"))
GPT2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", VOCAB, "--merge-file", MERGES]

# Text where byte-level BPE engines could part ways: GPT-2's end-of-text marker as
# text, whitespace runs before words and at the end, contractions, digits of other
# scripts, combining marks, emoji joined by ZWJ, control characters.
TRICKY = [
    "Hello world<|endoftext|> it's  ok\n\n  x",
    "héllo 日本語 🎉\t\t tabs   ",
    "don't I'LL we've 12345 ３４ ÷× e\u0301 👩\u200d👩\u200d👧",
    "\x00\x1f\u2028 a\r\nb \u00a0 c",
    "   leading and trailing   ",
    "<s> </s> <unk> [INST] are text here",
    "",
    " ",
    "x" * 70_000 + " long",  # longer than one piece: encoded in pieces
]


def mg_prep(*args: object) -> int:
    try:
        main([str(a) for a in args])
    except SystemExit as exit_:
        return int(exit_.code or 0)
    return 0


def dataset_bytes(prefix: Path) -> tuple[bytes, bytes]:
    return Path(f"{prefix}.bin").read_bytes(), Path(f"{prefix}.idx").read_bytes()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("giga") / "corpus.jsonl"
    documents = list(real_corpus(wikipedia_pages=4))
    documents += [{"text": text, "title": text[:40]} for text in TRICKY]
    documents.append({"text": ["a sentence.", "", " another one"], "title": "list"})
    write_jsonl(path, iter(documents))
    return path


def test_gigatoken_ids_equal_the_classic_gpt2_ids():
    classic = GPT2BPETokenizer(VOCAB, MERGES)
    encode = gigatoken_backend.build_batch_encoder(
        TokenizerConfig("GPT2BPETokenizer", vocab_file=VOCAB, merge_file=MERGES)
    )
    short = [text for text in TRICKY if len(text) < 65_536]
    tokens, lengths = encode(short)
    expected = [classic.tokenize(text) for text in short]
    assert lengths.tolist() == [len(ids) for ids in expected]
    assert tokens.tolist() == [i for ids in expected for i in ids]


@pytest.mark.parametrize(
    "options",
    [
        ["--append-eod", "--workers", "0"],
        ["--append-eod", "--workers", "2", "--json-keys", "text", "title"],
        ["--split-sentences", "--workers", "1"],
    ],
    ids=["eod-main-process", "two-workers-two-keys", "sentences"],
)
def test_gigatoken_backend_writes_the_classic_bytes(corpus, tmp_path, options):
    outputs = {}
    for backend in ("classic", "gigatoken"):
        prefix = tmp_path / backend / "out"
        code = mg_prep(
            "tokenize", "--input", corpus, "--output-prefix", prefix, *GPT2, *options,
            "--tokenizer-backend", backend, "--no-progress-bar",
        )  # fmt: skip
        assert code == 0
        level = "sentence" if "--split-sentences" in options else "document"
        keys = options[options.index("--json-keys") + 1 :] if "--json-keys" in options else ["text"]
        outputs[backend] = [dataset_bytes(Path(f"{prefix}_{k}_{level}")) for k in keys]
    assert outputs["gigatoken"] == outputs["classic"]
    assert len(outputs["classic"][0][0]) > 100_000  # a real corpus, not an empty file


def test_auto_picks_gigatoken_where_measured_faster(monkeypatch):
    """For the types it was measured faster on, with 4 MiB of input a worker or more."""
    assert gigatoken_backend.resolve_backend("auto", "GPT2BPETokenizer") == "gigatoken"
    assert gigatoken_backend.resolve_backend("auto", "GPTSentencePieceTokenizer") == "gigatoken"
    assert gigatoken_backend.resolve_backend("auto", "BertWordPieceLowerCase") == "classic"
    assert gigatoken_backend.resolve_backend("auto", "HuggingFaceTokenizer") == "classic"
    assert gigatoken_backend.resolve_backend("classic", "GPT2BPETokenizer") == "classic"
    spm = gigatoken_backend.resolve_backend("gigatoken", "GPTSentencePieceTokenizer")
    assert spm == "gigatoken"
    # little input a worker: gigatoken's start-up costs more than it saves; asked for, it runs
    mib = 1 << 20
    assert gigatoken_backend.resolve_backend("auto", "GPT2BPETokenizer", 7 * mib, 2) == "classic"
    assert gigatoken_backend.resolve_backend("auto", "GPT2BPETokenizer", 8 * mib, 2) == "gigatoken"
    assert gigatoken_backend.resolve_backend("auto", "GPT2BPETokenizer", 5 * mib, 1) == "gigatoken"
    assert gigatoken_backend.resolve_backend("gigatoken", "GPT2BPETokenizer", 1, 4) == "gigatoken"
    monkeypatch.setattr(gigatoken_backend, "installed", lambda: False)
    assert gigatoken_backend.resolve_backend("auto", "GPT2BPETokenizer") == "classic"
    with pytest.raises(gigatoken_backend.BackendError, match="not installed"):
        gigatoken_backend.resolve_backend("gigatoken", "GPT2BPETokenizer")


def test_gigatoken_sentencepiece_writes_the_classic_bytes(corpus, tmp_path):
    model = fixture_path("mistral-spm", "tokenizer.model")
    spm = ["--tokenizer-type", "GPTSentencePieceTokenizer", "--tokenizer-model", model]
    outputs = {}
    for backend in ("classic", "gigatoken"):
        prefix = tmp_path / backend
        code = mg_prep(
            "tokenize", "--input", corpus, "--output-prefix", prefix, *spm, "--append-eod",
            "--workers", "1", "--tokenizer-backend", backend, "--no-progress-bar",
        )  # fmt: skip
        assert code == 0
        outputs[backend] = dataset_bytes(Path(f"{prefix}_text_document"))
    assert outputs["gigatoken"] == outputs["classic"]


def test_gigatoken_for_an_unsupported_tokenizer_is_a_one_line_error(corpus, tmp_path, capsys):
    vocab = fixture_path("minilm-bert", "vocab.txt")
    code = mg_prep(
        "tokenize", "--input", corpus, "--output-prefix", tmp_path / "bert",
        "--tokenizer-type", "BertWordPieceLowerCase", "--vocab-file", vocab,
        "--tokenizer-backend", "gigatoken", "--no-progress-bar",
    )  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("mg-prep tokenize: error: --tokenizer-backend gigatoken: not ")
    assert "BertWordPieceLowerCase" in err[-1]
    assert not list(tmp_path.glob("bert*"))


def test_tokenizer_json_has_no_added_tokens():
    data = json.loads(gigatoken_backend.gpt2_tokenizer_json(VOCAB, MERGES))
    assert data["added_tokens"] == []
    assert len(data["model"]["merges"]) == 50_000


def test_the_encoder_is_rebuilt_to_bound_its_cache_and_the_bytes_stay(
    corpus, tmp_path, monkeypatch
):
    from mg.corpus_prep import encoder

    builds = []

    def counting_build(config):
        builds.append(config.tokenizer_type)
        return gigatoken_backend.build_batch_encoder(config)

    monkeypatch.setattr(encoder, "build_batch_encoder", counting_build)
    monkeypatch.setattr(encoder, "GIGATOKEN_REFRESH_CHARS", 20_000)
    outputs = {}
    for backend in ("classic", "gigatoken"):
        prefix = tmp_path / backend
        code = mg_prep(
            "tokenize", "--input", corpus, "--output-prefix", prefix, *GPT2, "--append-eod",
            "--workers", "0", "--tokenizer-backend", backend, "--no-progress-bar",
        )  # fmt: skip
        assert code == 0
        outputs[backend] = dataset_bytes(Path(f"{prefix}_text_document"))
    assert outputs["gigatoken"] == outputs["classic"]
    assert len(builds) > 3  # the first build, then one per 20,000 characters
