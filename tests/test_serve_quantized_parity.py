"""mg-serve's engine serves mg-quantize checkpoints: the quantized model's greedy tokens,
prompts of mixed lengths decoded in one continuous batch over the paged KV cache
(chunked prefill and preemption included), equal the same quantized model's own
unbatched generation (a full forward over the whole sequence for every token)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mg.core.checkpoint import load_model
from mg.core.quantization import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from mg.core.testing.serving_checkpoints import save_decisive_model
from mg.generate_server.batch import generate_batch
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams

quantize = pytest.importorskip("mg.quantize_export.cli").main

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
    tokens = list(prompt)
    for _ in range(NEW_TOKENS):
        logits = model(torch.tensor([tokens]))[0, -1, :VOCAB]
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def _generate(engine: GenerationEngine, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts submitted at once (one batch); each one's greedy tokens."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    results = generate_batch(engine, prompts, params)
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    return [r.tokens for r in results]


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    return save_decisive_model(
        tmp_path_factory.mktemp("quantized"), name="float", ffn_hidden_size=128
    )


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_quantized_checkpoint_served_equals_unbatched(float_checkpoint, recipe, tmp_path):
    extra, kind = RECIPES[recipe]
    save = tmp_path / recipe
    quantize(["--load", str(float_checkpoint), "--save", str(save), "--recipe", recipe, *extra])
    model = load_model(save)[0].eval()
    assert isinstance(model.decoder.layers[0].mlp.linear_fc1, kind)
    prompts = _prompts()
    expected = [_unbatched(model, p) for p in prompts]
    for options in ({}, {"max_num_batched_tokens": 7}, {"num_blocks": 12, "block_size": 4}):
        runner = ModelRunner(
            model,
            num_slots=4,
            max_length=64,
            num_blocks=options.pop("num_blocks", None),
            block_size=options.pop("block_size", 16),
        )
        engine = GenerationEngine(runner, lambda ids: "", VOCAB, **options)
        try:
            assert _generate(engine, prompts) == expected, options
            if runner.num_blocks == 12:
                assert engine.stats.preemptions > 0
        finally:
            engine.shutdown()
