"""GPT samples: layout, padding and masks, the index cache, building from `--data-path`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mg.indexed_dataset import gpt_dataset
from mg.indexed_dataset.blended import BlendedDataset
from mg.indexed_dataset.format import IndexedDataset, IndexedDatasetBuilder
from mg.indexed_dataset.gpt_dataset import GPTDataset, GPTDatasetConfig, build_gpt_datasets
from mg.indexed_dataset.split import Blend, Split

EOD = 0


def write_documents(prefix: Path, documents: list[np.ndarray]) -> str:
    with IndexedDatasetBuilder(f"{prefix}.bin", np.uint16) as builder:
        for document in documents:
            builder.add_document(document, [len(document)])
        builder.finalize(f"{prefix}.idx")
    return str(prefix)


def numbered_documents(count: int, seed: int = 0) -> list[np.ndarray]:
    """Document d holds d*100+1, d*100+2, ... and ends with eod: tokens tell their document."""
    rng = np.random.default_rng(seed)
    documents = []
    for d in range(count):
        length = int(rng.integers(2, 60))
        document = (d * 100 + 1 + np.arange(length)).astype(np.uint16)
        document[-1] = EOD
        documents.append(document)
    return documents


@pytest.fixture
def corpus(tmp_path: Path) -> str:
    return write_documents(tmp_path / "corpus", numbered_documents(400))


def config(tmp_path: Path, **options: object) -> GPTDatasetConfig:
    defaults: dict[str, object] = {
        "seq_length": 16,
        "split": "8,1,1",
        "path_to_cache": str(tmp_path / "cache"),
        "eod_token_id": EOD,
    }
    defaults.update(options)
    return GPTDatasetConfig(**defaults)  # type: ignore[arg-type]


def token_stream(dataset: GPTDataset) -> np.ndarray:
    """The documents in document-index order, concatenated: what samples are windows of."""
    return np.concatenate([dataset.indexed.get(int(d)) for d in dataset.document_index])


# --- samples ----------------------------------------------------------------------------------


def test_samples_are_shifted_windows_of_the_shuffled_stream(corpus: str, tmp_path: Path) -> None:
    train, _, _ = build_gpt_datasets(corpus, [300, 20, 10], config(tmp_path))
    assert isinstance(train, GPTDataset)
    stream = token_stream(train).astype(np.int64)
    assert len(train) >= 300
    for i in range(40):
        k = int(train.shuffle_index[i])
        sample = train[i]
        np.testing.assert_array_equal(sample["tokens"], stream[k * 16 : k * 16 + 16])
        np.testing.assert_array_equal(sample["labels"], stream[k * 16 + 1 : k * 16 + 17])
        assert sample["tokens"].dtype == sample["labels"].dtype == np.int64
        assert sample["loss_mask"].dtype == np.float32 and sample["loss_mask"].all()
        np.testing.assert_array_equal(sample["position_ids"], np.arange(16))
        assert "attention_mask" not in sample


def test_split_documents_stay_in_their_split(corpus: str, tmp_path: Path) -> None:
    train, valid, test = build_gpt_datasets(corpus, [100, 50, 30], config(tmp_path))
    assert set(np.unique(train.document_index)) == set(range(320))
    assert set(np.unique(valid.document_index)) == set(range(320, 360))
    assert set(np.unique(test.document_index)) == set(range(360, 400))


def test_without_extra_token_the_last_label_is_padding(corpus: str, tmp_path: Path) -> None:
    train, _, _ = build_gpt_datasets(
        corpus, [50, 5, 5], config(tmp_path, add_extra_token_to_sequence=False)
    )
    sample = train[0]
    np.testing.assert_array_equal(sample["labels"][:-1], sample["tokens"][1:])
    assert sample["labels"][-1] == 0 and sample["loss_mask"][-1] == 0
    assert sample["loss_mask"][:-1].all()


def test_partial_validation_sample_is_padded_without_loss(corpus: str, tmp_path: Path) -> None:
    _, valid, _ = build_gpt_datasets(
        corpus, [10, None, 5], config(tmp_path, drop_last_partial_validation_sequence=False)
    )
    stream = token_stream(valid)
    last = len(valid) - 1
    real = stream.size - last * 16 - 1  # labels left for the last window
    assert 0 < real < 16, "the corpus should leave a partial last validation sample"
    position = int(np.flatnonzero(np.asarray(valid.shuffle_index) == last)[0])
    sample = valid[position]
    np.testing.assert_array_equal(sample["loss_mask"], [1.0] * real + [0.0] * (16 - real))
    assert (sample["labels"][real:] == 0).all() and (sample["tokens"][real + 1 :] == 0).all()


def test_padding_sample_has_no_loss(corpus: str, tmp_path: Path) -> None:
    train, _, _ = build_gpt_datasets(corpus, [10, 5, 5], config(tmp_path))
    assert not train[None]["loss_mask"].any()
    np.testing.assert_array_equal(train[None]["tokens"], train[0]["tokens"])


def test_pad_id_in_the_data_gets_no_loss(corpus: str, tmp_path: Path) -> None:
    train, _, _ = build_gpt_datasets(corpus, [100, 5, 5], config(tmp_path))
    sample = train[3]
    where = int(np.flatnonzero(sample["labels"] != EOD)[0])
    pad = int(sample["labels"][where])  # pretend this real token is the tokenizer's pad
    padded, _, _ = build_gpt_datasets(corpus, [100, 5, 5], config(tmp_path, pad_token_id=pad))
    other = padded[3]
    assert other["loss_mask"][where] == 0 and other["labels"][where] == 0
    assert other["loss_mask"].sum() == 16 - (sample["labels"] == pad).sum()


def test_pad_equal_to_eod_falls_back_to_no_pad(corpus: str, tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="also the eod token id"):
        train, _, _ = build_gpt_datasets(corpus, [10, 5, 5], config(tmp_path, pad_token_id=EOD))
    assert train.pad_token_id == -1


def test_eod_mask_loss_and_position_reset(corpus: str, tmp_path: Path) -> None:
    options = {"eod_mask_loss": True, "reset_position_ids": True}
    train, _, _ = build_gpt_datasets(corpus, [200, 5, 5], config(tmp_path, **options))
    checked = 0
    for i in range(len(train)):
        sample = train[i]
        eods = np.flatnonzero(sample["tokens"] == EOD)
        if eods.size == 0 or eods[0] == 15:
            continue
        np.testing.assert_array_equal(sample["loss_mask"] == 0, sample["tokens"] == EOD)
        first = eods[0]
        np.testing.assert_array_equal(sample["position_ids"][: first + 1], np.arange(first + 1))
        assert sample["position_ids"][first + 1] == 0
        checked += 1
    assert checked > 10


def test_attention_mask_is_causal_and_resets_at_eod(corpus: str, tmp_path: Path) -> None:
    causal, _, _ = build_gpt_datasets(
        corpus, [50, 5, 5], config(tmp_path, create_attention_mask=True)
    )
    mask = causal[0]["attention_mask"]
    assert mask.shape == (1, 16, 16) and mask.dtype == bool
    np.testing.assert_array_equal(mask[0], ~np.tri(16, dtype=bool))
    options = {"create_attention_mask": True, "reset_attention_mask": True}
    reset, _, _ = build_gpt_datasets(corpus, [50, 5, 5], config(tmp_path, **options))
    for i in range(len(reset)):
        sample = reset[i]
        eods = np.flatnonzero(sample["tokens"][:-1] == EOD)
        if eods.size:
            e = eods[0]
            assert sample["attention_mask"][0, e + 1 :, : e + 1].all()  # next document: blind
            assert not sample["attention_mask"][0, e, : e + 1].any()  # the eod sees its own
            return
    pytest.fail("no sample with an end of document inside")


def test_sample_index_out_of_range(corpus: str, tmp_path: Path) -> None:
    train, _, _ = build_gpt_datasets(corpus, [10, 5, 5], config(tmp_path))
    with pytest.raises(IndexError, match="out of range"):
        train[len(train)]


# --- the cache --------------------------------------------------------------------------------


def test_second_build_loads_the_cached_indices(
    corpus: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    original = gpt_dataset.build_gpt_indices

    def counting(*args: object, **kwargs: object) -> object:
        calls.append("built")
        return original(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(gpt_dataset, "build_gpt_indices", counting)
    first = build_gpt_datasets(corpus, [100, 20, 10], config(tmp_path))
    assert len(calls) == 3
    files = sorted(os.listdir(tmp_path / "cache"))
    assert len(files) == 12  # 3 splits x (3 indices + description)
    md5 = first[0].unique_description_hash
    assert f"{md5}-GPTDataset-train-shuffle_index.npy" in files
    second = build_gpt_datasets(corpus, [100, 20, 10], config(tmp_path))
    assert len(calls) == 3, "the second build must load the .npy files"
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a.shuffle_index, b.shuffle_index)
        np.testing.assert_array_equal(a[0]["tokens"], b[0]["tokens"])
    build_gpt_datasets(corpus, [101, 20, 10], config(tmp_path))  # another sample count
    assert len(calls) == 4


def test_default_cache_is_megatrons_folder_beside_the_data(corpus: str, tmp_path: Path) -> None:
    build_gpt_datasets(corpus, [10, 5, 5], config(tmp_path, path_to_cache=None))
    folder = Path(corpus) / "cache" / "GPTDataset_indices"
    assert len([name for name in os.listdir(folder) if name.endswith(".npy")]) == 9


def test_build_is_logged(corpus: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="mg.indexed_dataset")
    build_gpt_datasets(corpus, [10, 5, 5], config(tmp_path))
    assert any("built" in r.message and "GPTDataset-train" in r.message for r in caplog.records)
    caplog.clear()
    build_gpt_datasets(corpus, [10, 5, 5], config(tmp_path))
    assert any("loaded" in r.message for r in caplog.records)


# --- building from --data-path ----------------------------------------------------------------


def test_data_path_forms(corpus: str, tmp_path: Path) -> None:
    other = write_documents(tmp_path / "other", numbered_documents(300, seed=1))
    single = build_gpt_datasets(corpus, [50, 10, 5], config(tmp_path))
    assert all(isinstance(d, GPTDataset) for d in single)
    as_words = build_gpt_datasets([corpus], [50, 10, 5], config(tmp_path))
    np.testing.assert_array_equal(single[0].shuffle_index, as_words[0].shuffle_index)
    weighted = build_gpt_datasets(f"1 {corpus} 3 {other}", [400, 40, 20], config(tmp_path))
    assert all(isinstance(d, BlendedDataset) for d in weighted)
    shares = np.bincount(weighted[0].dataset_index) / len(weighted[0])
    np.testing.assert_allclose(shares, [0.25, 0.75], atol=0.01)
    by_size = build_gpt_datasets([corpus, other], [400, 40, 20], config(tmp_path))
    assert isinstance(by_size[0], BlendedDataset) and len(by_size[0]) == 400
    one_weighted = build_gpt_datasets(f"0.5 {corpus}", [50, 10, 5], config(tmp_path))
    assert isinstance(one_weighted[0], BlendedDataset)  # as in Megatron


def test_per_split_blends(corpus: str, tmp_path: Path) -> None:
    other = write_documents(tmp_path / "other", numbered_documents(300, seed=1))
    train, valid, test = build_gpt_datasets(
        None, [100, 20, 10], config(tmp_path), blend_per_split=[corpus, Blend((other,)), None]
    )
    assert test is None
    assert train.split is Split.train and valid.split is Split.valid
    assert set(np.unique(train.document_index)) == set(range(400))  # the whole dataset
    assert valid.dataset_path == other


def test_zero_split_gives_no_dataset(corpus: str, tmp_path: Path) -> None:
    train, valid, test = build_gpt_datasets(corpus, [10, 5, 5], config(tmp_path, split="1,0,0"))
    assert isinstance(train, GPTDataset) and valid is None and test is None


def test_missing_prefix_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nowhere/data\.idx"):
        build_gpt_datasets(str(tmp_path / "nowhere" / "data"), [1, 1, 1], config(tmp_path))


def test_weights_must_be_numbers(corpus: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a number"):
        build_gpt_datasets(f"heavy {corpus} 0.5 {corpus}", [1, 1, 1], config(tmp_path))


def test_build_errors(corpus: str, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no data"):
        build_gpt_datasets(None, [1, 1, 1], config(tmp_path))
    with pytest.raises(ValueError, match="not both"):
        build_gpt_datasets(corpus, [1, 1, 1], config(tmp_path), blend_per_split=[corpus] * 3)
    with pytest.raises(ValueError, match="3 entries"):
        build_gpt_datasets(corpus, [1, 1], config(tmp_path))


def test_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="bad split"):
        GPTDatasetConfig(seq_length=8, split="90,x")
    with pytest.raises(ValueError, match="eod_mask_loss need eod_token_id"):
        GPTDatasetConfig(seq_length=8, eod_mask_loss=True)
    with pytest.raises(ValueError, match="seq_length"):
        GPTDatasetConfig(seq_length=0)


def test_dataset_over_any_token_source(corpus: str, tmp_path: Path) -> None:
    indexed = IndexedDataset(corpus)
    dataset = GPTDataset(indexed, np.arange(10, 50), 20, config(tmp_path), "valid")
    assert dataset.split is Split.valid and len(dataset) >= 20
    with pytest.raises(ValueError, match="unknown split"):
        GPTDataset(indexed, np.arange(10), 5, config(tmp_path), "validation")


# --- several ranks ----------------------------------------------------------------------------

RANK_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    import torch.distributed as dist
    from mg.indexed_dataset.gpt_dataset import GPTDatasetConfig, build_gpt_datasets

    rank, store, prefix, cache, out = int(sys.argv[1]), *sys.argv[2:]
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("mg.indexed_dataset").addHandler(handler)
    logging.getLogger("mg.indexed_dataset").setLevel(logging.INFO)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    config = GPTDatasetConfig(seq_length=16, split="8,1,1", path_to_cache=cache, eod_token_id=0)
    train, valid, test = build_gpt_datasets(prefix, [200, 20, 10], config)
    dist.barrier()
    json.dump({"messages": messages, "first": train[0]["tokens"].tolist()}, open(out, "w"))
    dist.destroy_process_group()
    """
)


def test_rank_zero_builds_while_the_other_rank_waits(corpus: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    import json

    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    store, cache = tmp_path / "store", tmp_path / "cache"
    processes = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(store), corpus, str(cache)]
            + [str(tmp_path / f"rank{rank}.json")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in (0, 1)
    ]
    for process in processes:
        output, _ = process.communicate(timeout=300)
        assert process.returncode == 0, output.decode()
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    built = [[m for m in r["messages"] if m.startswith("built")] for r in results]
    loaded = [[m for m in r["messages"] if m.startswith("loaded")] for r in results]
    assert len(built[0]) == 3 and not loaded[0]
    assert not built[1] and len(loaded[1]) == 3
    assert results[0]["first"] == results[1]["first"]
