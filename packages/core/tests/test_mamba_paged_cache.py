"""Packed steps over `PagedHybridCache` give each sequence the logits of a full forward:
two sequences of a hybrid (Mamba + attention + MLP) model share steps while one is
prefilled in chunks (the recurrent state carried from chunk to chunk) and the other
decodes, then both decode, each from its own state slot and its own KV blocks."""

from __future__ import annotations

import pytest
import torch

from mg.core.models.mamba import MambaConfig, MambaModel, PagedHybridCache
from mg.core.models.paged_kv_cache import PagedSegment


def _model(pattern: str) -> MambaModel:
    torch.manual_seed(0)
    config = MambaConfig(
        num_layers=len(pattern),
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=97,
        seq_length=64,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=16,
        mamba_chunk_size=8,
        position_embedding_type="rope",
        hybrid_override_pattern=pattern,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return MambaModel(config).eval()


def _step(model, cache, parts):
    """parts: (ids, context_start, blocks, slot) per sequence → logits per sequence."""
    segments, ids, positions, start = [], [], [], 0
    for tokens, context, blocks, slot in parts:
        segments.append(PagedSegment(start, len(tokens), context, blocks, slot))
        ids += tokens
        positions += range(context, context + len(tokens))
        start += len(tokens)
    cache.bind(segments)
    logits = model(torch.tensor([ids]), torch.tensor([positions]), inference_cache=cache)[0]
    return [logits[s.query_start : s.query_start + s.query_length] for s in segments]


@pytest.mark.parametrize("pattern", ["MM", "M*M-"])
@torch.no_grad()
def test_packed_steps_equal_full_forward(pattern: str) -> None:
    model = _model(pattern)
    gen = torch.Generator().manual_seed(1)
    a = torch.randint(0, 97, (22,), generator=gen).tolist()
    b = torch.randint(0, 97, (9,), generator=gen).tolist()
    cache = PagedHybridCache.for_model(model, num_slots=3, num_blocks=12, block_size=4)
    blocks_a, blocks_b = [7, 2, 9, 0, 5, 11], [3, 10, 1]
    slot_a, slot_b = 2, 0
    cache.ssm_states.fill_(1.0)  # stale state from an earlier sequence: must be reset
    got_a, got_b = _step(
        model, cache, [(a[:10], 0, blocks_a, slot_a), (b[:7], 0, blocks_b, slot_b)]
    )
    got_b2, got_a2 = _step(
        model, cache, [(b[7:8], 7, blocks_b, slot_b), (a[10:20], 10, blocks_a, slot_a)]
    )
    da, db = _step(model, cache, [(a[20:21], 20, blocks_a, slot_a), (b[8:9], 8, blocks_b, slot_b)])
    (da2,) = _step(model, cache, [(a[21:22], 21, blocks_a, slot_a)])
    full_a = model(torch.tensor([a]))[0]
    full_b = model(torch.tensor([b]))[0]
    torch.testing.assert_close(torch.cat([got_a, got_a2, da, da2]), full_a, rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.cat([got_b, got_b2, db]), full_b, rtol=0, atol=1e-4)
