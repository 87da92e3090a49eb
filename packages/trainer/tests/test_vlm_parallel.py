"""`mg-train vlm` with tensor parallelism on 2 gloo ranks matches one process.

Both towers, the projector and the language model are sharded (TP=2, fp32, dropout
off, the padded vocabulary 128 in both runs). Tolerance: 10 iterations, losses and
gradient norms equal to 1e-5 relative: tensor parallelism changes only the order of
floating-point sums (split matmuls all-reduced, the vocab-parallel softmax).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _sibling(name: str):
    """A module beside this file (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_vlm_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_ranks = _sibling("test_ddp.py").run_ranks
VLM = _sibling("test_vlm_training.py").VLM
ITERS = 10
RTOL = 1e-5


@pytest.mark.slow  # two gloo ranks, then one process: ~40 s on a loaded 2-CPU box
def test_vlm_tensor_parallel_matches_one_process(tmp_path: Path, train) -> None:
    argv = [*VLM, "--train-iters", str(ITERS), "--data-cache-path", str(tmp_path)]
    argv += ["--freeze-ViT"]  # a frozen tower inside a sharded model too
    (two,) = run_ranks(
        [[*argv, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]],
        2,
        tmp_path / "two.json",
    )
    one = train([*argv, "--make-vocab-size-divisible-by", "128"])
    assert len(one.losses) == len(two["losses"]) == ITERS
    assert two["losses"] == pytest.approx(one.losses, rel=RTOL)
    assert two["grad_norms"] == pytest.approx(one.grad_norms, rel=RTOL)
