"""mg-train's Trainer on the device: a tiny GPT trained with --bf16 there follows the fp32
run on the CPU (the reference numerics) within bf16's rounding, step by step, and
--deterministic-mode gives the same losses twice on the device (its kernels are all
deterministic ones: use_deterministic_algorithms would raise otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gpu_device import DEVICE, needs_device

from mg.trainer.arguments import parse_args
from mg.trainer.training import Trainer

pytestmark = needs_device

ITERS = 8
LOSS_TOLERANCE = 2e-2
"""|loss_bf16 − loss_fp32| / loss_fp32 at every step: bf16 keeps 8 bits of mantissa
(~4e-3 per rounding); a few steps of a tiny model stay well inside 2%."""

TINY = [
    *("gpt", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "64", "--max-position-embeddings", "64", "--vocab-size", "127"),
    *("--mock-data", "--micro-batch-size", "4", "--global-batch-size", "8"),
    *("--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine"),
    *("--lr-warmup-iters", "2", "--train-iters", str(ITERS), "--log-interval", "1000"),
    *("--eval-iters", "0", "--seed", "1234"),
]


def _losses(tmp_path: Path, device: str, *flags: str) -> list[float]:
    """A run's losses; on the CPU through gloo (the trainer takes CUDA wherever it sees it)."""
    backend = [] if device == "cuda" else ["--distributed-backend", "gloo"]
    argv = [*TINY, "--data-cache-path", str(tmp_path / "cache"), *backend, *flags]
    trainer = Trainer(parse_args(argv))
    assert trainer.env.device.type == device
    return trainer.train().losses


def test_bf16_on_the_device_follows_fp32_on_the_cpu(tmp_path: Path) -> None:
    reference = _losses(tmp_path, "cpu")
    # --use-cpu-initialization: the device's run starts from the CPU run's weights
    bf16 = _losses(tmp_path, DEVICE.type, "--bf16", "--use-cpu-initialization")
    assert len(bf16) == len(reference) == ITERS
    assert reference[-1] < reference[0]  # it trains
    errors = [abs(b - r) / r for b, r in zip(bf16, reference, strict=True)]
    assert max(errors) < LOSS_TOLERANCE, list(zip(bf16, reference, strict=True))


@pytest.mark.parametrize("precision", ["--bf16", None], ids=["bf16", "fp32"])
def test_deterministic_mode_repeats_on_the_device(tmp_path: Path, precision) -> None:
    flags = ["--deterministic-mode", *([precision] if precision else [])]
    first = _losses(tmp_path, DEVICE.type, *flags)
    second = _losses(tmp_path, DEVICE.type, *flags)
    assert first == second
