"""Small real artifacts for the fault-injection suite, built once per session.

Every tool runs in this process (its `main`), so a case costs a load, not a
Python start-up; an exception that escapes `main` fails the case (a traceback
is exactly what the suite guards against).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # fault_helpers (pytest runs with importlib)

from fault_helpers import train_argv  # noqa: E402


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """dist/ and torch/ (mg-train checkpoints), hf/, hf-sharded/ and hf-bin/ (Hugging Face
    folders), data_text_document (an indexed dataset of the same 127-id vocabulary)."""
    from mg.ckpt_convert.cli import main as convert
    from mg.indexed_dataset import IndexedDatasetBuilder
    from mg.trainer.cli import main as train

    root = tmp_path_factory.mktemp("fault-artifacts")
    cache = root / "cache"
    assert train(train_argv(cache, "--save", str(root / "dist"))) == 0
    assert train(train_argv(cache, "--save", str(root / "torch"), "--ckpt-format", "torch")) == 0
    convert(["export-hf", "--load", str(root / "dist"), "--save", str(root / "hf")])
    convert(
        ["export-hf", "--load", str(root / "dist"), "--save", str(root / "hf-sharded")]
        + ["--shard-size", "20KB"]
    )
    shutil.copytree(root / "hf", root / "hf-bin")
    from safetensors.torch import load_file

    state = load_file(root / "hf-bin" / "model.safetensors")
    (root / "hf-bin" / "model.safetensors").unlink()
    torch.save(state, root / "hf-bin" / "pytorch_model.bin")

    builder = IndexedDatasetBuilder(root / "data_text_document.bin", dtype=np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        builder.add_document(torch.tensor(rng.integers(1, 126, 100)), [100])
    builder.finalize(root / "data_text_document.idx")
    return root
