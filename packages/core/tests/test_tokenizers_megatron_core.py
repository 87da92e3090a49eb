"""Against megatron-core's own TikTokenizer and NullTokenizer (installed for tests only).

megatron-core 0.16 ships its newer tokenizer library, which keeps the
classic TikTokenizer layout (special tokens first, ranks shifted by
``num_special_tokens``) and NullTokenizer. Importing megatron-core takes
~20 s (it pulls in its training stack), hence ``slow``.
"""

from __future__ import annotations

import base64
import json
import warnings

import pytest

from mg.core.fixtures import fixture_path
from mg.core.tokenizers import NullTokenizer, TikTokenizer

pytestmark = [pytest.mark.slow, pytest.mark.compat]

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.\n\nIt's 3:45 p.m., isn't it?",
    "getElementById iPhone McDonald  spaces\t\ttabs\r\n",
    "Ünïcödé naïve café — “quotes” 日本語 🥰 1234567",
]


@pytest.fixture(scope="module")
def megatron_json(tmp_path_factory):
    """gpt2.tiktoken in Megatron's JSON rank format (byte b as rank b, as it requires)."""
    entries = []
    for line in fixture_path("gpt2-tiktoken", "gpt2.tiktoken").read_bytes().splitlines():
        token, rank = line.split()
        raw = base64.b64decode(token)
        entries.append((raw[0] if len(raw) == 1 else int(rank), raw))
    entries.sort()
    assert [r for r, _ in entries] == list(range(len(entries)))
    path = tmp_path_factory.mktemp("tiktoken") / "gpt2.json"
    data = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(raw).decode(),
            "token_str": raw.decode("utf-8", "replace"),
        }
        for rank, raw in entries
    ]
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def libraries():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers.text.libraries import null_tokenizer, tiktoken_tokenizer
    return null_tokenizer, tiktoken_tokenizer


@pytest.mark.parametrize("pattern", ["v1", "v2"])
def test_tiktokenizer_matches_megatron_core(libraries, megatron_json, pattern):
    _, tiktoken_tokenizer = libraries
    vocab_size = 1000 + 50256
    theirs = tiktoken_tokenizer.TikTokenTokenizer(
        str(megatron_json), pattern=pattern, vocab_size=vocab_size
    )
    ours = TikTokenizer(megatron_json, pattern=pattern, vocab_size=vocab_size)
    assert ours.vocab_size == theirs.vocab_size
    specials = ("bos", "eos", "eod", "pad", "mask", "cls", "sep", "unk")
    assert [getattr(ours, s) for s in specials] == [
        theirs.bos_id,
        theirs.eos_id,
        theirs.eod,
        theirs.pad_id,
        theirs.mask_id,
        theirs.cls_id,
        theirs.sep_id,
        theirs.unk_id,
    ]
    assert ours.additional_special_tokens_ids == theirs.additional_special_tokens_ids
    for text in TEXTS:
        ids = ours.tokenize(text)
        assert ids == theirs.text_to_ids(text)
        # megatron-core decodes token by token, which garbles a character split
        # across tokens; the classic TikTokenizer (and we) decode the whole byte run.
        assert ours.detokenize(ids) == (theirs.ids_to_text(ids) if text.isascii() else text)
        assert [ours.id_to_token(i) for i in ids] == theirs.ids_to_tokens(ids)
    assert [ours.id_to_token(i) for i in range(10)] == theirs.ids_to_tokens(list(range(10)))
    # Truncation to --vocab-size keeps the same ranks.
    small_theirs = tiktoken_tokenizer.TikTokenTokenizer(str(megatron_json), vocab_size=1500)
    small_ours = TikTokenizer(megatron_json, vocab_size=1500)
    assert [small_ours.tokenize(t) for t in TEXTS] == [small_theirs.text_to_ids(t) for t in TEXTS]


def test_null_tokenizer_matches_megatron_core(libraries):
    null_tokenizer, _ = libraries
    theirs, ours = null_tokenizer.NullTokenizer(5000), NullTokenizer(5000)
    assert (ours.vocab_size, ours.eod) == (theirs.vocab_size, theirs.eod)
    assert (ours.cls, ours.sep, ours.mask) == (theirs.cls, theirs.sep, theirs.mask)
    assert ours.tokenize("1 22 333") == theirs.text_to_ids("1 22 333")
    assert ours.detokenize([1, 22, 333]) == theirs.ids_to_text([1, 22, 333])
