"""Packed steps over `PagedKVCache` give the logits of a full forward of each sequence:
prefill in chunks, decode several sequences at different positions in one step,
blocks scattered in the pool and a prefix block shared between two sequences."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.models.paged_kv_cache import (
    PagedKVCache,
    PagedSegment,
    decode_segments,
    encode_segments,
)

PRESETS = {
    "gpt2": presets.tiny_gpt2,
    "llama": presets.tiny_llama,  # RoPE, GQA, RMSNorm, SwiGLU
    "mistral": presets.tiny_mistral,  # sliding window shorter than the sequences below
}


def _model(name: str) -> GPTModel:
    torch.manual_seed(0)
    return GPTModel(PRESETS[name](hidden_dropout=0.0, attention_dropout=0.0)).eval()


def _step(model, cache, parts):
    """parts: (ids, context_start, blocks) per sequence → logits per sequence."""
    segments, ids, positions, start = [], [], [], 0
    for tokens, context, blocks in parts:
        segments.append(PagedSegment(start, len(tokens), context, blocks))
        ids += tokens
        positions += range(context, context + len(tokens))
        start += len(tokens)
    cache.bind(segments)
    logits = model(torch.tensor([ids]), torch.tensor([positions]), inference_cache=cache)[0]
    return [logits[s.query_start : s.query_start + s.query_length] for s in segments]


@pytest.mark.parametrize("kernel", [False, True], ids=["sdpa", "cpu-kernel"])
@pytest.mark.parametrize("name", sorted(PRESETS))
@torch.no_grad()
def test_chunked_prefill_and_batched_decode_equal_full_forward(name: str, kernel: bool) -> None:
    """Also with decode rows answered by the CPU kernel that reads blocks in place."""
    model = _model(name)
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, model.config.vocab_size, (23,), generator=gen).tolist()
    b = torch.randint(0, model.config.vocab_size, (9,), generator=gen).tolist()
    cache = PagedKVCache.for_model(model, num_blocks=12, block_size=4)
    if kernel:
        what = cache.use_cpu_decode_kernel()
        if cache.decode_kernel is None:
            pytest.skip(what)
    blocks_a, blocks_b = [7, 2, 9, 0, 5, 11], [3, 10, 1]  # scattered, not in order
    # step 1: a's first chunk (10 tokens) with b's whole prompt (7 tokens)
    got_a, got_b = _step(model, cache, [(a[:10], 0, blocks_a), (b[:7], 0, blocks_b)])
    # step 2: b decodes one token while a prefills its second chunk from position 10
    got_b2, got_a2 = _step(model, cache, [(b[7:8], 7, blocks_b), (a[10:20], 10, blocks_a)])
    out_a, out_b = [got_a, got_a2], [got_b, got_b2]
    # then both decode together, each at its own position, and a alone once b is done
    da, db = _step(model, cache, [(a[20:21], 20, blocks_a), (b[8:9], 8, blocks_b)])
    out_a.append(da)
    out_b.append(db)
    for i in range(21, 23):
        (da,) = _step(model, cache, [(a[i : i + 1], i, blocks_a)])
        out_a.append(da)
    full_a = model(torch.tensor([a]))[0]
    full_b = model(torch.tensor([b]))[0]
    torch.testing.assert_close(torch.cat(out_a), full_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(out_b), full_b, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_shared_prefix_block_is_read_not_recomputed() -> None:
    """Two sequences with the same first 8 tokens: the second reuses the first's two
    blocks and prefills only its own suffix."""
    model = _model("llama")
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(0, model.config.vocab_size, (8,), generator=gen).tolist()
    x = prefix + torch.randint(0, model.config.vocab_size, (5,), generator=gen).tolist()
    y = prefix + torch.randint(0, model.config.vocab_size, (3,), generator=gen).tolist()
    cache = PagedKVCache.for_model(model, num_blocks=8, block_size=4)
    (got_x,) = _step(model, cache, [(x, 0, [4, 6, 1, 2])])
    (got_y,) = _step(model, cache, [(y[8:], 8, [4, 6, 3])])
    torch.testing.assert_close(got_x, model(torch.tensor([x]))[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_y, model(torch.tensor([y]))[0, 8:], atol=1e-5, rtol=1e-5)


def test_segments_round_trip_and_errors() -> None:
    segments = [PagedSegment(0, 3, 0, [5]), PagedSegment(3, 1, 9, [1, 2, 8])]
    assert decode_segments(encode_segments(segments)) == segments
    model = _model("gpt2")
    cache = PagedKVCache.for_model(model, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="its 1 blocks of 4 hold 4"):
        cache.bind([PagedSegment(0, 5, 0, [0])])
    with pytest.raises(ValueError, match="tile the packed row"):
        cache.bind([PagedSegment(1, 2, 0, [0])])
    assert PagedKVCache.block_bytes(model, 16) == 2 * 2 * 16 * 64 * 4  # 2 layers, 1 group x 64


def test_decode_kernel_choice_says_why_not(monkeypatch) -> None:
    """Where the CPU kernel cannot be built the cache keeps SDPA and says why; an fp8
    pool never asks for it."""
    from mg.core.models import paged_kv_cache

    model = _model("llama")
    monkeypatch.setattr(paged_kv_cache, "decode_kernel", lambda *shape: (None, "no C++ (x)"))
    cache = PagedKVCache.for_model(model, num_blocks=4, block_size=4)
    assert cache.use_cpu_decode_kernel() == f"{paged_kv_cache.GATHERED}: no C++ (x)"
    assert cache.decode_kernel is None
    fp8 = PagedKVCache.for_model(model, num_blocks=4, block_size=4, fp8=True)
    assert fp8.use_cpu_decode_kernel() == paged_kv_cache.GATHERED
