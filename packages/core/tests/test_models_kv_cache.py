"""Incremental decoding with `KVCache` gives the logits of a full forward of the whole sequence."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.models.kv_cache import KVCache

PRESETS = {
    "gpt2": presets.tiny_gpt2,
    "llama": presets.tiny_llama,  # RoPE, GQA, RMSNorm, SwiGLU
    "mistral": presets.tiny_mistral,  # sliding window shorter than the sequences below
}


def _model(name: str) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(PRESETS[name](hidden_dropout=0.0, attention_dropout=0.0)).eval()


@pytest.mark.parametrize("name", sorted(PRESETS))
@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(name: str) -> None:
    model = _model(name)
    ids = torch.randint(
        0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1)
    )
    full = model(ids)
    cache = KVCache.for_model(model, num_slots=2, max_length=32)
    cache.bind(torch.tensor([1]), torch.tensor([0]))
    prefix = 12
    steps = [model(ids[:, :prefix], torch.arange(prefix)[None], inference_cache=cache)]
    for pos in range(prefix, ids.shape[1]):
        cache.bind(torch.tensor([1]), torch.tensor([pos]))
        steps.append(model(ids[:, pos : pos + 1], torch.tensor([[pos]]), inference_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@torch.no_grad()
def test_rows_at_different_positions_right_padded(name: str) -> None:
    """Two prompts of different lengths prefilled together (right padding), then
    decoded in one batch while each row sits at its own position."""
    model = _model(name)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(0, model.config.vocab_size, (1, 15), generator=gen)
    b = torch.randint(0, model.config.vocab_size, (1, 11), generator=gen)
    cache = KVCache.for_model(model, num_slots=4, max_length=24)
    padded = torch.zeros(2, 9, dtype=torch.long)
    padded[0], padded[1, :5] = a[0, :9], b[0, :5]
    cache.bind(torch.tensor([3, 0]), torch.tensor([0, 0]))
    prefill = model(padded, torch.arange(9).expand(2, 9), inference_cache=cache)
    torch.testing.assert_close(prefill[0], model(a[:, :9])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(prefill[1, :5], model(b[:, :5])[0], atol=1e-5, rtol=1e-5)
    pos = torch.tensor([9, 5])
    for _ in range(6):
        cache.bind(torch.tensor([3, 0]), pos)
        step = torch.stack([a[0, pos[0]], b[0, pos[1]]])[:, None]
        out = model(step, pos[:, None], inference_cache=cache)
        torch.testing.assert_close(
            out[0, 0], model(a[:, : pos[0] + 1])[0, -1], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            out[1, 0], model(b[:, : pos[1] + 1])[0, -1], atol=1e-5, rtol=1e-5
        )
        pos = pos + 1


def test_writing_past_the_cache_is_refused() -> None:
    model = _model("gpt2")
    cache = KVCache.for_model(model, num_slots=1, max_length=4)
    cache.bind(torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(ValueError, match="holds 4 positions"):
        model(torch.tensor([[1, 2]]), torch.tensor([[3, 4]]), inference_cache=cache)
