"""mg-quantize checkpoints served on the device: loaded by mg-serve's loader onto it, the
quantized linears' matmuls there, prompts of mixed lengths decoded in one continuous
batch over the paged KV cache give the same model's unbatched greedy tokens on the
device, and (fp32) the CPU's tokens of the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpu_device import DEVICE, needs_device

from mg.core.quantization import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from mg.core.testing.serving_checkpoints import save_decisive_model
from mg.generate_server.batch import generate_batch
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.loading import load_for_serving
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams

quantize = pytest.importorskip("mg.quantize_export.cli").main
pytestmark = needs_device

VOCAB = 50257
NEW_TOKENS = 10
LENGTHS = (4, 1, 19, 33)
RECIPES = {
    "int8_wo": ([], Int8WeightOnlyLinear),
    "int4_wo": (["--group-size", "32"], Int4WeightOnlyLinear),
}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]


@torch.no_grad()
def _unbatched(model, prompt: list[int]) -> list[int]:
    """Greedy tokens of one sequence, every step a full forward without a cache."""
    device = next(model.parameters()).device
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([tokens], device=device))[0, -1, :VOCAB]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def _served(model, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts in one continuous batch over a paged cache small enough to preempt."""
    runner = ModelRunner(model, num_slots=4, max_length=64, num_blocks=12, block_size=4)
    assert runner.device.type == DEVICE.type
    engine = GenerationEngine(runner, lambda ids: "", VOCAB, max_num_batched_tokens=7)
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
        results = generate_batch(engine, prompts, params)
        assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
        return [r.tokens for r in results]
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    return save_decisive_model(
        tmp_path_factory.mktemp("quantized"), name="float", ffn_hidden_size=128
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_quantized_checkpoint_served_on_the_device(float_checkpoint, tmp_path, recipe, dtype):
    extra, kind = RECIPES[recipe]
    save = tmp_path / recipe
    quantize(["--load", str(float_checkpoint), "--save", str(save), "--recipe", recipe, *extra])
    loaded = load_for_serving(save, device=str(DEVICE), dtype=dtype)
    model = loaded.model.eval()
    fc1 = model.decoder.layers[0].mlp.linear_fc1
    assert isinstance(fc1, kind)
    assert {b.device.type for b in fc1.buffers()} == {DEVICE.type}
    prompts = _prompts()
    expected = [_unbatched(model, p) for p in prompts]
    assert _served(model, prompts) == expected
    if dtype == "float32":  # decisive logits: the CPU's argmax is the device's
        cpu = load_for_serving(save, device="cpu", dtype=dtype).model.eval()
        assert [_unbatched(cpu, p) for p in prompts] == expected
