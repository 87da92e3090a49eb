"""Same samples, same order, same index arrays as Megatron-Core's GPT datasets (0.16.1, test-only).

Megatron's datasets are built through its own `BlendedMegatronDatasetBuilder`
and `GPTDatasetConfig`, ours through `build_gpt_datasets`, from the same
`.bin`/`.idx` files, seed, sequence length and split; then the first samples
of every split and the full document/sample/shuffle (and blending) indices
are compared element for element and dtype for dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mg.indexed_dataset.format import IndexedDatasetBuilder
from mg.indexed_dataset.gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_datasets
from mg.indexed_dataset.indices import final_epoch_is_separate, num_epochs_needed
from mg.indexed_dataset.mock import build_mock_gpt_datasets

pytestmark = pytest.mark.compat

with warnings.catch_warnings():
    # Importing megatron.core warns that Transformer Engine and Apex are missing.
    warnings.simplefilter("ignore")
    pytest.importorskip("megatron.core")
    torch = pytest.importorskip("torch")
    from megatron.core.datasets.blended_dataset import BlendedDataset as MegatronBlendedDataset
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MegatronGPTDatasetConfig
    from megatron.core.datasets.gpt_dataset import MockGPTDataset as MegatronMockGPTDataset

SEED = 1234
SEQ_LENGTH = 128
SPLIT = "969,30,1"
EOD = 0
VOCAB_SIZE = 50257
COMPARED_SAMPLES = 50
INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")


class TokenizerStub:
    """What Megatron's datasets read from a tokenizer: eod, vocab size, an identity, maybe pad."""

    def __init__(self, pad: int | None = None) -> None:
        self.eod = EOD
        self.vocab_size = VOCAB_SIZE
        self.unique_identifiers = {"class": "TokenizerStub", "pad": pad}
        if pad is not None:
            self.pad = pad


def write_corpus(prefix: Path, num_documents: int, seed: int) -> int:
    """Documents of 1..300 random uint16 tokens ending in eod; returns the token count."""
    rng = np.random.default_rng(seed)
    total = 0
    with IndexedDatasetBuilder(f"{prefix}.bin", np.uint16) as builder:
        for _ in range(num_documents):
            length = int(rng.integers(1, 301))
            document = rng.integers(1, VOCAB_SIZE, size=length).astype(np.uint16)
            document[-1] = EOD
            builder.add_document(document, [length])
            total += length
        builder.finalize(f"{prefix}.idx")
    return total


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two corpora, ~450k and ~300k tokens, in a module-wide temporary folder."""
    folder = tmp_path_factory.mktemp("corpus")
    big, small = folder / "big_text_document", folder / "small_text_document"
    assert write_corpus(big, 3000, seed=0) >= 200_000
    assert write_corpus(small, 2000, seed=1) >= 200_000
    return {"big": str(big), "small": str(small), "folder": str(folder)}


@pytest.fixture(scope="module", autouse=True)
def one_rank_process_group(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Megatron's BlendedDataset asks torch.distributed for the rank; give it a 1-rank group.

    Ours then takes its distributed path too (rank 0 builds, barrier, load).
    """
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


def megatron_datasets(
    blend: tuple[list[str], list[float] | None] | None,
    sizes: list[int | None],
    cache: Path,
    tokenizer: TokenizerStub | None = None,
    dataset_class: type = MegatronGPTDataset,
    split: str = SPLIT,
    **options: Any,
) -> list[Any]:
    settings: dict[str, Any] = {
        "reset_position_ids": False,
        "reset_attention_mask": False,
        "eod_mask_loss": False,
        "create_attention_mask": False,
    }
    settings.update(options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = MegatronGPTDatasetConfig(
            random_seed=SEED,
            sequence_length=SEQ_LENGTH,
            blend=blend,
            split=split if blend is not None else None,
            path_to_cache=str(cache),
            tokenizer=tokenizer or TokenizerStub(),
            **settings,
        )
        return BlendedMegatronDatasetBuilder(dataset_class, sizes, lambda: True, config).build()


def our_config(cache: Path, split: str = SPLIT, **options: Any) -> GPTDatasetConfig:
    return GPTDatasetConfig(
        seq_length=SEQ_LENGTH, seed=SEED, split=split, path_to_cache=str(cache), **options
    )


def assert_same_indices(theirs: Any, ours: GPTDataset) -> None:
    for name in INDEX_NAMES:
        expected, actual = np.asarray(getattr(theirs, name)), np.asarray(getattr(ours, name))
        assert actual.dtype == expected.dtype, name
        np.testing.assert_array_equal(actual, expected, err_msg=name)


def assert_same_samples(theirs: Any, ours: Any, count: int = COMPARED_SAMPLES) -> None:
    assert len(ours) == len(theirs)
    compared = [*range(min(count, len(ours)))] + ([len(ours) - 1] if len(ours) > count else [])
    for k in compared:
        expected, actual = theirs[k], ours[k]
        assert set(actual) == set(expected), k
        for key, value in expected.items():
            value = value.numpy() if hasattr(value, "numpy") else np.asarray(value)
            np.testing.assert_array_equal(actual[key], value, err_msg=f"sample {k} {key}")
            if value.ndim:  # arrays keep Megatron's dtypes; dataset_id is a plain int here
                assert actual[key].dtype == value.dtype, f"sample {k} {key}"


def train_tokens(prefix: str) -> int:
    """Tokens in the train split of `prefix` under SPLIT (for planning epochs)."""
    from mg.indexed_dataset.format import IndexedDataset
    from mg.indexed_dataset.split import parse_split, split_matrix, split_range

    lengths = IndexedDataset(prefix).sequence_lengths
    documents = split_range(split_matrix(parse_split(SPLIT))[0], len(lengths))
    return int(lengths[documents].sum())


def single_prefix_case(
    corpus: dict[str, str], tmp_path: Path, sizes: list[int | None], **options: Any
) -> None:
    theirs = megatron_datasets(([corpus["big"]], None), sizes, tmp_path / "megatron", **options)
    ours = build_gpt_datasets([corpus["big"]], sizes, our_config(tmp_path / "ours", **options))
    for expected, actual in zip(theirs, ours, strict=True):
        assert isinstance(actual, GPTDataset)
        assert_same_indices(expected, actual)
        assert_same_samples(expected, actual)


def test_one_prefix_all_splits_match(corpus: dict[str, str], tmp_path: Path) -> None:
    single_prefix_case(corpus, tmp_path, [1000, 200, 50])


def test_one_epoch_when_no_sample_count(corpus: dict[str, str], tmp_path: Path) -> None:
    single_prefix_case(corpus, tmp_path, [None, None, None])


def test_separate_final_epoch_matches(corpus: dict[str, str], tmp_path: Path) -> None:
    tokens = train_tokens(corpus["big"])
    per_epoch = (tokens - 1) // SEQ_LENGTH
    num_samples = int(2.3 * per_epoch)  # 3 epochs, the last one 30% used
    assert num_epochs_needed(tokens, num_samples, SEQ_LENGTH) == 3
    assert final_epoch_is_separate(tokens, 3, num_samples, SEQ_LENGTH)
    single_prefix_case(corpus, tmp_path, [num_samples, 300, 100])


def test_joint_final_epoch_matches(corpus: dict[str, str], tmp_path: Path) -> None:
    tokens = train_tokens(corpus["big"])
    per_epoch = (tokens - 1) // SEQ_LENGTH
    num_samples = int(1.9 * per_epoch)  # 2 epochs, the last one 90% used: shuffled together
    assert num_epochs_needed(tokens, num_samples, SEQ_LENGTH) == 2
    assert not final_epoch_is_separate(tokens, 2, num_samples, SEQ_LENGTH)
    single_prefix_case(corpus, tmp_path, [num_samples, 300, 100])


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"add_extra_token_to_sequence": False}, id="no-extra-token"),
        pytest.param({"drop_last_partial_validation_sequence": False}, id="keep-partial-valid"),
        pytest.param(
            {"eod_mask_loss": True, "reset_position_ids": True}, id="eod-mask-reset-positions"
        ),
        pytest.param(
            {"create_attention_mask": True, "reset_attention_mask": True}, id="attention-mask"
        ),
    ],
)
def test_options_match(corpus: dict[str, str], tmp_path: Path, options: dict[str, Any]) -> None:
    theirs = megatron_datasets(([corpus["big"]], None), [500, 100, 20], tmp_path / "m", **options)
    ours = build_gpt_datasets(
        [corpus["big"]], [500, 100, 20], our_config(tmp_path / "o", eod_token_id=EOD, **options)
    )
    for expected, actual in zip(theirs, ours, strict=True):
        assert_same_indices(expected, actual)
        assert_same_samples(expected, actual, count=10)


def test_pad_token_is_masked_like_megatron(corpus: dict[str, str], tmp_path: Path) -> None:
    # Pad id 7 occurs in the random data: Megatron masks its loss and zeroes it; so must we.
    tokenizer = TokenizerStub(pad=7)
    theirs = megatron_datasets(([corpus["big"]], None), [300, 60, 20], tmp_path / "m", tokenizer)
    ours = build_gpt_datasets(
        [corpus["big"]],
        [300, 60, 20],
        our_config(tmp_path / "o", eod_token_id=EOD, pad_token_id=7),
    )
    for expected, actual in zip(theirs, ours, strict=True):
        assert_same_samples(expected, actual, count=300)


def test_weighted_blend_matches(corpus: dict[str, str], tmp_path: Path) -> None:
    sizes = [4000, 300, 60]
    theirs = megatron_datasets(
        ([corpus["big"], corpus["small"]], [0.3, 0.7]), sizes, tmp_path / "megatron"
    )
    ours = build_gpt_datasets(
        ["30", corpus["big"], "70", corpus["small"]], sizes, our_config(tmp_path / "ours")
    )
    for expected, actual in zip(theirs, ours, strict=True):
        assert isinstance(expected, MegatronBlendedDataset)
        assert actual.dataset_index.dtype == expected.dataset_index.dtype == np.int16
        np.testing.assert_array_equal(actual.dataset_index, expected.dataset_index)
        np.testing.assert_array_equal(actual.dataset_sample_index, expected.dataset_sample_index)
        for their_part, our_part in zip(expected.datasets, actual.datasets, strict=True):
            assert_same_indices(their_part, our_part)
        assert_same_samples(expected, actual)


def test_blend_by_size_matches(corpus: dict[str, str], tmp_path: Path) -> None:
    # `P1 P2`: weights are the datasets' sample counts. A split with more test data, as
    # Megatron cannot blend a dataset whose split holds no sample (nor can we: an error).
    sizes, split = [3000, 200, 30], "90,6,4"
    prefixes = [corpus["big"], corpus["small"]]
    theirs = megatron_datasets((prefixes, None), sizes, tmp_path / "m", split=split)
    ours = build_gpt_datasets(prefixes, sizes, our_config(tmp_path / "o", split=split))
    for expected, actual in zip(theirs, ours, strict=True):
        np.testing.assert_array_equal(actual.dataset_index, expected.dataset_index)
        np.testing.assert_array_equal(actual.dataset_sample_index, expected.dataset_sample_index)
        assert_same_samples(expected, actual)


def test_mock_dataset_matches(tmp_path: Path) -> None:
    sizes = [200, 40, 40]
    theirs = megatron_datasets(None, sizes, tmp_path / "m", dataset_class=MegatronMockGPTDataset)
    ours = build_mock_gpt_datasets(
        sizes, our_config(tmp_path / "o", eod_token_id=EOD), vocab_size=VOCAB_SIZE
    )
    for expected, actual in zip(theirs, ours, strict=True):
        assert_same_indices(expected, actual)
        assert_same_samples(expected, actual)
