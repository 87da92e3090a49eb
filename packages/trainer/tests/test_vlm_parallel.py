"""`mg-train vlm` with tensor parallelism, and with data parallelism and the distributed
optimizer, on 2 gloo ranks matches one process.

TP=2: both towers, the projector and the language model are sharded (fp32, dropout
off, the padded vocabulary 128 in both runs), and again with sequence parallelism (the
language model's layers on sequence slices). DP=2: the distributed optimizer over
the projector alone (both towers frozen). Tolerance: 10 iterations, losses and
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


@pytest.mark.slow  # two gloo ranks (two runs), then one process each: ~150 s on a loaded 2-CPU box
def test_vlm_tensor_and_data_parallel_match_one_process(tmp_path: Path, train) -> None:
    """TP=2 with the ViT frozen; DP=2 with the distributed optimizer and both towers
    frozen (only the projector has gradient buffers and optimizer state)."""
    argv = [*VLM, "--train-iters", str(ITERS), "--data-cache-path", str(tmp_path)]
    vit_frozen = [*argv, "--freeze-ViT"]
    towers_frozen = [*argv, "--freeze-ViT", "--freeze-LM"]
    tp2 = [*vit_frozen, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
    tp2, tp2_sp, dp2 = run_ranks(
        [tp2, [*tp2, "--sequence-parallel"], [*towers_frozen, "--use-distributed-optimizer"]],
        2,
        tmp_path / "two.json",
    )
    tp_one = train([*vit_frozen, "--make-vocab-size-divisible-by", "128"])
    for two, one in ((tp2, tp_one), (tp2_sp, tp_one), (dp2, train(towers_frozen))):
        assert len(one.losses) == len(two["losses"]) == ITERS
        assert two["losses"] == pytest.approx(one.losses, rel=RTOL)
        assert two["grad_norms"] == pytest.approx(one.grad_norms, rel=RTOL)
