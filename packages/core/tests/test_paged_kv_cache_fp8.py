"""`PagedKVCache(fp8=True)`: keys and values stored as float8_e4m3 bytes with an fp32 scale
per position and head. The attention it computes is exactly the fp32 cache's attention
over the dequantized keys and values (the only error is the rounding to e4m3, ≤ 1/16 of
each head's largest entry), a model's logits stay within 2 % of fp32's, and a block takes
(d + 4) / (4 d) of an fp32 block."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.models.paged_kv_cache import (
    FP8,
    Fp8UnavailableError,
    PagedKVCache,
    PagedSegment,
    check_fp8,
)

pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")


def _caches(fp8: bool) -> PagedKVCache:
    return PagedKVCache(
        1, num_blocks=6, block_size=4, num_groups=2, head_dim=8, num_heads=4, fp8=fp8
    )


@torch.no_grad()
def test_fp8_attention_is_fp32_attention_over_the_rounded_keys_and_values() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 9, h, 8, generator=gen) for h in (4, 2, 2))
    segments = [
        PagedSegment(0, 7, 0, [3, 1]),
        PagedSegment(7, 1, 4, [0, 5]),
        PagedSegment(8, 1, 0, [2]),
    ]
    fp8 = _caches(True)
    fp8.bind(segments)
    got = fp8.attend(0, q, k, v)
    assert fp8.keys.dtype == torch.uint8 and fp8.key_scales.shape == (1, 6, 4, 2)
    # the keys/values as stored: each [position, head] row rounded to e4m3 at its own scale
    rounded = []
    for x in (k, v):
        scale = x.abs().amax(-1, keepdim=True) / 448
        r = (x / scale).to(FP8).float() * scale
        assert (r - x).abs().max() <= x.abs().amax(-1, keepdim=True).max() / 16
        rounded.append(r)
    exact = _caches(False)
    exact.bind(segments)
    # the decoding sequence at position 4 reads blocks written before: fill them alike
    exact.keys[0, 0] = fp8.keys[0, 0].view(FP8).float() * fp8.key_scales[0, 0, ..., None]
    exact.values[0, 0] = fp8.values[0, 0].view(FP8).float() * fp8.value_scales[0, 0, ..., None]
    torch.testing.assert_close(got, exact.attend(0, q, *rounded), rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_model_logits_stay_close_and_blocks_shrink() -> None:
    torch.manual_seed(0)
    model = GPTModel(presets.tiny_llama(hidden_dropout=0.0, attention_dropout=0.0)).eval()
    ids = torch.randint(
        0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1)
    )
    reference = model(ids)
    cache = PagedKVCache.for_model(model, num_blocks=4, block_size=16, fp8=True)
    cache.bind([PagedSegment(0, 40, 0, [2, 0, 3])])
    logits = model(ids, torch.arange(40)[None], inference_cache=cache)
    assert ((logits - reference).norm() / reference.norm()).item() < 0.02
    d = model.decoder.layers[0].self_attention.head_dim
    fp32 = PagedKVCache.block_bytes(model, 16)
    assert PagedKVCache.block_bytes(model, 16, fp8=True) * 4 * d == fp32 * (d + 4)


def test_missing_float8_is_named(monkeypatch) -> None:
    import mg.core.models.paged_kv_cache as paged

    check_fp8("cpu")
    monkeypatch.setattr(paged, "FP8", None)
    with pytest.raises(Fp8UnavailableError, match="float8_e4m3fn on cpu"):
        check_fp8("cpu")
