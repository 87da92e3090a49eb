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


@torch.no_grad()
def test_gpt_oss_greedy_generation_equals_transformers() -> None:
    hf, ours = _models()
    prompt = torch.randint(1, VOCAB, (3 * WINDOW,), generator=torch.Generator().manual_seed(2))
    expected = hf.generate(
        prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0
    )[0, len(prompt) :].tolist()
    assert len(expected) == NEW_TOKENS and len(set(expected)) > 12  # not a degenerate loop
    runner = ModelRunner(ours, 2, 64, block_size=4)
    # the CPU decode kernel has no sinks: decode attends over gathered blocks, said so
    assert "sinks" in runner.choose_decode_attention()
    assert runner.cache_decode_kernel is None
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
