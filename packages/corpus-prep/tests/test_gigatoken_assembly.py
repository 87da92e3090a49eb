"""A chunk's arrays from the gigatoken backend (ids straight into numpy) equal the classic
backend's, and both equal Megatron's per-document rule written out in plain Python."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mg.core.fixtures import fixture_path
from mg.core.tokenizers import TokenizerConfig
from mg.corpus_prep import encoder
from mg.corpus_prep.encoder import Chunk, DocumentEncoder, EncodedChunk, EncoderSpec
from mg.corpus_prep.splitter import SplitterSpec

pytest.importorskip("gigatoken")

GPT2 = TokenizerConfig(
    "GPT2BPETokenizer",
    vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
    merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
)
SPM = TokenizerConfig(
    "GPTSentencePieceTokenizer", tokenizer_model=str(fixture_path("mistral-spm", "tokenizer.model"))
)
LONG = "word " * 14_000 + "end"  # 70,003 characters: more than one piece
LONGER = "x" * 70_000 + " tail"  # a piece without spaces

# (text, title) per line; a list is a document already split into sentences.
DOCUMENTS: list[tuple[object, object]] = [
    ("Hello world.", "one"),
    ("", ""),  # no tokens under either key
    (["", "", ""], "only empty sentences"),
    (["a sentence.", "", " another one", ""], []),  # empty last sentence: eod on the one before
    ([], "no sentences"),
    (LONG, "long text"),
    (["short", LONGER, "", "after"], "long sentence between short ones"),
    ("<|endoftext|> stays text", "<s> </s>"),
    (["", LONG], ""),
    (["short", LONG, "mid", LONGER, "", "after"], ["", "x"]),  # ids spliced in order
    ("last document.", LONGER),
]


def line(text: object, title: object) -> bytes:
    return json.dumps({"text": text, "title": title}).encode()


def encode(
    config: TokenizerConfig,
    backend: str,
    lines: list[bytes],
    keys: tuple[str, ...] = ("text", "title"),
    append_eod: bool = True,
) -> tuple[DocumentEncoder, EncodedChunk]:
    spec = EncoderSpec(keys, append_eod, config, SplitterSpec("none"), "int32", backend)
    worker = DocumentEncoder(spec)
    return worker, worker.encode(Chunk("corpus.jsonl", 1, lines, sum(map(len, lines))))


def reference(worker: DocumentEncoder, documents: list[list[str]], eod: bool) -> list[np.ndarray]:
    """tokens, sequence lengths, sequences and tokens per document, sentence by sentence in
    Python: sentences without tokens dropped, eod after the last kept one of a document."""
    tokens: list[int] = []
    lengths: list[int] = []
    sequences: list[int] = []
    per_document: list[int] = []
    for sentences in documents:
        kept = [list(worker.tokenizer.tokenize(s)) for s in sentences]
        kept = [ids for ids in kept if ids]
        if kept and eod:
            kept[-1].append(worker.eod)
        for ids in kept:
            tokens += ids
            lengths.append(len(ids))
        sequences.append(len(kept))
        per_document.append(sum(map(len, kept)))
    return [np.asarray(a) for a in (tokens, lengths, sequences, per_document)]


def arrays(chunk: EncodedChunk, key: str) -> list[np.ndarray]:
    k = chunk.keys[key]
    return [k.tokens, k.sequence_lengths, k.document_sequences, k.document_tokens]


def assert_same(a: EncodedChunk, b: EncodedChunk) -> None:
    assert a.keys.keys() == b.keys.keys()
    for key in a.keys:
        for x, y in zip(arrays(a, key), arrays(b, key), strict=True):
            assert x.dtype == y.dtype
            np.testing.assert_array_equal(x, y)
    assert (a.documents, a.tokens, a.empty, a.blank_lines) == (
        b.documents,
        b.tokens,
        b.empty,
        b.blank_lines,
    )
    assert [r.message() for r in a.rejected] == [r.message() for r in b.rejected]


@pytest.mark.parametrize("append_eod", [True, False], ids=["eod", "no-eod"])
@pytest.mark.parametrize("config", [GPT2, SPM], ids=["gpt2", "spm"])
def test_gigatoken_arrays_equal_classic_and_the_python_rule(config, append_eod, monkeypatch):
    def no_retry(*args):
        raise AssertionError("the batch failed: retried document by document")

    monkeypatch.setattr(DocumentEncoder, "_accepted_linenos", no_retry)
    lines = [line(text, title) for text, title in DOCUMENTS]
    lines.insert(3, b"   ")  # a blank line
    lines.insert(6, b'{"text": 1, "title": "x"}')  # rejected
    worker, classic = encode(config, "classic", lines, append_eod=append_eod)
    _, giga = encode(config, "gigatoken", lines, append_eod=append_eod)
    assert_same(giga, classic)
    assert classic.documents == len(DOCUMENTS) and classic.blank_lines == 1
    assert [r.lineno for r in classic.rejected] == [7]
    for key, column in (("text", 0), ("title", 1)):
        documents = [d[column] for d in DOCUMENTS]
        split = [list(d) if isinstance(d, list) else [d] for d in documents]
        for got, want in zip(
            arrays(classic, key), reference(worker, split, append_eod), strict=True
        ):
            np.testing.assert_array_equal(got, want)
    text = classic.keys["text"]
    assert text.document_sequences.tolist()[:5] == [1, 0, 0, 2, 0]
    assert classic.empty == {"text": 3, "title": 3}
    assert text.sequence_lengths.dtype == np.int32 and text.tokens.dtype == np.int32
    if append_eod:
        ends = np.cumsum(text.document_tokens)[text.document_tokens > 0] - 1
        assert (text.tokens[ends] == worker.eod).all()


@pytest.mark.parametrize("config", [GPT2, SPM], ids=["gpt2", "spm"])
def test_chunks_without_documents(config):
    for lines in ([], [b""], [b"  ", b"[1]"]):
        _, classic = encode(config, "classic", lines)
        _, giga = encode(config, "gigatoken", lines)
        assert_same(giga, classic)
        assert classic.documents == 0 and classic.keys["text"].tokens.size == 0
    unreadable = encoder.Rejected("x.jsonl", 5, encoder.UNREADABLE, "the file cannot be read")
    spec = EncoderSpec(("text",), True, config, SplitterSpec("none"), "int32", "gigatoken")
    failed = DocumentEncoder(spec).encode(Chunk("x.jsonl", 5, [], 0, failure=unreadable))
    assert failed.rejected == [unreadable] and failed.documents == 0
    assert failed.keys["text"].tokens.dtype == np.int32 and failed.keys["text"].tokens.size == 0


def test_a_document_that_breaks_the_tokenizer_is_rejected_alone(monkeypatch):
    """The per-document retry: the other documents' arrays as if it had not been there."""
    bad = "this one breaks the tokenizer"
    lines = [line(text, title) for text, title in DOCUMENTS]
    lines.insert(4, line(bad, "t"))
    without = [line(text, title) for text, title in DOCUMENTS]
    _, expected = encode(GPT2, "classic", without)
    real_build = encoder.build_batch_encoder

    def fragile_build(config):
        real = real_build(config)

        def encode_batch(texts):
            if bad in texts:
                raise ValueError("boom")
            return real(texts)

        return encode_batch

    monkeypatch.setattr(encoder, "build_batch_encoder", fragile_build)
    _, giga = encode(GPT2, "gigatoken", lines)
    assert [(r.lineno, r.reason) for r in giga.rejected] == [(5, encoder.TOKENIZE_FAILED)]
    assert giga.documents == len(DOCUMENTS)
    for key in ("text", "title"):
        for x, y in zip(arrays(giga, key), arrays(expected, key), strict=True):
            np.testing.assert_array_equal(x, y)


def test_the_rebuilt_encoder_gives_the_same_arrays(monkeypatch):
    lines = [line(text, title) for text, title in DOCUMENTS]
    _, classic = encode(GPT2, "classic", lines)
    monkeypatch.setattr(encoder, "GIGATOKEN_REFRESH_CHARS", 10)  # rebuilt after every batch
    worker, giga = encode(GPT2, "gigatoken", lines)
    assert_same(giga, classic)
    again = worker.encode(Chunk("corpus.jsonl", 1, lines, 0))
    for key in ("text", "title"):
        for x, y in zip(arrays(again, key), arrays(classic, key), strict=True):
            np.testing.assert_array_equal(x, y)
