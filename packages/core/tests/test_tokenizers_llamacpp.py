"""Conformance with llama.cpp's reference tokenizations (ggml-vocab-*.gguf + .inp/.out).

llama.cpp ships vocab-only GGUF files with test strings (``.inp``, separated
by ``__ggml_vocab_test__`` lines) and the ids the original Hugging Face
tokenizer gives for each (``.out``, one line of space-separated ids per
string, special tokens not added). These were written by llama.cpp's
``convert_hf_to_gguf_update.py`` from the models' own tokenizers, so they
are an outside reference for GPT-2 BPE, BERT WordPiece (bge = BERT uncased)
and Llama's SentencePiece.

The GGUF files are read with the small parser below (the ``gguf`` package
is not a dependency); the Llama SentencePiece model is rebuilt from the GGUF
vocabulary as a ``.model`` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from mg.core.fixtures import fixture_dir, fixture_path
from mg.core.tokenizers import TokenizerConfig, build_tokenizer

# --- a minimal GGUF (v2/v3) metadata reader ---------------------------------

# GGUF value types: 0-7 and 10-12 are scalars (struct codes), 8 a string, 9 an array.
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: Path) -> dict[str, Any]:
    """The key/value metadata of a GGUF file: header, then typed values (arrays nest)."""
    data = path.read_bytes()
    if data[:4] != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file")
    pos = 4

    def take(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n : pos].decode("utf-8")

    def value(kind: int) -> Any:
        if kind in _SCALARS:
            return take(_SCALARS[kind])
        if kind == _STRING:
            return string()
        if kind == _ARRAY:
            item_kind, count = take("I"), take("Q")
            return [value(item_kind) for _ in range(count)]
        raise ValueError(f"{path}: unknown GGUF value type {kind} at byte {pos}")

    version = take("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version}")
    take("Q")  # tensor count
    metadata = {}
    for _ in range(take("Q")):
        key = string()
        metadata[key] = value(take("I"))
    return metadata


def reference_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, expected ids) pairs of one llama.cpp vocab test."""
    folder = fixture_dir("llama-cpp-vocabs")
    # newline="" keeps \r and \r\n inside the test strings as they are.
    with open(folder / f"{name}.gguf.inp", encoding="utf-8", newline="") as f:
        inp = f.read()
    with open(folder / f"{name}.gguf.out", encoding="utf-8", newline="") as f:
        out = f.read()
    texts = inp.split("\n__ggml_vocab_test__\n")
    assert texts[-1] == ""  # the file ends with a separator
    ids = [[int(i) for i in line.split()] for line in out.split("\n")[:-1]]
    assert len(texts) - 1 == len(ids)
    return list(zip(texts[:-1], ids, strict=True))


def gguf(name: str) -> dict[str, Any]:
    return read_gguf_metadata(fixture_dir("llama-cpp-vocabs") / f"{name}.gguf")


# --- a minimal protobuf writer for a SentencePiece ModelProto -----------------


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return result, pos


def _top_level_fields(data: bytes) -> list[tuple[int, bytes]]:
    """(field number, the field's raw bytes including its key) of a protobuf message."""
    fields, pos = [], 0
    while pos < len(data):
        start = pos
        key, pos = _read_varint(data, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _read_varint(data, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            pos += length
        else:
            raise ValueError(f"protobuf wire type {wire}")
        fields.append((key >> 3, data[start:pos]))
    return fields


def sentencepiece_model_from_gguf(metadata: dict[str, Any], template: Path) -> bytes:
    """A ``.model``: the GGUF's pieces (text, score, type), the template's other fields.

    SentencePiece's piece types (normal, unknown, control, user-defined,
    unused, byte) are numbered as GGUF's token types. Mistral's model serves
    as the template: like Llama's it is BPE with byte fallback, an identity
    normalizer, a dummy prefix and no whitespace squeezing.
    """
    out = bytearray()
    pieces = zip(
        metadata["tokenizer.ggml.tokens"],
        metadata["tokenizer.ggml.scores"],
        metadata["tokenizer.ggml.token_type"],
        strict=True,
    )
    for text, score, kind in pieces:
        raw = text.encode("utf-8")
        piece = _varint(1 << 3 | 2) + _varint(len(raw)) + raw  # 1: piece
        piece += _varint(2 << 3 | 5) + struct.pack("<f", score)  # 2: score
        piece += _varint(3 << 3) + _varint(kind)  # 3: type
        out += _varint(1 << 3 | 2) + _varint(len(piece)) + piece  # ModelProto.pieces
    for number, raw in _top_level_fields(template.read_bytes()):
        if number != 1:  # keep trainer_spec, normalizer_spec, ...
            out += raw
    return bytes(out)


# --- the conformance tests ---------------------------------------------------


def _mismatches(results: list[list[int]], cases: list[tuple[str, list[int]]]) -> list:
    """The cases whose ids differ from the reference, with what we gave."""
    pairs = zip(cases, results, strict=True)
    return [(text, want, got) for (text, want), got in pairs if got != want]


def test_gguf_reader_reads_the_vocabularies():
    meta = gguf("gpt-2")
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert len(meta["tokenizer.ggml.tokens"]) == 50257
    assert len(meta["tokenizer.ggml.merges"]) == 50000
    assert meta["tokenizer.ggml.eos_token_id"] == 50256


@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_gpt2_reproduces_llama_cpp(backend):
    """Our GPT-2 fixture is the GGUF's vocabulary, and all 46 strings give the reference ids."""
    from mg.core.tokenizers import GPT2BPETokenizer

    meta = gguf("gpt-2")
    vocab = json.loads(fixture_path("gpt2-bpe", "vocab.json").read_text(encoding="utf-8"))
    assert sorted(vocab, key=vocab.get) == meta["tokenizer.ggml.tokens"]
    merges = fixture_path("gpt2-bpe", "merges.txt").read_text(encoding="utf-8").split("\n")
    assert merges[1:-1] == meta["tokenizer.ggml.merges"]

    tok = GPT2BPETokenizer(
        fixture_path("gpt2-bpe", "vocab.json"), fixture_path("gpt2-bpe", "merges.txt"), backend
    )
    cases = reference_cases("gpt-2")
    assert len(cases) == 46
    assert _mismatches(tok.tokenize_batch([t for t, _ in cases]), cases) == []
    assert _mismatches([tok.tokenize(t) for t, _ in cases], cases) == []
    for text, _ in cases:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_bert_bge_reproduces_llama_cpp():
    """bge's vocabulary is BERT uncased (our MiniLM vocab.txt); ids match, no [CLS]/[SEP]."""
    meta = gguf("bert-bge")

    # llama.cpp stores WordPiece as "phantom space" tokens: "▁word" for a word
    # start, "piece" for a "##piece" continuation, "[X]" kept as is.
    def wordpiece_form(token: str) -> str:
        if token.startswith("[") and token.endswith("]"):
            return token
        return token[1:] if token.startswith("\u2581") else "##" + token

    vocab_txt = fixture_path("minilm-bert", "vocab.txt")
    ours = vocab_txt.read_text(encoding="utf-8").splitlines()
    assert [wordpiece_form(t) for t in meta["tokenizer.ggml.tokens"]] == ours

    tok = build_tokenizer(TokenizerConfig("BertWordPieceLowerCase", vocab_file=str(vocab_txt)))
    cases = reference_cases("bert-bge")
    assert _mismatches(tok.tokenize_batch([t for t, _ in cases]), cases) == []


@pytest.fixture(scope="module")
def llama_spm_model(tmp_path_factory) -> Path:
    model = sentencepiece_model_from_gguf(
        gguf("llama-spm"), fixture_path("mistral-spm", "tokenizer.model")
    )
    path = tmp_path_factory.mktemp("llama-spm") / "tokenizer.model"
    path.write_bytes(model)
    return path


def test_llama_spm_reproduces_llama_cpp(llama_spm_model):
    """Llama's SentencePiece rebuilt from the GGUF: every string gives the reference ids."""
    cases = reference_cases("llama-spm")
    for kind in ("GPTSentencePieceTokenizer", "Llama2Tokenizer", "SentencePieceTokenizer"):
        tok = build_tokenizer(TokenizerConfig(kind, tokenizer_model=str(llama_spm_model)))
        assert tok.vocab_size == (32000 if kind != "SentencePieceTokenizer" else 32005)
        # Llama2Tokenizer puts bos first, as Megatron's tokenize(s, bos=True);
        # none of the test strings contains a SentencePieceTokenizer special string.
        lead = [1] if kind == "Llama2Tokenizer" else []
        expected = [(text, lead + ids) for text, ids in cases]
        assert _mismatches(tok.tokenize_batch([t for t, _ in expected]), expected) == []
        assert _mismatches([tok.tokenize(t) for t, _ in expected], expected) == []


def test_llama_bpe_through_huggingface_tokenizer(tmp_path):
    """Llama 3's BPE (from the GGUF) written as tokenizer.json and read by HuggingFaceTokenizer."""
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    meta = gguf("llama-bpe")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    # Llama 3's tokenizer.json: its split regex, byte-level BPE that takes whole
    # words found in the vocabulary first (ignore_merges), BOS added in front.
    pattern = (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    )
    hf = HFTokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=True)
    )
    hf.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = decoders.ByteLevel()
    kinds = meta["tokenizer.ggml.token_type"]
    control = [t for t, kind in zip(tokens, kinds, strict=True) if kind == 3]
    hf.add_special_tokens([AddedToken(t, special=True) for t in control])
    bos, eos = (
        tokens[meta["tokenizer.ggml.bos_token_id"]],
        tokens[meta["tokenizer.ggml.eos_token_id"]],
    )
    hf.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, 128000)]
    )
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": bos, "eos_token": eos}), encoding="utf-8"
    )

    tok = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))
    assert (tok.bos, tok.eos, tok.eod, tok.vocab_size) == (128000, 128001, 128001, 128256)
    cases = [(text, [128000, *ids]) for text, ids in reference_cases("llama-bpe")]
    assert _mismatches(tok.tokenize_batch([t for t, _ in cases]), cases) == []
