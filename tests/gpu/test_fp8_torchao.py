"""FP8 through torchao on the device: `torch._scaled_mm` against torchao's own emulation of
the same casts, and mg-train's FP8 run against its bf16 run, step by step.

With MG_GPU_TEST_DEVICE=cpu the kernel comparison is skipped (no FP8 matmuls) and the
training comparison runs with the matmuls emulated (MG_FP8_EMULATE=1)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from gpu_device import DEVICE, ON_CUDA, needs_device, relative_error

pytest.importorskip("torchao")

from mg.core.models.float8_training import convert_to_float8  # noqa: E402
from mg.core.models.gpt import GPTModel, TransformerConfig  # noqa: E402
from mg.core.models.te_spec import FP8Options  # noqa: E402
from mg.trainer.arguments import parse_args  # noqa: E402
from mg.trainer.training import Trainer  # noqa: E402

pytestmark = needs_device
FP8_MATMULS = ON_CUDA and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)

ITERS = 10
LOSS_TOLERANCE = 2e-2
"""|loss_fp8 − loss_bf16| / loss_bf16 at every step (the GPU check's bar over 50 steps of
the 1.3B model; a tiny model's early steps move less)."""

TINY = [
    *("gpt", "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4"),
    *("--seq-length", "128", "--max-position-embeddings", "128", "--vocab-size", "255"),
    *("--mock-data", "--micro-batch-size", "4", "--global-batch-size", "8"),
    *("--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine"),
    *("--lr-warmup-iters", "2", "--train-iters", str(ITERS), "--log-interval", "1000"),
    *("--eval-iters", "0", "--seed", "1234", "--bf16"),
    *("--attention-dropout", "0", "--hidden-dropout", "0"),
]
FP8 = ["--transformer-impl", "local", "--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]


@pytest.mark.skipif(not FP8_MATMULS, reason="needs FP8 matmuls (compute capability 8.9+)")
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_scaled_mm_matches_torchaos_emulation(recipe: str) -> None:
    """The same model, the same FP8 casts: the hardware matmul and the emulated one give
    the same loss and gradients up to the accumulation's rounding (measured on an H200:
    see the GPU check's results)."""
    torch.manual_seed(0)
    config = TransformerConfig(
        num_layers=2, hidden_size=256, num_attention_heads=4, vocab_size=512, seq_length=128
    )
    config = TransformerConfig.from_dict({**config.to_dict(), "attention_dropout": 0.0})
    config = TransformerConfig.from_dict({**config.to_dict(), "hidden_dropout": 0.0})
    base = GPTModel(config).to(DEVICE, torch.bfloat16)
    options = FP8Options(format="e4m3" if recipe == "rowwise" else "hybrid", recipe=recipe)
    real, emulated = copy.deepcopy(base), copy.deepcopy(base)
    assert convert_to_float8(real, options) and convert_to_float8(emulated, options, emulate=True)
    ids = torch.randint(0, 512, (4, 128), device=DEVICE)
    results = []
    for model in (real, emulated):
        loss = model(ids, labels=ids).float().mean()
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert relative_error(results[0][0], results[1][0]) < 1e-2
    worst = max(relative_error(results[0][1][n], g) for n, g in results[1][1].items())
    assert worst < 5e-2, worst


def _losses(tmp_path: Path, *flags: str) -> list[float]:
    backend = [] if ON_CUDA else ["--distributed-backend", "gloo"]
    argv = [*TINY, "--data-cache-path", str(tmp_path / "cache"), *backend, *flags]
    trainer = Trainer(parse_args(argv))
    assert trainer.env.device.type == DEVICE.type
    return trainer.train().losses


def test_fp8_training_follows_bf16(tmp_path: Path, monkeypatch) -> None:
    if not FP8_MATMULS:
        monkeypatch.setenv("MG_FP8_EMULATE", "1")
    bf16 = _losses(tmp_path)
    fp8 = _losses(tmp_path, *FP8)
    assert fp8[-1] < fp8[0]  # it trains
    errors = [abs(f - b) / b for f, b in zip(fp8, bf16, strict=True)]
    assert max(errors) < LOSS_TOLERANCE, list(zip(fp8, bf16, strict=True))
