"""A DeepSeek-V3-shaped model (multi-latent attention with YaRN, sigmoid-routed MoE with
expert bias, group-limited top-k, a shared expert, the first layer dense) trained with
tensor parallelism (TP=2, and TP=2 + sequence parallel), context parallelism (CP=2) and
expert parallelism (EP=2: each rank two of the four routed experts, the shared expert and
the dense first layer replicated) on 2 gloo ranks equals one process.

Tolerance: 10 iterations, losses and gradient norms equal to 1e-5 relative (fp32): the
parallel runs only change the order of floating-point sums (split matmuls all-reduced,
the ring's online softmax, the experts'
all-to-all), ~1e-7 relative per step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


def _sibling(name: str):
    """A module beside this file (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_mla_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


run_ranks = _sibling("test_ddp.py").run_ranks
_helpers = _sibling("conftest.py")
_mla = _sibling("test_mla_training.py")

ITERS = 10
RTOL = 1e-5


def _close(a: list[float], b: list[float]) -> None:
    assert len(a) == len(b) == ITERS
    for x, y in zip(a, b, strict=True):
        assert x == pytest.approx(y, rel=RTOL), (a, b)


@pytest.mark.slow  # three 2-rank launches and a one-process run: minutes on 2 CPUs
def test_deepseek_v3_shape_tp_sp_cp_ep_match_one_process(tmp_path) -> None:
    base = _helpers._mock_argv(
        tmp_path, *_mla.MLA, *_mla.DEEPSEEK_MOE, *_mla.NO_DROPOUT, mbs=2, gbs=4, iters=ITERS
    )
    vocab = lambda tp: ["--make-vocab-size-divisible-by", str(128 // tp)]  # noqa: E731
    tp2 = [*base, "--tensor-model-parallel-size", "2", *vocab(2)]
    launches = {
        "tp2": [tp2],
        "tp2_sp": [[*tp2, "--sequence-parallel"]],
        # one launch, two runs: the ring attention, then each rank two of the four experts
        "cp2_ep2": [
            [*base, "--context-parallel-size", "2", *vocab(1)],
            [*base, "--expert-model-parallel-size", "2", *vocab(1)],
        ],
    }
    # one launch per entry: each stays well inside the launcher's per-launch time limit
    two = {name: run_ranks(argvs, 2, tmp_path / f"{name}.json") for name, argvs in launches.items()}
    one = _helpers._train([*base, *vocab(1)])
    _close(two["tp2"][0]["losses"], one.losses)
    _close(two["tp2"][0]["grad_norms"], one.grad_norms)
    _close(two["tp2_sp"][0]["losses"], one.losses)
    cp2, ep2 = two["cp2_ep2"]
    _close(cp2["losses"], one.losses)
    _close(ep2["losses"], one.losses)
    _close(ep2["grad_norms"], one.grad_norms)
    assert one.losses[-1] < one.losses[0]
