"""mg-serve's engine serves mixture-of-experts models: greedy tokens equal transformers'
`generate()` for Mixtral, Qwen3-MoE and Qwen2-MoE (tiny random models imported with
mg-convert import-hf), prompts of mixed lengths decoded in one continuous batch, under
chunked prefill and preemption. Each expected sequence is generated alone, so equal
tokens also mean that routing in a packed step does not leak between sequences; a
checkpoint with a capacity factor (which would let the other requests of a step push a
token out of its expert) is served dropless and says so by name."""

from __future__ import annotations

import dataclasses
import functools
import logging
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint.model_io import load_model, save_model
from mg.core.testing.hf_moe import HF_MOE_MODELS
from mg.generate_server.batch import generate_batch
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams

transformers = pytest.importorskip("transformers")
convert = pytest.importorskip("mg.ckpt_convert.cli").main

VOCAB = 128
NEW_TOKENS = 12
LENGTHS = (3, 1, 17, 9, 30)
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


FAMILIES = {family: functools.partial(build, **TINY) for family, build in HF_MOE_MODELS.items()}


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]


def _imported(family: str, folder: Path) -> tuple[Path, list[list[int]]]:
    """The HF model imported as an mg checkpoint, and transformers' greedy tokens per prompt."""
    torch.manual_seed(0)
    hf = FAMILIES[family]()
    with torch.no_grad():  # decisive logits and routers: no near-ties for argmax to flip on
        for name, p in hf.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if name.endswith("gate.weight") else 0.3))
    hf.eval().save_pretrained(folder / "hf")
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    expected = []
    for ids in _prompts():
        prompt = torch.tensor([ids])
        with torch.no_grad():
            out = hf.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),  # token 0 is a real token here
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        expected.append(out[0, len(ids) :].tolist())
    convert(["import-hf", str(folder / "hf"), "--save", str(folder / "ckpt")])
    return folder / "ckpt", expected


def _generate(engine: GenerationEngine, prompts: list[list[int]]) -> list[list[int]]:
    """All prompts submitted at once (one batch); each one's greedy tokens."""
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    results = generate_batch(engine, prompts, params)
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    return [r.tokens for r in results]


def _serve(model, **options) -> list[list[int]]:
    """The prompts' greedy tokens from one engine over `model` (options: the engine's,
    and the pool's num_blocks and block_size; a small pool must preempt)."""
    small_pool = "num_blocks" in options
    runner = ModelRunner(
        model,
        num_slots=4,
        max_length=64,
        num_blocks=options.pop("num_blocks", None),
        block_size=options.pop("block_size", 16),
    )
    engine = GenerationEngine(runner, lambda ids: "", VOCAB, **options)
    try:
        tokens = _generate(engine, _prompts())
        if small_pool:
            assert engine.stats.preemptions > 0 and engine.stats.recomputed_tokens > 0
        assert engine.blocks.num_used == 0
        return tokens
    finally:
        engine.shutdown()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_greedy_equals_transformers_generate(family: str, tmp_path: Path) -> None:
    ckpt, expected = _imported(family, tmp_path)
    model, config, _, _ = load_model(ckpt)
    assert config.num_moe_experts == 4 and config.moe_expert_capacity_factor is None
    assert _serve(model.eval()) == expected
    if family == "mixtral":  # the scheduler's other paths, on one family
        assert _serve(model, max_num_batched_tokens=7) == expected  # chunked prefill
        assert _serve(model, num_blocks=14, block_size=4) == expected  # preemption


def test_capacity_factor_checkpoint_is_served_dropless(tmp_path: Path, caplog) -> None:
    """A capacity of 0.5 would drop tokens in every step of a batch; served, each sequence
    still gets transformers' (dropless) tokens, and the log names the factor."""
    ckpt, expected = _imported("mixtral", tmp_path)
    model, config, tokenizer, _ = load_model(ckpt)
    capped = dataclasses.replace(config, moe_expert_capacity_factor=0.5)
    save_model(tmp_path / "capped", model, capped, tokenizer)
    model, config, _, _ = load_model(tmp_path / "capped")
    assert config.moe_expert_capacity_factor == 0.5
    with caplog.at_level(logging.WARNING, logger="mg.generate_server"):
        assert _serve(model.eval()) == expected
    assert "moe_expert_capacity_factor 0.5" in caplog.text
