"""mg-serve --kv-cache-dtype fp8: the engine's blocks hold float8_e4m3 keys/values with a
scale per position and head, so rounding depends only on a token's own key/value: a
batch of mixed prompt lengths (chunked prefill, preemption) gives each sequence the
greedy tokens it gets served alone with the same fp8 cache (how close fp8 logits stay
to fp32's: packages/core/tests/test_paged_kv_cache_fp8.py). Where torch has no float8
the flag is refused by name."""

from __future__ import annotations

import threading

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.models.paged_kv_cache import FP8
from mg.generate_server.engine import GenerationEngine
from mg.generate_server.errors import ServeSetupError
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams

pytestmark = pytest.mark.skipif(FP8 is None, reason="this torch has no float8_e4m3fn")

VOCAB = 512
NEW_TOKENS = 12
LENGTHS = (3, 1, 17, 40, 9)


def _serve(model, prompts, kv_cache_dtype="fp8", **options) -> list[list[int]]:
    runner = ModelRunner(
        model,
        num_slots=4,
        max_length=128,
        num_blocks=options.pop("num_blocks", None),
        block_size=options.pop("block_size", 16),
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = GenerationEngine(runner, lambda ids: "", VOCAB, **options)
    results: list[list[int]] = [[] for _ in prompts]
    done = threading.Semaphore(0)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
    try:
        for i, prompt in enumerate(prompts):

            def emit(event, i=i) -> None:
                if event.choice is not None:
                    results[i].append(event.choice.token)
                if event.finish_reason is not None:
                    done.release()

            engine.submit(prompt, params, emit)
        for _ in prompts:
            assert done.acquire(timeout=120)
        if runner.num_blocks == 20:
            assert engine.stats.preemptions > 0
    finally:
        engine.shutdown()
    return results


def test_fp8_batch_equals_fp8_alone() -> None:
    torch.manual_seed(0)
    config = presets.tiny_llama(
        vocab_size=VOCAB,
        max_position_embeddings=128,
        seq_length=128,
        init_method_std=0.1,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = GPTModel(config).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]
    alone = [_serve(model, [p])[0] for p in prompts]
    assert _serve(model, prompts) == alone
    assert _serve(model, prompts, max_num_batched_tokens=7) == alone  # chunked prefill
    assert _serve(model, prompts, num_blocks=20, block_size=4) == alone  # preemption


def test_missing_float8_is_refused_by_flag_name(monkeypatch) -> None:
    import mg.core.models.paged_kv_cache as paged
    from mg.generate_server.cli import _check_fp8

    _check_fp8(torch.device("cpu"))
    monkeypatch.setattr(paged, "FP8", None)
    with pytest.raises(ServeSetupError, match="--kv-cache-dtype fp8: torch .* float8_e4m3fn"):
        _check_fp8(torch.device("cpu"))
