"""A dataset whose token ids exceed the model's vocabulary: named before any step runs.

Was an `IndexError` traceback from the embedding in mg-train and mg-eval.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from fault_helpers import exit_code, train_argv

TOO_LARGE = 300  # the fault suite's models have 127 token ids, padded to 128 rows


def _dataset_with_id(prefix: Path, top: int) -> None:
    from mg.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for k in range(40):
        tokens = rng.integers(1, 126, 100)
        if k == 37:
            tokens[50] = top
        builder.add_document(torch.tensor(tokens), [100])
    builder.finalize(f"{prefix}.idx")


def _one_line(err: str) -> str:
    assert "Traceback" not in err and "IndexError" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_mg_train_names_the_dataset_the_id_and_the_vocabulary(tmp_path, capsys) -> None:
    from mg.trainer.cli import main

    prefix = tmp_path / "other_tokenizer_text_document"
    _dataset_with_id(prefix, TOO_LARGE)
    argv = [a for a in train_argv(tmp_path / "cache") if a != "--mock-data"]
    argv += ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--split", "1,0,0"]
    argv += ["--save", str(tmp_path / "ckpt")]
    capsys.readouterr()

    assert exit_code(lambda: main(argv)) == 2

    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mg-train: error: "), line
    assert f"{prefix}.bin" in line and f"largest token id is {TOO_LARGE}" in line, line
    assert "128" in line and "mg-prep" in line, line
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()


@pytest.mark.parametrize("top", [TOO_LARGE, 60000])
def test_mg_eval_names_the_dataset_the_id_and_the_vocabulary(artifacts, tmp_path, capsys, top):
    from mg.evaluate.cli import main

    prefix = tmp_path / "other_tokenizer_text_document"
    _dataset_with_id(prefix, top)
    argv = ["ppl", "--load", str(artifacts / "dist"), "--data-path", str(prefix)]
    argv += ["--split", "50,50,0", "--data-cache-path", str(tmp_path / "cache")]
    capsys.readouterr()

    assert exit_code(lambda: main(argv)) == 2

    line = _one_line(capsys.readouterr().err)
    assert f"{prefix}.bin" in line and f"largest token id is {top}" in line, line
    assert "vocabulary" in line and "mg-prep" in line, line


def test_ids_inside_the_vocabulary_pass(tmp_path) -> None:
    from mg.indexed_dataset.token_range import check_token_ids

    prefix = tmp_path / "fits_text_document"
    _dataset_with_id(prefix, 127)
    check_token_ids([str(prefix)], 128, "the model's vocabulary")
    with pytest.raises(
        ValueError,
        match="largest token id is 127, beyond the model's vocabulary: ids must be below 127",
    ):
        check_token_ids([str(prefix)], 127, "the model's vocabulary")


def test_ranks_share_the_pass(tmp_path, monkeypatch) -> None:
    """Each of three ranks reads every third chunk; their max is the dataset's."""
    from mg.indexed_dataset import IndexedDataset, token_range

    prefix = tmp_path / "shared_text_document"
    _dataset_with_id(prefix, TOO_LARGE)
    monkeypatch.setattr(token_range, "_CHUNK", 64)  # 4,000 tokens: 63 chunks
    dataset = IndexedDataset(str(prefix))
    parts = [token_range.max_token_id(dataset, (rank, 3)) for rank in range(3)]

    assert max(parts) == TOO_LARGE == token_range.max_token_id(dataset)
    assert sorted(parts)[:2] == [125, 125]  # the other ranks' shares hold ordinary ids
    with pytest.raises(ValueError, match=f"largest token id is {TOO_LARGE}"):
        token_range.check_token_ids(
            [str(prefix)],
            128,
            "the model's vocabulary",
            part=(1, 3),
            reduce_max=lambda _: max(parts),
        )


def test_a_dataset_too_large_to_scan_is_checked_as_it_is_read(tmp_path, capsys, monkeypatch):
    """Above the scan budget (a web-scale corpus on few ranks) the samples are checked on
    the host as they are read: the same one line when the bad document's batch comes."""
    from mg.trainer import token_guard
    from mg.trainer.cli import main

    monkeypatch.setattr(token_guard, "SCAN_BYTES_PER_RANK", 0)
    prefix = tmp_path / "other_tokenizer_text_document"
    _dataset_with_id(prefix, TOO_LARGE)
    argv = [a for a in train_argv(tmp_path / "cache", iters=200) if a != "--mock-data"]
    argv += ["--data-path", str(prefix), "--tokenizer-type", "NullTokenizer", "--split", "1,0,0"]
    capsys.readouterr()

    assert exit_code(lambda: main(argv)) == 2

    line = _one_line(capsys.readouterr().err)
    assert str(prefix) in line and f"token id {TOO_LARGE}" in line and "128" in line, line
