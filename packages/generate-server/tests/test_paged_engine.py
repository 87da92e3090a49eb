"""The paged engine's parts: the block pool's bookkeeping, prompt log-probabilities across
prefill chunks, admission when the pool is full, the pool's size from --kv-cache-memory.
(Token-for-token equality with transformers under every schedule is a cross-package
test: tests/test_serve_paged_hf_parity.py.)"""

from __future__ import annotations

import threading

import pytest
import torch

from mg.generate_server.block_manager import BlockManager, block_hash
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.resources import parse_memory, pool_blocks
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams


def test_block_manager_refcounts_prefix_names_and_eviction_order() -> None:
    pool = BlockManager(num_blocks=4, block_size=2)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_available == 1
    assert pool.allocate(2) is None and pool.num_available == 1  # nothing taken
    tokens = [5, 6, 7, 8, 9]
    first = block_hash(None, tokens[0:2])
    pool.name(a[0], first)
    pool.name(a[1], block_hash(first, tokens[2:4]))
    pool.release(a)
    assert pool.num_used == 0 and pool.num_cached == 2
    blocks, names = pool.match_prefix(tokens)  # 5 tokens: both full blocks, last token left
    assert blocks == [0, 1] and pool.num_used == 2
    assert pool.match_prefix(tokens[:4])[0] == [0]  # the last token is never matched
    assert pool.match_prefix([5, 7, 7])[0] == []
    pool.release([0])
    pool.release(blocks)
    # unnamed free blocks go first (2, 3), then the least recently released named one (0)
    assert pool.allocate(3) == [2, 3, 0]
    assert pool.num_cached == 1
    assert pool.match_prefix(tokens)[0] == []  # the chain starts at block 0, now gone
    off = BlockManager(num_blocks=2, block_size=2, prefix_caching=False)
    off.name(0, first)
    assert off.match_prefix(tokens) == ([], [])


@torch.no_grad()
def test_prompt_logprobs_across_prefill_chunks(loaded) -> None:
    """log p of each prompt token after the first, gathered over 3-token chunks, equals
    log_softmax of one full forward."""
    prompt = loaded.tokenizer.tokenize("I had been teaching at the school for a month when")
    logits = loaded.model(torch.tensor([prompt]))[0, :, :50257]  # vocabulary padding cut
    full = torch.log_softmax(logits.float(), dim=-1)
    expected = full[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    engine = GenerationEngine(
        ModelRunner(loaded.model, 2, 64, block_size=4),
        loaded.tokenizer.detokenize,
        50257,
        max_num_batched_tokens=3,
    )
    try:
        events = engine.generate(prompt, SamplingParams(max_new_tokens=2, prompt_logprobs=True))
        assert events[-1].finish_reason == "length"
        torch.testing.assert_close(torch.tensor(events[0].prompt_logprobs), expected)
        assert engine.stats.steps >= len(prompt) // 3
    finally:
        engine.shutdown()


def test_a_full_pool_queues_requests_until_blocks_free(loaded) -> None:
    """A pool of 8 blocks x 4 positions holds two 16-position sequences: the other requests
    wait (never more than two run) and all finish."""
    engine = GenerationEngine(
        ModelRunner(loaded.model, 8, 64, num_blocks=8, block_size=4),
        loaded.tokenizer.detokenize,
        50257,
    )
    try:
        done = threading.Semaphore(0)
        peak = []

        def emit(event) -> None:
            peak.append(engine.blocks.num_used)
            if event.finish_reason is not None:
                assert event.finish_reason == "length"
                done.release()

        with pytest.raises(ValueError, match="exceeds the KV cache \\(8 blocks of 4 positions"):
            engine.submit([1] * 30, SamplingParams(max_new_tokens=4), emit)
        for i in range(5):
            engine.submit([1 + i] * 6, SamplingParams(max_new_tokens=10, greedy=True), emit)
        for _ in range(5):
            assert done.acquire(timeout=60)
        assert max(peak) <= 8 and engine.blocks.num_used == 0
        assert engine.stats.generated_tokens == 50
    finally:
        engine.shutdown()


def test_kv_cache_memory_sizes(loaded) -> None:
    assert parse_memory("2GiB") == 2 * 2**30
    assert parse_memory("1.5GB") == 1_500_000_000
    assert parse_memory("4096") == 4096
    assert parse_memory("0.25") == 0.25
    for bad in ("lots", "0.0", "2 parsecs"):
        with pytest.raises(ValueError):
            parse_memory(bad)
    # tiny GPT-2: 2 layers x (keys + values) x 16 positions x 32 channels x 4 bytes = 8 KiB
    cpu = torch.device("cpu")
    assert pool_blocks(loaded.model, cpu, "1MiB", 16, 8, 64) == 128
    assert pool_blocks(loaded.model, cpu, None, 16, 8, 64) == 8 * 4  # 8 sequences of 64
