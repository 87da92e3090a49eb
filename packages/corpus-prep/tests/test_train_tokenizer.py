"""Train each tokenizer type on real text, load it the way Megatron's tokenizers do, round-trip.

The trained files are loaded through `mg.core.tokenizers.build_tokenizer` when
that type is available there, and always through the library that reads the
same files (HF tokenizers, sentencepiece), so each test checks the files
themselves, not only our own reader.
"""

from __future__ import annotations

import json

import pytest

from mg.core.fixtures import fixture_dir, fixture_path
from mg.corpus_prep.cli import main

SAMPLE = 'I was born a hothead, and "Kiyo" said so... twice-over: 1914 yen!'


def run_cli(*argv: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(["train-tokenizer", *map(str, argv)])
    return exit_info.value.code


def train(corpus, kind: str, vocab_size: int, out, *extra: str) -> int:
    return run_cli(
        "--input", corpus, "--type", kind, "--vocab-size", vocab_size, "--output-dir", out, *extra
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Botchan and the Shakespeare plays as JSONL, one 40-line passage per document."""
    texts = [fixture_path("botchan", "botchan.txt").read_text(encoding="utf-8")]
    texts += [
        p.read_text(encoding="utf-8") for p in sorted(fixture_dir("shakespeare").glob("*.txt"))
    ]
    path = tmp_path_factory.mktemp("corpus") / "corpus.jsonl"
    with path.open("w", encoding="utf-8") as out:
        for text in texts:
            lines = text.splitlines()
            for start in range(0, len(lines), 40):
                passage = "\n".join(lines[start : start + 40]).strip()
                if passage:
                    out.write(json.dumps({"text": passage}) + "\n")
    return path


def mg_tokenizer(tokenizer_type: str, **files: str):
    """The tokenizer from mg.core.tokenizers, or None while that type has not landed there."""
    try:
        from mg.core.tokenizers import TokenizerConfig, build_tokenizer
    except ImportError:
        return None
    return build_tokenizer(TokenizerConfig(tokenizer_type=tokenizer_type, **files))


def test_byte_level_bpe_gpt2_files(tmp_path, corpus):
    out = tmp_path / "bpe"
    assert train(corpus, "byte-level-bpe", 2000, out) == 0
    vocab = json.loads((out / "vocab.json").read_text())
    merges = (out / "merges.txt").read_text().splitlines()
    assert len(vocab) == 2000
    assert vocab["<|endoftext|>"] == 0
    assert merges[0].startswith("#version")
    assert len(merges) - 1 == 2000 - 256 - 1  # 256 byte symbols + eod + one token per merge

    from tokenizers import ByteLevelBPETokenizer

    reference = ByteLevelBPETokenizer(str(out / "vocab.json"), str(out / "merges.txt"))
    ids = reference.encode(SAMPLE).ids
    assert reference.decode(ids) == SAMPLE
    assert len(ids) < len(SAMPLE.encode()) / 2  # it learned merges

    record = json.loads((out / "train_tokenizer.json").read_text())
    assert record["flags"] == {
        "--tokenizer-type": "GPT2BPETokenizer",
        "--vocab-file": str(out / "vocab.json"),
        "--merge-file": str(out / "merges.txt"),
    }
    assert record["documents"] > 500

    files = {"vocab_file": str(out / "vocab.json"), "merge_file": str(out / "merges.txt")}
    ours = mg_tokenizer("GPT2BPETokenizer", **files)
    if ours is not None:
        assert ours.tokenize(SAMPLE) == ids
        assert ours.detokenize(ids) == SAMPLE
        assert ours.eod == 0
        assert ours.vocab_size == 2000


def test_wordpiece_bert_vocab(tmp_path, corpus):
    out = tmp_path / "wp"
    assert train(corpus, "wordpiece", 3000, out) == 0
    vocab = (out / "vocab.txt").read_text(encoding="utf-8").splitlines()
    assert vocab[:5] == ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(vocab) == 3000
    assert any(token.startswith("##") for token in vocab)

    from tokenizers import BertWordPieceTokenizer

    reference = BertWordPieceTokenizer(str(out / "vocab.txt"), lowercase=True)
    ids = reference.encode(SAMPLE, add_special_tokens=False).ids
    assert (
        reference.decode(ids)
        == 'i was born a hothead, and " kiyo " said so... twice - over : 1914 yen!'
    )
    assert 1 not in ids  # no [UNK]

    ours = mg_tokenizer("BertWordPieceLowerCase", vocab_file=str(out / "vocab.txt"))
    if ours is not None:
        assert ours.tokenize(SAMPLE) == ids


def test_sentencepiece_model(tmp_path, corpus):
    out = tmp_path / "spm"
    assert train(corpus, "sentencepiece", 2000, out, "--byte-fallback") == 0
    model = out / "tokenizer.model"
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=str(model))
    assert reference.vocab_size() == 2000
    assert (reference.unk_id(), reference.bos_id(), reference.eos_id()) == (0, 1, 2)
    ids = reference.encode(SAMPLE)
    assert reference.decode(ids) == SAMPLE
    # byte fallback: a character the corpus never had still round-trips
    assert reference.decode(reference.encode("naïve ☃")) == "naïve ☃"

    for tokenizer_type in ("GPTSentencePieceTokenizer", "SentencePieceTokenizer"):
        ours = mg_tokenizer(tokenizer_type, tokenizer_model=str(model))
        if ours is not None:
            assert ours.detokenize(ours.tokenize(SAMPLE)) == SAMPLE
    ours = mg_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=str(model))
    if ours is not None:
        assert ours.tokenize(SAMPLE) == ids
        assert ours.eod == 2


def test_vocab_too_large_is_a_user_error(tmp_path, capsys):
    corpus = tmp_path / "tiny.jsonl"
    corpus.write_text('{"text": "a tiny corpus"}\n')
    status = train(corpus, "sentencepiece", 5000, tmp_path / "o")
    assert status == 2
    assert "Vocabulary size too high" in capsys.readouterr().err


def test_bad_line_names_file_and_line(tmp_path, capsys):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    status = train(corpus, "wordpiece", 100, tmp_path / "o")
    assert status == 2
    assert f"{corpus}:2: no key 'text'" in capsys.readouterr().err
