"""Long texts are encoded in pieces with exactly the ids of encoding them whole.

Each tokenizer is run twice on the same texts: with pieces of a few dozen
characters (hundreds of cuts, so every awkward neighbourhood meets a cut)
and whole (``piece_chars`` larger than the text). The texts mix real prose
with what could go wrong at a cut: runs of spaces, tabs and newlines,
contractions, accents and combining marks, CJK without spaces, emoji,
characters whose NFKC form starts with a space, literal special tokens.
"""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from mg.core.fixtures import fixture_dir, fixture_path
from mg.core.tokenizers import (
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    GPTSentencePieceTokenizer,
    HuggingFaceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
    TikTokenizer,
)
from mg.core.tokenizers.long_text import cut_points, ordinary_char, pieces

WHOLE = 1 << 40
SMALL = 48

FRAGMENTS = [
    "don't", "I'll", "we're", "it's", "'s", "'ll", " 've", "O'Neil's", "rock 'n' roll",
    "  two", "   three   ", "\t", "\n", "\n\n", " \n ", "\r\n", "\u00a0", "\u3000", "\u200b",
    "naïve café", "e\u0301", "a\u0308 ", " \u0301x", "¨", "´ ", "ﬁne", "Ｆｕｌｌ", "ΟΔΟΣ Σ ΑΣ",
    "日本語のテキスト。", "中文，没有空格！", "한국어 텍스트", "😀👍🏽", "🇯🇵 flag",
    "1234567 89", "3.14159", "$1,000", "x" * 250, "#REDIRECT [[A]]",
    "<|endoftext|>", "<s>", "</s>", "<unk>", "[MASK]", "[CLS]", "<CLS>", "<EOD>", "<mask>",
    "a.b", "end.", "(paren)", "\u0085", "\ufeff", "\x00", "\x1c",
]  # fmt: skip


def tricky_text(seed: int, words: int = 1500) -> str:
    rng = random.Random(seed)
    botchan = fixture_path("botchan", "botchan.txt").read_text("utf-8")
    prose = botchan[5000:20000].split(" ")
    parts = []
    for _ in range(words):
        parts.append(rng.choice(FRAGMENTS) if rng.random() < 0.4 else rng.choice(prose))
        parts.append(rng.choice([" ", " ", " ", "", "  ", "\n", " \t "]))
    return "".join(parts)


TEXTS = [tricky_text(seed) for seed in range(3)] + [
    (fixture_dir("shakespeare") / "hamlet.txt").read_text("utf-8")[:40_000],
    "word " * 2000,
    "    leading spaces, " + "a word " * 40 + "and trailing    ",
]


def assert_same_ids(tokenizer, texts=TEXTS) -> None:
    for text in texts:
        assert len(cut_points(text, SMALL)) > 3  # the texts are really cut
        tokenizer.piece_chars = WHOLE
        whole = tokenizer.tokenize(text)
        tokenizer.piece_chars = SMALL
        assert tokenizer.tokenize(text) == whole
        assert tokenizer.tokenize_batch([text, "short"])[0] == whole
        parts = list(tokenizer.tokenize_in_pieces(text))
        assert len(parts) > 3 or not getattr(tokenizer, "_cuttable", True)
        assert [i for ids in parts for i in ids] == whole


# --- where the cuts fall ----------------------------------------------------------------------


def test_cuts_fall_only_before_a_space_between_ordinary_characters():
    for text in TEXTS:
        cuts = cut_points(text, SMALL)
        assert cuts == sorted(set(cuts))
        for p in cuts:
            assert text[p] == " " and ordinary_char(text[p - 1]) and ordinary_char(text[p + 1])
        assert "".join(pieces(text, SMALL)) == text
        # no piece is shorter than asked, except the last
        assert all(len(piece) >= SMALL for piece in pieces(text, SMALL)[:-1])


def test_no_cut_inside_a_word_or_a_whitespace_run_or_near_an_added_token():
    assert cut_points("x" * 1000, 10) == []  # one long word stays whole
    assert cut_points("日本語" * 300, 10) == []
    assert cut_points("ab  " * 300, 10) == []  # only double spaces: no cut
    assert cut_points("a¨ " * 300 + "b", 10) == []  # ¨ is " \u0308" under NFKC
    text = "a b " * 50 + "a <mask> b " * 50
    cuts = cut_points(text, 10, avoid=("<MASK>",))  # case-insensitively near
    assert cuts and all("<mask>" not in text[p - 7 : p + 8] for p in cuts)
    assert cut_points("short text", 100) == []


def test_ordinary_characters():
    assert all(ordinary_char(c) for c in "aZ9.,'\"(日한😀€")
    assert not any(ordinary_char(c) for c in " \t\n\u00a0\u3000\u0301\u200b\x00\u0378¨´")


# --- every tokenizer: pieces give the ids of the whole ----------------------------------------


@pytest.fixture(scope="module")
def gpt2_files():
    return fixture_path("gpt2-bpe", "vocab.json"), fixture_path("gpt2-bpe", "merges.txt")


def test_gpt2_openai_vocabulary_tiktoken(gpt2_files):
    tokenizer = GPT2BPETokenizer(*gpt2_files)
    assert tokenizer.backend == "tiktoken"
    assert_same_ids(tokenizer)


def test_gpt2_openai_vocabulary_tokenizers(gpt2_files):
    assert_same_ids(GPT2BPETokenizer(*gpt2_files, backend="tokenizers"))


@pytest.fixture(scope="module")
def trained_gpt2(tmp_path_factory):
    """A byte-level BPE trained on Botchan: vocab.json + merges.txt and a tokenizer.json."""
    folder = tmp_path_factory.mktemp("trained")
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    text = fixture_path("botchan", "botchan.txt").read_text("utf-8")
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    tokenizer.model.save(str(folder))
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"})
    )
    return folder


def test_gpt2_trained_vocabulary(trained_gpt2):
    tokenizer = GPT2BPETokenizer(trained_gpt2 / "vocab.json", trained_gpt2 / "merges.txt")
    assert tokenizer.backend == "tokenizers"  # the path that kept ~330 bytes a token
    assert_same_ids(tokenizer)


def test_hf_byte_level_bpe(trained_gpt2):
    tokenizer = HuggingFaceTokenizer(trained_gpt2)
    assert tokenizer._cuttable
    assert_same_ids(tokenizer)


def test_hf_llama3_style_split_and_template(trained_gpt2, tmp_path):
    """Split(Llama 3's pattern) + ByteLevel without regex, BOS added by a template."""
    spec = json.loads((trained_gpt2 / "tokenizer.json").read_text("utf-8"))
    from mg.core.tokenizers.huggingface import _LLAMA3_PATTERN

    spec["pre_tokenizer"] = {
        "type": "Sequence",
        "pretokenizers": [
            {
                "type": "Split",
                "pattern": {"Regex": _LLAMA3_PATTERN},
                "behavior": "Isolated",
                "invert": False,
            },
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
             "use_regex": False},
        ],
    }  # fmt: skip
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
            {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}],
        "special_tokens": {
            "<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}
        },
    }  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tokenizer = HuggingFaceTokenizer(tmp_path)
    assert tokenizer._cuttable
    assert_same_ids(tokenizer)
    ids = tokenizer.tokenize(TEXTS[0])
    assert ids[0] == 0 and ids[-1] == 0 and ids.count(0) == 2 + TEXTS[0].count("<|endoftext|>")


def test_hf_bert_wordpiece_with_cls_sep():
    tokenizer = HuggingFaceTokenizer(fixture_dir("minilm-bert"))
    assert tokenizer._cuttable
    assert_same_ids(tokenizer)


def test_hf_unknown_pre_tokenizer_is_encoded_whole(trained_gpt2, tmp_path):
    spec = json.loads((trained_gpt2 / "tokenizer.json").read_text("utf-8"))
    spec["pre_tokenizer"] = {"type": "Digits", "individual_digits": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    tokenizer = HuggingFaceTokenizer(tmp_path)
    assert not tokenizer._cuttable
    assert_same_ids(tokenizer, TEXTS[:1])


@pytest.mark.parametrize("lower_case", [True, False])
def test_bert_wordpiece(lower_case):
    assert_same_ids(BertWordPieceTokenizer(fixture_path("minilm-bert", "vocab.txt"), lower_case))


@pytest.mark.parametrize(
    "kind", [GPTSentencePieceTokenizer, Llama2Tokenizer, SentencePieceTokenizer]
)
def test_sentencepiece(kind):
    tokenizer = kind(fixture_path("mistral-spm", "tokenizer.model"))
    assert tokenizer._cut_space == "strip"
    assert_same_ids(tokenizer)


def test_sentencepiece_trained_models(tmp_path):
    """Unigram and BPE models trained here, with and without extra-whitespace removal."""
    import sentencepiece

    text = fixture_path("botchan", "botchan.txt").read_text("utf-8")
    (tmp_path / "corpus.txt").write_text(text, encoding="utf-8")
    for model_type in ("unigram", "bpe"):
        for remove in (True, False):
            prefix = tmp_path / f"{model_type}-{remove}"
            sentencepiece.SentencePieceTrainer.train(
                input=str(tmp_path / "corpus.txt"),
                model_prefix=str(prefix),
                vocab_size=500,
                model_type=model_type,
                remove_extra_whitespaces=remove,
                minloglevel=2,
            )
            tokenizer = GPTSentencePieceTokenizer(f"{prefix}.model")
            assert tokenizer._cut_space == "strip"
            assert_same_ids(tokenizer)


def test_tiktokenizer():
    tokenizer = TikTokenizer(fixture_path("gpt2-tiktoken", "gpt2.tiktoken"), pattern="v2")
    assert_same_ids(tokenizer)


@pytest.mark.parametrize(
    ("pre_tokenizer", "normalizer"),
    [
        (pre_tokenizers.Metaspace(), None),
        (pre_tokenizers.Metaspace(prepend_scheme="first"), None),
        (
            pre_tokenizers.Whitespace(),
            normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
        ),
        (pre_tokenizers.ByteLevel(add_prefix_space=True), None),
    ],
    ids=["metaspace", "metaspace-first", "whitespace-nfkc-lower", "byte-level-prefix-space"],
)
def test_hf_other_pre_tokenizers(pre_tokenizer, normalizer, tmp_path):
    tokenizer = HFTokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizer
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<unk>"], show_progress=False)
    text = fixture_path("botchan", "botchan.txt").read_text("utf-8")
    tokenizer.train_from_iterator(text.splitlines(), trainer)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = HuggingFaceTokenizer(tmp_path)
    assert loaded._cuttable
    assert_same_ids(loaded)
