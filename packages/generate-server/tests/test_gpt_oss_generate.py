"""Greedy generation of a gpt-oss model through mg-serve's engine equals transformers'
`generate()`: a prompt longer than the sliding window, prefilled in chunks, then 32 tokens
decoded over the paged KV cache (sinks in every softmax, the sliding layers within their
window, the full layers over everything)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mg.core.models import GPTModel  # noqa: E402
from mg.core.models.hf_mapping import config_from_hf, hf_to_megatron  # noqa: E402
from mg.generate_server.batch import generate_batch  # noqa: E402
from mg.generate_server.engine import GenerationEngine  # noqa: E402
from mg.generate_server.runner import ModelRunner  # noqa: E402
from mg.generate_server.sampling import SamplingParams  # noqa: E402

VOCAB = 128
WINDOW = 6
NEW_TOKENS = 32


def _models() -> tuple[torch.nn.Module, GPTModel]:
    config = transformers.GptOssConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,  # sliding, full, sliding, full
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=128,
        sliding_window=WINDOW,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 32,
        },
    )
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            elif "sinks" in name:
                p.normal_(0.0, 1.0)  # sinks that matter
            else:
                p.normal_(0.0, 0.05 if "embed" in name else 0.15)
    ours_config = config_from_hf(json.loads(config.to_json_string()))
    ours = GPTModel(ours_config).eval()
    ours.load_state_dict(hf_to_megatron(hf.state_dict(), ours_config, "gpt_oss"))
    return hf, ours


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["gathered", "cpu-kernel"])
@torch.no_grad()
def test_gpt_oss_greedy_generation_equals_transformers(decode_kernel: bool) -> None:
    hf, ours = _models()
    prompt = torch.randint(1, VOCAB, (3 * WINDOW,), generator=torch.Generator().manual_seed(2))
    expected = hf.generate(
        prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0
    )[0, len(prompt) :].tolist()
    assert len(expected) == NEW_TOKENS and len(set(expected)) > 12  # not a degenerate loop
    runner = ModelRunner(ours, 2, 64, block_size=4)
    if decode_kernel:  # decode rows read their blocks in place, with each head's sink
        runner.choose_decode_attention()
        if runner.cache_decode_kernel is None:
            pytest.skip("the CPU decode kernel cannot be built here")
    engine = GenerationEngine(
        runner,
        lambda ids: " ".join(map(str, ids)),
        VOCAB,
        max_num_batched_tokens=5,  # the prompt prefills in chunks over cached blocks
    )
    try:
        events = engine.generate(
            prompt.tolist(), SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
        )
    finally:
        engine.shutdown()
    generated = [e.choice.token for e in events if e.choice is not None]
    assert generated == expected


SCHEDULES = {
    "default": {},
    "no-prefix-caching": {"prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 7},
    "preemption": {"num_blocks": 16, "block_size": 4},
}


@pytest.fixture(scope="module")
def batch() -> tuple[GPTModel, list[list[int]], list[list[int]]]:
    """Prompts of mixed lengths (two share a prefix longer than the window, one is shorter
    than it) and transformers' greedy continuation of each alone."""
    hf, ours = _models()
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(1, VOCAB, (2 * WINDOW,), generator=g).tolist()
    prompts = [
        shared + torch.randint(1, VOCAB, (5,), generator=g).tolist(),
        shared + torch.randint(1, VOCAB, (9,), generator=g).tolist(),
        torch.randint(1, VOCAB, (WINDOW - 2,), generator=g).tolist(),
        torch.randint(1, VOCAB, (4 * WINDOW,), generator=g).tolist(),
    ]
    expected = []
    with torch.no_grad():
        for ids in prompts:
            out = hf.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0
            )
            expected.append(out[0, len(ids) :].tolist())
    return ours, prompts, expected


@pytest.mark.slow  # transformers' generate() for four prompts, then four schedules: ~45 s
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@torch.no_grad()
def test_gpt_oss_continuous_batch_equals_transformers(batch, schedule: str) -> None:
    """All prompts in one continuous batch, under prefix caching (hit), chunked prefill
    and preemption by recompute: each prompt's tokens are transformers' alone."""
    model, prompts, expected = batch
    options = dict(SCHEDULES[schedule])
    num_blocks, block_size = options.pop("num_blocks", None), options.pop("block_size", 4)
    runner = ModelRunner(model, 4, 96, num_blocks=num_blocks, block_size=block_size)
    engine = GenerationEngine(runner, lambda ids: " ".join(map(str, ids)), VOCAB, **options)
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
        results = generate_batch(engine, prompts, params)
        assert [r.tokens for r in results] == expected
        if schedule == "preemption":
            assert engine.stats.preemptions > 0
    finally:
        engine.shutdown()
