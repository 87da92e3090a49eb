"""BertDataset / T5Dataset: identical samples to Megatron-Core's masked datasets,
plus properties that hold regardless (the reference is optional).

The corpus is synthetic WordPiece: words `w{i}` (a word start) and `##p{i}`
(a continuation piece), so whole word masking has multi-piece words to group;
documents have 0-8 sentences, including empty and one-sentence documents, and
one over-long sentence (which makes Megatron skip its document).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from mg.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from mg.indexed_dataset.bert_dataset import BertDataset
from mg.indexed_dataset.masking import MaskingConfig, build_sentence_sample_index, mt19937_64
from mg.indexed_dataset.t5_dataset import T5Dataset

SEQ, DEC_SEQ, SEED, DOCS = 64, 32, 1234, 140

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
NUM_WORDS, NUM_PIECES, NUM_SENTINELS = 300, 100, 100


class StubWordPieceTokenizer:
    """The attributes Megatron's masked datasets read (as mg.core's BertWordPieceTokenizer)."""

    def __init__(self) -> None:
        tokens = (
            SPECIAL + [f"w{i}" for i in range(NUM_WORDS)] + [f"##p{i}" for i in range(NUM_PIECES)]
        )
        tokens += ["[BOS]", "[EOS]"] + [f"<extra_id_{i}>" for i in range(NUM_SENTINELS)]
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.inv_vocab = {i: t for t, i in self.vocab.items()}
        self.pad, self.cls, self.sep, self.mask = 0, 2, 3, 4
        self.bos, self.eos = self.vocab["[BOS]"], self.vocab["[EOS]"]
        self.eod = self.eos
        self.additional_special_tokens_ids = [self.vocab[f"<extra_id_{i}>"] for i in range(100)]
        self.vocab_size = len(tokens)
        self.unique_identifiers = {"class": "StubWordPieceTokenizer"}  # Megatron hashes this


def write_sentence_corpus(prefix: Path, num_docs: int = 150, seed: int = 0) -> str:
    rng = np.random.RandomState(seed)
    first_word, first_piece = len(SPECIAL), len(SPECIAL) + NUM_WORDS
    builder = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.uint16)
    for doc in range(num_docs):
        for _ in range(rng.randint(0, 9)):
            length = 600 if doc == 7 else rng.randint(3, 40)
            ids = [first_word + rng.randint(NUM_WORDS)]
            while len(ids) < length:
                if rng.random() < 0.3:
                    ids.append(first_piece + rng.randint(NUM_PIECES))
                else:
                    ids.append(first_word + rng.randint(NUM_WORDS))
            builder.add_item(np.array(ids))
        builder.end_document()
    builder.finalize(str(prefix) + ".idx")
    return str(prefix)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_sentence_corpus(tmp_path_factory.mktemp("corpus") / "corpus_text_sentence")


def ours(cls, corpus: str, cache: Path, num_samples: int | None, **kwargs):
    return cls(
        IndexedDataset(corpus),
        corpus,
        np.arange(DOCS),
        num_samples,
        SEQ,
        StubWordPieceTokenizer(),
        seed=SEED,
        cache_dir=str(cache),
        **kwargs,
    )


def test_mt19937_64_matches_the_cpp_standard():
    # C++11 [rand.predef]: the 10000th output of a default-seeded mt19937_64.
    assert int(mt19937_64(5489, 10000)[-1]) == 9981545732273789042


def test_bert_sample_properties(corpus: str, tmp_path: Path):
    tok = StubWordPieceTokenizer()
    ds = ours(BertDataset, corpus, tmp_path, 200)
    assert len(ds) >= 200
    for k in range(len(ds)):
        s = ds[k]
        text, types, real = s["text"], s["types"], s["padding_mask"] == 1
        n = int(real.sum())
        assert real[:n].all() and not real[n:].any()
        assert text[0] == tok.cls and (text[:n] == tok.sep).sum() == 2 and text[n - 1] == tok.sep
        sep_a = int(np.flatnonzero(text[:n] == tok.sep)[0])
        assert (types[: sep_a + 1] == 0).all() and (types[sep_a + 1 : n] == 1).all()
        masked = s["loss_mask"] == 1
        assert (s["labels"][~masked] == -1).all()
        assert not masked[0] and not (masked & (text == tok.sep)).any()
        assert masked.sum() <= max(1, round(0.15 * n))  # Megatron's budget
        assert s["is_random"] in (0, 1)
    swapped = np.mean([ds[k]["is_random"] for k in range(len(ds))])
    assert 0.35 < swapped < 0.65
    # 80/10/10 over all masked positions
    replaced = [
        (ds[k]["text"][ds[k]["loss_mask"] == 1], ds[k]["labels"][ds[k]["loss_mask"] == 1])
        for k in range(len(ds))
    ]
    text = np.concatenate([t for t, _ in replaced])
    labels = np.concatenate([lab for _, lab in replaced])
    as_mask = np.mean(text == tok.mask)
    kept = np.mean(text == labels)
    assert 0.72 < as_mask < 0.88 and 0.04 < kept < 0.16


def test_whole_word_masking_masks_whole_words(corpus: str, tmp_path: Path):
    tok = StubWordPieceTokenizer()
    ds = ours(BertDataset, corpus, tmp_path, 100)
    for k in range(len(ds)):
        s = ds[k]
        masked = np.flatnonzero(s["loss_mask"])
        original = s["text"].copy()
        assert len(masked) or s["padding_mask"].sum() < 20
        original[masked] = s["labels"][masked]
        words = [i for i in range(len(original)) if original[i] not in (tok.cls, tok.sep)]
        words = [i for i in words if s["padding_mask"][i] == 1]
        for prev, i in zip(words, words[1:], strict=False):
            # A continuation piece belongs to the word before it (across a [SEP] too,
            # as in Megatron, after trimming cut a word): both masked or neither.
            if tok.inv_vocab[int(original[i])].startswith("##"):
                assert s["loss_mask"][i] == s["loss_mask"][prev], (k, i)


def test_t5_sample_properties(corpus: str, tmp_path: Path):
    tok = StubWordPieceTokenizer()
    ds = ours(T5Dataset, corpus, tmp_path, 100, decoder_sequence_length=DEC_SEQ)
    sentinels = set(tok.additional_special_tokens_ids)
    for k in range(len(ds)):
        s = ds[k]
        enc = s["text_enc"][s["enc_mask"] == 1].tolist()
        dec = s["text_dec"][s["dec_mask"] == 1].tolist()
        labels = s["labels"][s["loss_mask"] == 1].tolist()
        assert dec[0] == tok.bos and labels == dec[1:] + [tok.eos]
        used = [t for t in enc if t in sentinels]
        assert used == tok.additional_special_tokens_ids[: len(used)]
        assert [t for t in dec if t in sentinels] == used
        assert tok.mask not in enc  # every masked token went into a span


def test_sample_index_is_cached(corpus: str, tmp_path: Path):
    first = ours(BertDataset, corpus, tmp_path, 50)
    files = sorted(p.name for p in tmp_path.iterdir())
    assert any(f.endswith("sample_index.npy") for f in files)
    again = ours(BertDataset, corpus, tmp_path, 50)
    np.testing.assert_array_equal(first.sample_index, again.sample_index)


def test_no_sentence_pairs_is_a_clear_error(tmp_path: Path):
    prefix = str(tmp_path / "docs")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(5):
        builder.add_document(np.arange(5, 20), [15])
    builder.finalize(prefix + ".idx")
    with pytest.raises(ValueError, match="split-sentences"):
        build_sentence_sample_index(
            IndexedDataset(prefix).document_indices,
            IndexedDataset(prefix).sequence_lengths,
            10,
            61,
            0.1,
            SEED,
            2,
        )


# --- identical to Megatron-Core ----------------------------------------------------------

torch = pytest.importorskip("torch")
megatron_bert = pytest.importorskip("megatron.core.datasets.bert_dataset")


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if torch.distributed.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("dist") / "store"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def _megatron(kind: str, corpus: str, cache: Path, num_samples: int, **options):
    from megatron.core.datasets import t5_dataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset as MegatronIndexed
    from megatron.core.datasets.utils import Split

    masking = MaskingConfig.t5() if kind == "t5" else MaskingConfig()
    common = dict(
        random_seed=SEED,
        sequence_length=SEQ,
        blend=([corpus], None),
        split="100,0,0",
        path_to_cache=str(cache),
        tokenizer=StubWordPieceTokenizer(),
        masking_probability=masking.masking_probability,
        short_sequence_probability=masking.short_sequence_probability,
        masking_max_ngram=masking.masking_max_ngram,
        masking_do_full_word=masking.masking_do_full_word,
        masking_do_permutation=False,
        masking_use_longer_ngrams=masking.masking_use_longer_ngrams,
        masking_use_geometric_distribution=masking.masking_use_geometric_distribution,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "t5":
            cfg = t5_dataset.T5MaskedWordPieceDatasetConfig(
                **common, sequence_length_decoder=DEC_SEQ
            )
            cls = t5_dataset.T5MaskedWordPieceDataset
        else:
            cfg = megatron_bert.BERTMaskedWordPieceDatasetConfig(**common, **options)
            cls = megatron_bert.BERTMaskedWordPieceDataset
        return cls(MegatronIndexed(corpus), corpus, np.arange(DOCS), num_samples, Split.train, cfg)


def _assert_same(a: dict, b: dict, k: int) -> None:
    assert a.keys() == b.keys(), k
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=f"{k} {key}")


@pytest.mark.compat
@pytest.mark.parametrize("head", [True, False])
def test_bert_samples_identical_to_megatron(corpus, tmp_path, one_rank_group, head):
    reference = _megatron("bert", corpus, tmp_path / "m", 300, classification_head=head)
    mine = ours(BertDataset, corpus, tmp_path / "o", 300, classification_head=head)
    np.testing.assert_array_equal(mine.sample_index, np.asarray(reference.sample_index))
    assert len(mine) == len(reference) >= 300
    for k in range(len(mine)):
        _assert_same(mine[k], reference[k], k)


@pytest.mark.compat
def test_t5_samples_identical_to_megatron(corpus, tmp_path, one_rank_group):
    reference = _megatron("t5", corpus, tmp_path / "m", 300)
    mine = ours(T5Dataset, corpus, tmp_path / "o", 300, decoder_sequence_length=DEC_SEQ)
    np.testing.assert_array_equal(mine.sample_index, np.asarray(reference.sample_index))
    for k in range(len(mine)):
        _assert_same(mine[k], reference[k], k)


@pytest.mark.compat
def test_sample_index_identical_to_megatron_helpers():
    from megatron.core.datasets import helpers_cpp

    rng = np.random.RandomState(0)
    for trial in range(12):
        counts = rng.randint(0, 12, size=rng.randint(1, 60))
        bounds = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        sizes = rng.randint(1, 60, size=bounds[-1]).astype(np.int32)
        if trial % 3 == 0 and len(sizes):
            sizes[rng.randint(len(sizes))] = 600
        seq = int(rng.choice([5, 30, 125]))
        prob = float(rng.choice([0.0, 0.1, 0.5, 1.0]))
        min_sent = int(rng.choice([1, 2]))
        num = [1, 50, 400][trial % 3]
        ref = helpers_cpp.build_mapping(
            bounds, sizes, np.iinfo(np.int32).max - 1, num, seq, prob, SEED + trial, False, min_sent
        )
        if len(ref) == 0:
            continue
        got = build_sentence_sample_index(bounds, sizes, num, seq, prob, SEED + trial, min_sent)
        np.testing.assert_array_equal(got, ref.astype(np.int64))
