"""The tokenizer interface: building from configs, errors, special ids, batching, pickling."""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path

import pytest

from mg.core.fixtures import fixture_dir, fixture_path
from mg.core.tokenizers import (
    TOKENIZER_TYPES,
    GPT2BPETokenizer,
    TikTokenizer,
    Tokenizer,
    TokenizerConfig,
    build_tokenizer,
    vocab_size_with_padding,
)

SAMPLES = [
    "Hello world",
    " The quick brown fox jumps over the lazy dog.\n\nIt's 3:45 p.m.",
    "",
    "Ünïcödé naïve café — “quotes” 日本語 🥰",
    "tabs\tand  double  spaces\r\n",
]


def config_for(kind: str) -> TokenizerConfig:
    """A config of each type built from the real fixture files."""
    if kind == "GPT2BPETokenizer":
        return TokenizerConfig(
            kind,
            vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
            merge_file=str(fixture_path("gpt2-bpe", "merges.txt")),
        )
    if kind.startswith("BertWordPiece"):
        return TokenizerConfig(kind, vocab_file=str(fixture_path("minilm-bert", "vocab.txt")))
    if kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        return TokenizerConfig(
            kind, tokenizer_model=str(fixture_path("mistral-spm", "tokenizer.model"))
        )
    if kind == "HuggingFaceTokenizer":
        return TokenizerConfig(kind, tokenizer_model=str(fixture_dir("minilm-bert")))
    if kind == "TikTokenizer":
        return TokenizerConfig(
            kind, tokenizer_model=str(fixture_path("gpt2-tiktoken", "gpt2.tiktoken"))
        )
    assert kind == "NullTokenizer"
    return TokenizerConfig(kind, vocab_size=1000)


@pytest.fixture(scope="module")
def built() -> dict[str, Tokenizer]:
    return {kind: build_tokenizer(config_for(kind)) for kind in TOKENIZER_TYPES}


def test_the_nine_megatron_types():
    assert set(TOKENIZER_TYPES) == {
        "BertWordPieceLowerCase",
        "BertWordPieceCase",
        "GPT2BPETokenizer",
        "SentencePieceTokenizer",
        "GPTSentencePieceTokenizer",
        "HuggingFaceTokenizer",
        "Llama2Tokenizer",
        "TikTokenizer",
        "NullTokenizer",
    }


@pytest.mark.parametrize("kind", TOKENIZER_TYPES)
def test_every_type_follows_the_interface(built, kind):
    tok = built[kind]
    assert isinstance(tok, Tokenizer)
    assert tok.name == kind
    assert tok.config == config_for(kind)
    texts = ["1 2 3", "17", "", "5 0 999"] if kind == "NullTokenizer" else SAMPLES
    single = [tok.tokenize(t) for t in texts]
    assert tok.tokenize_batch(texts) == single
    assert tok.tokenize_batch([]) == []
    for ids in single:
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert isinstance(tok.detokenize(ids), str)
        assert all(isinstance(tok.id_to_token(i), str) for i in ids)
    assert isinstance(tok.additional_special_tokens_ids, list)
    # Workers of mg-prep get the tokenizer by pickling.
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize_batch(texts) == single
    assert clone.eod == tok.eod and clone.vocab_size == tok.vocab_size


def test_detokenize_accepts_arrays(built):
    """Ids straight from an indexed dataset (numpy) or a model (tensor.tolist() path)."""
    import numpy as np

    for kind, tok in built.items():
        text = "1 2 3" if kind == "NullTokenizer" else "Hello world"
        ids = tok.tokenize(text)
        expected = tok.detokenize(ids)
        assert tok.detokenize(np.array(ids, dtype=np.uint16)) == expected, kind
        assert tok.detokenize(tuple(ids)) == expected, kind


# --- special ids and vocab sizes, as Megatron's classic tokenizers report them ---


def test_gpt2_special_ids(built):
    tok = built["GPT2BPETokenizer"]
    assert (tok.vocab_size, tok.eod, tok.eos) == (50257, 50256, 50256)
    assert (tok.bos, tok.pad, tok.cls, tok.sep, tok.mask) == (None,) * 5
    assert tok.additional_special_tokens_ids == []
    assert tok.tokenize("Hello world") == [15496, 995]
    assert tok.id_to_token(50256) == "<|endoftext|>"
    assert tok.id_to_token(995) == " world"  # the bytes' text, not "Ġworld"


def test_gpt2_treats_a_literal_endoftext_as_text(built):
    tok = built["GPT2BPETokenizer"]
    ids = tok.tokenize("end<|endoftext|>start")
    assert 50256 not in ids
    assert ids == tok.tokenize("end") + tok.tokenize("<|endoftext|>") + tok.tokenize("start")
    assert tok.detokenize(ids) == "end<|endoftext|>start"
    assert tok.detokenize([*tok.tokenize("a"), tok.eod]) == "a<|endoftext|>"


def test_gpt2_detokenize_replaces_invalid_utf8(built):
    tok = built["GPT2BPETokenizer"]
    ids = tok.tokenize("ꙮ")  # one character, three byte tokens
    assert len(ids) == 3
    assert tok.detokenize(ids[:2]) == "\ufffd"
    assert tok.id_to_token(ids[0]) == "\ufffd"
    assert tok.detokenize(ids) == "ꙮ"


def test_bert_special_ids(built):
    lower, case = built["BertWordPieceLowerCase"], built["BertWordPieceCase"]
    for tok in (lower, case):
        assert (tok.cls, tok.sep, tok.pad, tok.mask) == (101, 102, 0, 103)
        # Megatron appends [BOS] and [EOS]: 30522 + 2, padded to 30592 for training.
        assert (tok.bos, tok.eos, tok.eod, tok.vocab_size) == (30522, 30523, 30523, 30524)
        assert tok.id_to_token(30522) == "[BOS]"
    ids = lower.tokenize("Hello, World! Unaffable")
    assert [lower.id_to_token(i) for i in ids] == [
        "hello",
        ",",
        "world",
        "!",
        "una",
        "##ffa",
        "##ble",
    ]
    assert lower.detokenize(ids) == "hello, world! unaffable"
    # [CLS]/[SEP] are not added, and are ordinary punctuation + word in text.
    assert lower.tokenize("[CLS]") == lower.tokenize("[ cls ]")


def test_bert_vocab_extra_ids():
    config = config_for("BertWordPieceLowerCase")
    config.vocab_extra_ids = 100
    tok = build_tokenizer(config)
    assert tok.vocab_size == 30624
    assert tok.additional_special_tokens_ids == list(range(30524, 30624))
    assert tok.id_to_token(30524) == "<extra_id_0>"
    assert tok.id_to_token(30623) == "<extra_id_99>"
    assert 30524 not in tok.tokenize("<extra_id_0>")  # never matched in text


def test_bert_accents_and_case():
    lower, case = (build_tokenizer(config_for(k)) for k in TOKENIZER_TYPES[:2])
    assert lower.tokenize("Café") == lower.tokenize("cafe")  # lower-casing strips accents
    assert case.tokenize("Café") != case.tokenize("cafe")
    assert lower.tokenize("a\x00b\u200bc") == lower.tokenize("abc")  # control/format chars go


def test_sentencepiece_special_ids_and_text_handling(built):
    tok = built["SentencePieceTokenizer"]
    # Mistral's model has <unk>, <s>, </s> but no pad piece: <PAD> is added.
    assert (tok.cls, tok.sep, tok.eod, tok.mask, tok.pad) == (32000, 32001, 32002, 32003, 32004)
    assert (tok.bos, tok.eos, tok.vocab_size) == (1, 2, 32005)
    assert tok.id_to_token(32002) == "<EOD>"
    sp = built["GPTSentencePieceTokenizer"]
    # The special strings are found in text; each plain stretch is encoded on its own.
    ids = tok.tokenize("Hello<MASK> world</s>")
    assert ids == [*sp.tokenize("Hello"), 32003, *sp.tokenize(" world"), 2]
    assert tok.tokenize("<s><s>") == [1, 1]
    # Megatron's detokenize puts a space after each stretch and special token.
    assert tok.detokenize(ids) == "Hello <MASK>  world </s> "


def test_sentencepiece_vocab_extra_ids():
    config = config_for("SentencePieceTokenizer")
    config.vocab_extra_ids = 3
    tok = build_tokenizer(config)
    assert tok.additional_special_tokens_ids == [32005, 32006, 32007]
    assert tok.vocab_size == 32008
    assert tok.tokenize("a<extra_id_2>") == [*tok.tokenize("a"), 32007]


def test_gpt_sentencepiece_and_llama2_ids(built):
    gpt, llama = built["GPTSentencePieceTokenizer"], built["Llama2Tokenizer"]
    for tok in (gpt, llama):
        assert (tok.vocab_size, tok.bos, tok.eos, tok.eod) == (32000, 1, 2, 2)
        assert (tok.pad, tok.cls, tok.sep, tok.mask) == (-1, -1, -1, -1)  # Megatron's -1
        assert tok.additional_special_tokens_ids == []
    assert gpt.tokenize("Hello world") == [22557, 1526]
    assert gpt.tokenize("</s>") != [2]  # text, not the eos id
    # Megatron's Llama2Tokenizer.tokenize(s, bos=True, eos=False).
    assert llama.tokenize("Hello world") == [1, 22557, 1526]
    assert llama.tokenize("Hello world", bos=False, eos=True) == [22557, 1526, 2]
    assert llama.tokenize_batch(["Hello world"], bos=False) == [[22557, 1526]]
    assert llama.detokenize([1, 22557, 1526, 2]) == "Hello world"
    assert gpt.id_to_token(22557) == "▁Hello"


def test_huggingface_tokenizer_adds_the_model_special_tokens(built):
    tok = built["HuggingFaceTokenizer"]
    bert = built["BertWordPieceLowerCase"]
    assert tok.vocab_size == 30522  # len(tokenizer)
    assert tok.tokenize("Hello, world!") == [101, *bert.tokenize("Hello, world!"), 102]
    assert (tok.eod, tok.bos) == (None, None)  # a BERT tokenizer.json has no eos/bos
    assert tok.id_to_token(101) == "[CLS]"
    assert tok.detokenize(tok.tokenize("Hello, world!")) == "[CLS] hello, world! [SEP]"


def test_huggingface_tokenizer_reads_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(
        fixture_path("minilm-bert", "tokenizer.json").read_bytes()
    )
    config = {
        "cls_token": "[CLS]",
        "sep_token": {"content": "[SEP]", "__type": "AddedToken"},
        "pad_token": "[PAD]",
        "mask_token": "[MASK]",
        "eos_token": "[SEP]",
        "additional_special_tokens": ["[unused0]"],
        "clean_up_tokenization_spaces": True,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))
    assert (tok.cls, tok.sep, tok.pad, tok.mask, tok.eos, tok.eod) == (101, 102, 0, 103, 102, 102)
    assert tok.additional_special_tokens_ids == [1]
    # tokenizer.json given directly works too.
    direct = TokenizerConfig(
        "HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "tokenizer.json")
    )
    assert build_tokenizer(direct).tokenize("hi") == tok.tokenize("hi")


def test_tiktokenizer_layout(built):
    tok = built["TikTokenizer"]
    gpt2 = built["GPT2BPETokenizer"]
    # Megatron: special tokens first, fillers up to 1000, ranks shifted by 1000.
    assert (tok.unk, tok.bos, tok.eos, tok.eod) == (0, 1, 2, 2)
    assert (tok.mask, tok.pad, tok.cls, tok.sep) == (3, 4, 5, 6)
    assert tok.additional_special_tokens_ids == [3, 4, 5, 6]
    assert tok.vocab_size == 1000 + 50256  # all ranks of gpt2.tiktoken
    assert tok.id_to_token(7) == "<SPECIAL_7>" and tok.id_to_token(999) == "<SPECIAL_999>"
    assert [tok.id_to_token(i) for i in range(3)] == ["<unk>", "<s>", "</s>"]
    ids = tok.tokenize("Hello world")
    assert ids == [i + 1000 for i in gpt2.tokenize("Hello world")]
    assert tok.tokenize("Hello world", bos=True, eos=True) == [1, *ids, 2]
    assert tok.detokenize([1, *ids]) == "<s>Hello world"
    assert tok.tokenize("<s>") == [i + 1000 for i in gpt2.tokenize("<s>")]  # text stays text


def test_tiktokenizer_patterns_and_vocab_size():
    path = fixture_path("gpt2-tiktoken", "gpt2.tiktoken")
    v1 = TikTokenizer(path, pattern="v1")
    v2 = TikTokenizer(path, pattern="v2")
    # v2 splits before an upper-case letter; v1 keeps a run of letters together.
    assert [v1.id_to_token(i) for i in v1.tokenize("iPhone")] == ["iPhone"]
    assert [v2.id_to_token(i) for i in v2.tokenize("iPhone")] == ["i", "Phone"]
    # --vocab-size keeps only the first vocab_size - num_special_tokens ranks.
    small = TikTokenizer(path, vocab_size=1000 + 300)
    assert small.vocab_size == 1300
    ids = small.tokenize("The quick brown fox")
    assert max(ids) < 1300 and small.detokenize(ids) == "The quick brown fox"
    fewer = TikTokenizer(path, num_special_tokens=10, special_tokens=["<unk>", "<s>", "</s>"])
    assert fewer.tokenize("Hi") == [i - 990 for i in v2.tokenize("Hi")]
    assert (fewer.pad, fewer.mask, fewer.additional_special_tokens_ids) == (None, None, [])


def test_tiktokenizer_reads_megatron_json(tmp_path):
    """Megatron's JSON rank format and the .tiktoken format give the same tokenizer."""
    tiktoken_file = fixture_path("gpt2-tiktoken", "gpt2.tiktoken")
    entries = []
    for line in tiktoken_file.read_bytes().splitlines():
        token, rank = line.split()
        raw = base64.b64decode(token)
        entries.append(
            {
                "rank": int(rank),
                "token_bytes": token.decode(),
                "token_str": raw.decode("utf-8", "replace"),
            }
        )
    entries.sort(key=lambda e: e["rank"])
    json_file = tmp_path / "gpt2.json"
    json_file.write_text(json.dumps(entries), encoding="utf-8")
    a, b = TikTokenizer(tiktoken_file), TikTokenizer(json_file)
    assert a.tokenize_batch(SAMPLES) == b.tokenize_batch(SAMPLES)


def test_null_tokenizer(built):
    tok = built["NullTokenizer"]
    # Megatron: eod = --vocab-size, and the vocab size counts it.
    assert (tok.vocab_size, tok.eod, tok.eos) == (1001, 1000, 1000)
    assert (tok.cls, tok.sep, tok.mask, tok.pad, tok.bos) == (-1, -1, -1, None, None)
    assert tok.tokenize("5 17 3") == [5, 17, 3]
    assert tok.detokenize([5, 17, 3]) == "5 17 3"
    assert tok.tokenize("") == []
    assert tok.id_to_token(42) == "42"
    with pytest.raises(ValueError, match="space-separated integers"):
        tok.tokenize("not numbers")


# --- configs ---------------------------------------------------------------------


def test_config_round_trip_through_json():
    config = TokenizerConfig(
        "TikTokenizer",
        tokenizer_model=Path("/models/t/tok.json"),
        vocab_size=131072,
        tiktoken_pattern="v1",
        tokenizer_special_tokens=("<unk>", "<s>", "</s>"),
    )
    assert config.tokenizer_model == "/models/t/tok.json"  # paths kept, as strings
    data = json.loads(json.dumps(config.to_dict()))
    assert TokenizerConfig.from_dict(data) == config
    assert data["tiktoken_num_special_tokens"] == 1000


def test_config_from_megatron_args_ignores_other_keys():
    args = {"tokenizer_type": "GPT2BPETokenizer", "vocab_file": "v.json", "merge_file": "m.txt"}
    args |= {"num_layers": 12, "hidden_size": 768}
    config = TokenizerConfig.from_dict(args)
    assert config == TokenizerConfig("GPT2BPETokenizer", vocab_file="v.json", merge_file="m.txt")
    with pytest.raises(ValueError, match="tokenizer_type"):
        TokenizerConfig.from_dict({"vocab_file": "v.json"})


def test_built_tokenizer_round_trips_through_its_config(built):
    for kind, tok in built.items():
        again = build_tokenizer(TokenizerConfig.from_dict(tok.config.to_dict()))
        assert again.tokenize_batch(SAMPLES[:2] if kind != "NullTokenizer" else ["1 2"]) == (
            tok.tokenize_batch(SAMPLES[:2] if kind != "NullTokenizer" else ["1 2"])
        )


@pytest.mark.parametrize(
    ("orig", "divisible_by", "tp", "padded"),
    [
        (50257, 128, 1, 50304),
        (50257, 128, 8, 51200),
        (30524, 128, 1, 30592),
        (32000, 128, 2, 32000),
        (32005, 128, 1, 32128),
        (1001, 1, 1, 1001),
    ],
)
def test_vocab_size_with_padding(orig, divisible_by, tp, padded):
    assert vocab_size_with_padding(orig, divisible_by, tp) == padded


def test_vocab_size_with_padding_rejects_nonsense():
    with pytest.raises(ValueError):
        vocab_size_with_padding(0)
    with pytest.raises(ValueError):
        vocab_size_with_padding(100, 0)


# --- errors for users ------------------------------------------------------------


def test_unknown_type_lists_the_known_ones():
    with pytest.raises(ValueError, match="GPT2BPETokenizer") as err:
        build_tokenizer(TokenizerConfig("GPT2BPETokeniser"))
    message = str(err.value)
    assert "did you mean GPT2BPETokenizer" in message
    assert all(kind in message for kind in TOKENIZER_TYPES)


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (TokenizerConfig("GPT2BPETokenizer"), "needs --vocab-file"),
        (TokenizerConfig("BertWordPieceCase"), "needs --vocab-file"),
        (TokenizerConfig("SentencePieceTokenizer"), "needs --tokenizer-model"),
        (TokenizerConfig("Llama2Tokenizer"), "needs --tokenizer-model"),
        (TokenizerConfig("TikTokenizer"), "needs --tokenizer-model"),
        (TokenizerConfig("HuggingFaceTokenizer"), "needs --tokenizer-model"),
        (TokenizerConfig("NullTokenizer"), "needs --vocab-size"),
        (
            TokenizerConfig("GPT2BPETokenizer", vocab_file="/no/vocab.json"),
            "--vocab-file /no/vocab.json: does not exist",
        ),
        (
            TokenizerConfig("GPTSentencePieceTokenizer", tokenizer_model="/no/t.model"),
            "--tokenizer-model /no/t.model: does not exist",
        ),
        (
            TokenizerConfig("HuggingFaceTokenizer", tokenizer_model="/no/dir"),
            "--tokenizer-model /no/dir",
        ),
    ],
)
def test_missing_files_name_the_flag_and_path(config, expected):
    with pytest.raises(ValueError, match=expected.replace(".", r"\.")):
        build_tokenizer(config)


def test_missing_merge_file_and_wrong_files(tmp_path):
    vocab = str(fixture_path("gpt2-bpe", "vocab.json"))
    with pytest.raises(ValueError, match="needs --merge-file"):
        build_tokenizer(TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab))
    with pytest.raises(ValueError, match="--merge-file .*: is a folder"):
        build_tokenizer(
            TokenizerConfig("GPT2BPETokenizer", vocab_file=vocab, merge_file=str(tmp_path))
        )
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        build_tokenizer(TokenizerConfig("SentencePieceTokenizer", tokenizer_model=vocab))
    with pytest.raises(ValueError, match=r"has no \[CLS\]"):
        (tmp_path / "vocab.txt").write_text("[UNK]\n[PAD]\nhello\n", encoding="utf-8")
        build_tokenizer(
            TokenizerConfig("BertWordPieceCase", vocab_file=str(tmp_path / "vocab.txt"))
        )
    with pytest.raises(ValueError, match="not a tiktoken rank file"):
        build_tokenizer(TokenizerConfig("TikTokenizer", tokenizer_model=vocab))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(tmp_path)))


def test_tiktokenizer_argument_errors():
    path = str(fixture_path("gpt2-tiktoken", "gpt2.tiktoken"))
    with pytest.raises(ValueError, match="--vocab-size 131072 needs 130072 ranks"):
        TikTokenizer(path, vocab_size=131072)
    with pytest.raises(ValueError, match="--tiktoken-pattern 'v3'"):
        TikTokenizer(path, pattern="v3")
    with pytest.raises(ValueError, match="must include <s>"):
        TikTokenizer(path, special_tokens=["<unk>", "</s>"])


def test_gpt2_backends_agree_and_tiktoken_is_refused_when_unsafe(tmp_path):
    vocab_file, merge_file = (
        fixture_path("gpt2-bpe", "vocab.json"),
        fixture_path("gpt2-bpe", "merges.txt"),
    )
    fast = GPT2BPETokenizer(vocab_file, merge_file)
    assert fast.backend == "tiktoken"
    # Swap two merged tokens' ids: still a valid BPE, but ids no longer follow the merges.
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    a, b = "Ġthe", "Ġand"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    swapped = tmp_path / "vocab.json"
    swapped.write_text(json.dumps(vocab), encoding="utf-8")
    auto = GPT2BPETokenizer(swapped, merge_file)
    assert auto.backend == "tokenizers"
    ids = auto.tokenize("the cat and the dog")
    assert ids == [
        i if i not in (vocab[a], vocab[b]) else vocab[a] + vocab[b] - i
        for i in fast.tokenize("the cat and the dog")
    ]
    with pytest.raises(ValueError, match="not rank consistent"):
        GPT2BPETokenizer(swapped, merge_file, backend="tiktoken")
