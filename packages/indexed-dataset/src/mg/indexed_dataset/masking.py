"""Masked-LM sample building shared by the BERT and T5 datasets.

Two pieces, both reproducing Megatron-Core (`datasets/helpers.cpp:
build_mapping`, `datasets/masked_dataset.py`) value for value, so that sample
k of ours is sample k of Megatron's for the same data, seed and config:

- `build_sentence_sample_index`: which consecutive sentences of a document
  form each sample, and the sample's target length (sometimes short, with
  `short_sequence_probability`), shuffled. Megatron does this in C++ with
  `std::mt19937` / `std::mt19937_64`; we draw the very same numbers
  (numpy's MT19937 with legacy seeding *is* std::mt19937; MT19937-64 is
  implemented below).
- `create_masked_lm_predictions`: choose N-grams of (whole) words to mask
  with a per-sample `numpy.random.RandomState`, calling it in Megatron's order.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from mg.indexed_dataset.indices import cached_indices

LONG_SENTENCE_LEN = 512
"""Documents with a sentence longer than this are skipped (Megatron's helpers.cpp)."""


@dataclass
class MaskingConfig:
    """Megatron's MaskedWordPieceDatasetConfig fields (`--mask-prob`, `--short-seq-prob`, ...).

    Defaults are Megatron-LM's BERT settings; `MaskingConfig.t5()` gives T5's.
    """

    masking_probability: float = 0.15
    short_sequence_probability: float = 0.1
    masking_max_ngram: int = 3
    masking_do_full_word: bool = True
    masking_use_longer_ngrams: bool = False
    masking_use_geometric_distribution: bool = False

    @classmethod
    def t5(cls) -> MaskingConfig:
        """pretrain_t5.py: spans up to 10 words, lengths geometric (p = 0.2), as SpanBERT."""
        return cls(masking_max_ngram=10, masking_use_geometric_distribution=True)

    def __post_init__(self) -> None:
        if not 0.0 < self.masking_probability < 1.0:
            raise ValueError(
                f"masking_probability must be in (0, 1), got {self.masking_probability}"
            )
        if not 0.0 <= self.short_sequence_probability <= 1.0:
            raise ValueError(
                "short_sequence_probability must be in [0, 1], got "
                f"{self.short_sequence_probability}"
            )
        if self.masking_max_ngram < 1:
            raise ValueError(f"masking_max_ngram must be >= 1, got {self.masking_max_ngram}")


# --- std::mt19937 and std::mt19937_64 -----------------------------------------------


class Mt19937:
    """std::mt19937(seed) outputs, buffered (numpy's MT19937 with legacy seeding)."""

    def __init__(self, seed: int) -> None:
        self._bits = np.random.MT19937()
        self._bits._legacy_seeding(seed)
        self._buffer: list[int] = []

    def __call__(self) -> int:
        if not self._buffer:
            self._buffer = self._bits.random_raw(4096).tolist()[::-1]
        return self._buffer.pop()


_NN, _MM = 312, 156
_MATRIX_A = np.uint64(0xB5026F5AA96619E9)
_UPPER, _LOWER = np.uint64(0xFFFFFFFF80000000), np.uint64(0x7FFFFFFF)


def _twist(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    z = (x & _UPPER) | (y & _LOWER)
    return (z >> np.uint64(1)) ^ np.where(z & np.uint64(1), _MATRIX_A, np.uint64(0))


def mt19937_64(seed: int, count: int) -> np.ndarray:
    """The first `count` outputs of C++'s std::mt19937_64(seed), as uint64."""
    state = [seed & 0xFFFFFFFFFFFFFFFF]
    for i in range(1, _NN):
        prev = state[-1]
        state.append((6364136223846793005 * (prev ^ (prev >> 62)) + i) & 0xFFFFFFFFFFFFFFFF)
    mt = np.array(state, dtype=np.uint64)
    blocks = []
    for _ in range(-(-count // _NN)):
        # The twist, vectorised in the three stretches whose inputs are ready.
        k = _NN - _MM
        mt[:k] = mt[_MM:] ^ _twist(mt[:k], mt[1 : k + 1])
        mt[k : _NN - 1] = mt[: _NN - 1 - k] ^ _twist(mt[k : _NN - 1], mt[k + 1 :])
        mt[_NN - 1] = mt[_MM - 1] ^ _twist(mt[_NN - 1 :], mt[:1])[0]
        x = mt.copy()
        x ^= (x >> np.uint64(29)) & np.uint64(0x5555555555555555)
        x ^= (x << np.uint64(17)) & np.uint64(0x71D67FFFEDA60000)
        x ^= (x << np.uint64(37)) & np.uint64(0xFFF7EEE000000000)
        x ^= x >> np.uint64(43)
        blocks.append(x)
    return np.concatenate(blocks)[:count] if blocks else np.zeros(0, dtype=np.uint64)


# --- the sample index ------------------------------------------------------------------


def build_sentence_sample_index(
    document_boundaries: np.ndarray,
    sentence_lengths: np.ndarray,
    num_samples: int | None,
    max_sequence_length: int,
    short_sequence_probability: float,
    seed: int,
    min_sentences_per_sample: int,
) -> np.ndarray:
    """[n, 3] int64 rows (first sentence, end sentence, target length), shuffled.

    `document_boundaries` are sentence indices: document d of the split is
    sentences [b[d], b[d+1]). Each document (with at least
    `min_sentences_per_sample` sentences, none longer than 512 tokens) is cut
    greedily: sentences are added until the running length reaches the target,
    unless only one sentence would be left (then the document's end closes
    the sample). With `num_samples`, whole epochs are added until at least that
    many samples exist (Megatron keeps the whole last epoch; so do we).
    """
    if max_sequence_length <= 1:
        raise ValueError(f"max_sequence_length must be > 1, got {max_sequence_length}")
    if seed <= 0:
        raise ValueError(f"seed must be positive (Megatron asserts it), got {seed}")
    short_ratio = int(round(1.0 / short_sequence_probability)) if short_sequence_probability else 0
    rand32 = Mt19937(seed)

    def target_length() -> int:
        if short_ratio == 0:
            return max_sequence_length
        r = rand32()
        return 2 + r % (max_sequence_length - 1) if r % short_ratio == 0 else max_sequence_length

    bounds = np.asarray(document_boundaries, dtype=np.int64).tolist()
    sizes = np.asarray(sentence_lengths)
    eligible = []
    for first, last in zip(bounds[:-1], bounds[1:], strict=False):
        n = last - first
        long = n > 1 and bool((sizes[first:last] > LONG_SENTENCE_LEN).any())
        if n >= min_sentences_per_sample and not long:
            eligible.append((first, last))
    if not eligible:
        raise ValueError(
            f"no document has at least {min_sentences_per_sample} sentence(s) of at most "
            f"{LONG_SENTENCE_LEN} tokens, so no sample can be built; a BERT dataset with the "
            "binary head needs sentence-split data (`mg-prep --split-sentences`)"
        )
    lengths = sizes.tolist()
    rows: list[tuple[int, int, int]] = []
    while True:
        if num_samples is not None and len(rows) >= num_samples:
            break
        for first, last in eligible:
            seq_len, num_sent, remaining = 0, 0, last - first
            target = target_length()
            start = first
            for sent in range(first, last):
                seq_len += lengths[sent]
                num_sent += 1
                remaining -= 1
                if (
                    seq_len >= target and remaining > 1 and num_sent >= min_sentences_per_sample
                ) or remaining == 0:
                    rows.append((start, sent + 1, target))
                    start = sent + 1
                    target = target_length()
                    seq_len, num_sent = 0, 0
        if num_samples is None:
            break
    index = np.array(rows, dtype=np.int64).reshape(-1, 3)
    # Fisher-Yates with std::mt19937_64(seed + 1), as helpers.cpp.
    n = len(index)
    if n > 1:
        draws = mt19937_64(seed + 1, n - 1)
        i = np.arange(n - 1, 0, -1, dtype=np.uint64)
        swaps = (draws % (i + np.uint64(1))).astype(np.int64).tolist()
        order = list(range(n))
        for i_, j in zip(range(n - 1, 0, -1), swaps, strict=True):
            order[i_], order[j] = order[j], order[i_]
        index = index[order]
    return index


# --- masking ---------------------------------------------------------------------------


@dataclass
class MaskedPredictions:
    tokens: list[int]
    positions: list[int]
    labels: list[int]
    spans: list[tuple[list[int], list[int]]]
    """(positions, original ids) per masked N-gram, in position order (T5 uses these)."""


def create_masked_lm_predictions(
    token_ids: Sequence[int],
    target_sequence_length: int,
    rng: np.random.RandomState,
    config: MaskingConfig,
    special_ids: set[int],
    is_continuation: Callable[[int], bool],
    replacement: Callable[[np.random.RandomState], int | None],
) -> MaskedPredictions:
    """Megatron's `_create_masked_lm_predictions` (without the unused permutation option).

    Candidates are words (with whole-word masking a word is its first piece
    and the following `##` pieces) outside [CLS]/[SEP]. About
    `masking_probability` of the tokens are masked, in N-grams of words whose
    N is drawn ∝ 1/N (or geometric, p = 0.2), never exceeding the budget.
    `replacement(rng)` gives the id to write (None keeps the token).
    """
    candidates: list[list[int]] = []
    for i, token in enumerate(token_ids):
        if token in special_ids:
            continue
        if is_continuation(token) and config.masking_do_full_word and candidates:
            candidates[-1].append(i)
        else:
            candidates.append([i])

    n_maskings = min(
        config.masking_probability * target_sequence_length,
        max(1, int(round(len(token_ids) * config.masking_probability))),
    )
    ngram_sizes = np.arange(config.masking_max_ngram, dtype=np.int64) + 1
    probs = 1.0 / ngram_sizes
    probs = probs / probs.sum(keepdims=True)
    if config.masking_use_longer_ngrams:
        probs = probs[::-1]
    candidate_ngrams = [
        [candidates[idx : idx + n] for n in ngram_sizes] for idx in range(len(candidates))
    ]
    rng.shuffle(candidate_ngrams)

    masked = list(token_ids)
    positions_and_labels: list[tuple[int, int]] = []
    spans: list[tuple[list[int], list[int]]] = []
    masked_indices: set[int] = set()
    for ngrams in candidate_ngrams:
        if len(positions_and_labels) >= n_maskings:
            break
        if not ngrams:
            continue
        if config.masking_use_geometric_distribution:
            n = min(rng.geometric(0.2), config.masking_max_ngram)
        else:
            p = probs[: len(ngrams)] / probs[: len(ngrams)].sum(keepdims=True)
            n = rng.choice(ngram_sizes[: len(ngrams)], p=p)
        while True:  # shrink N until the N-gram fits the budget
            indices = sum(ngrams[n - 1], [])
            n -= 1
            if n_maskings >= len(positions_and_labels) + len(indices):
                skip = False
                break
            if n == 0:
                skip = True
                break
        if skip or any(i in masked_indices for i in indices):
            continue
        for i in indices:
            masked_indices.add(i)
            replace = replacement(rng)
            masked[i] = token_ids[i] if replace is None else replace
            positions_and_labels.append((i, token_ids[i]))
        spans.append((indices, [token_ids[i] for i in indices]))
    rng.shuffle(candidate_ngrams)  # Megatron draws this shuffle too; keep the stream aligned

    positions_and_labels.sort(key=lambda x: x[0])
    spans.sort(key=lambda x: x[0][0])
    return MaskedPredictions(
        tokens=masked,
        positions=[p for p, _ in positions_and_labels],
        labels=[label for _, label in positions_and_labels],
        spans=spans,
    )


# --- the dataset base --------------------------------------------------------------------


class WordPieceTokenizer(Protocol):
    """What the masked datasets need of a tokenizer (mg.core's BertWordPieceTokenizer fits)."""

    cls: int
    sep: int
    mask: int
    pad: int

    @property
    def inv_vocab(self) -> dict[int, str]: ...


class MaskedWordPieceDataset:
    """Samples of consecutive sentences of one document (`_text_sentence` data).

    `document_ids` are the split's documents (a contiguous range, as `split.py`
    gives). The sample index is cached as `.npy` under `cache_dir` (default
    `<prefix>/cache/<Class>_indices`), named by the md5 of everything it depends on.
    Sample k uses `RandomState((seed + k) % 2**32)`, so samples are reproducible
    in any order.
    """

    reserved_tokens = 0
    """Tokens per sample not taken from the text ([CLS] [SEP] [SEP] for BERT)."""

    def __init__(
        self,
        dataset: Any,
        dataset_path: str,
        document_ids: np.ndarray,
        num_samples: int | None,
        sequence_length: int,
        tokenizer: WordPieceTokenizer,
        masking: MaskingConfig | None = None,
        seed: int = 1234,
        cache_dir: str | None = None,
        split_name: str = "train",
    ) -> None:
        self.dataset = dataset
        self.dataset_path = dataset_path
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        if len(self.document_ids) == 0 or np.any(np.diff(self.document_ids) != 1):
            raise ValueError("document_ids must be a non-empty contiguous range of documents")
        self.num_samples = num_samples
        self.sequence_length = sequence_length
        self.tokenizer = tokenizer
        self.masking = masking or self.default_masking()
        self.seed = seed
        self.split_name = split_name
        self.pad_token_id = tokenizer.pad
        self.token_lookup = list(tokenizer.inv_vocab.keys())
        identifiers = {
            "class": type(self).__name__,
            "dataset_path": dataset_path,
            "documents": [int(self.document_ids[0]), int(self.document_ids[-1]) + 1],
            "num_samples": num_samples,
            "split": split_name,
            "random_seed": seed,
            "sequence_length": sequence_length,
            "min_sentences": self.min_sentences_per_sample(),
            "short_sequence_probability": self.masking.short_sequence_probability,
        }
        self.unique_identifiers = identifiers  # a blend's cache key names its parts by these
        description = json.dumps(identifiers, indent=4)
        digest = hashlib.md5(description.encode("utf-8"), usedforsecurity=False).hexdigest()
        if cache_dir is None:
            cache_dir = os.path.join(dataset_path, "cache", f"{type(self).__name__}_indices")
        self.sample_index = cached_indices(
            cache_dir,
            f"{digest}-{type(self).__name__}",
            description,
            ["sample_index"],
            lambda: {"sample_index": self._build_sample_index()},
        )["sample_index"]

    @classmethod
    def default_masking(cls) -> MaskingConfig:
        return MaskingConfig()

    def min_sentences_per_sample(self) -> int:
        return 1

    def _build_sample_index(self) -> np.ndarray:
        first, last = int(self.document_ids[0]), int(self.document_ids[-1]) + 1
        return build_sentence_sample_index(
            np.asarray(self.dataset.document_indices)[first : last + 1],
            np.asarray(self.dataset.sequence_lengths),
            self.num_samples,
            self.sequence_length - self.reserved_tokens,
            self.masking.short_sequence_probability,
            self.seed,
            self.min_sentences_per_sample(),
        )

    def __len__(self) -> int:
        return len(self.sample_index)

    def _sentences(self, idx: int) -> tuple[list[list[int]], int, np.random.RandomState]:
        begin, end, target = (int(v) for v in self.sample_index[idx])
        sentences = [np.asarray(self.dataset[i]).tolist() for i in range(begin, end)]
        return sentences, target, np.random.RandomState(seed=(self.seed + idx) % 2**32)

    def _mask(self, tokens: list[int], target: int, rng: np.random.RandomState):
        inv = self.tokenizer.inv_vocab
        return create_masked_lm_predictions(
            tokens,
            target,
            rng,
            self.masking,
            {self.tokenizer.cls, self.tokenizer.sep},
            lambda token: inv[token].startswith("##"),
            self._replacement,
        )

    def _replacement(self, rng: np.random.RandomState) -> int | None:
        raise NotImplementedError
