"""Greedy generation of a Gemma 3 (text) model through mg-serve's engine equals
transformers' `generate()`: a prompt longer than the sliding window, prefilled in chunks,
then 32 tokens decoded over the paged KV cache (the local layers see only their window)."""

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
    config = transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        sliding_window=WINDOW,
        sliding_window_pattern=2,  # sliding, full, sliding, full
        query_pre_attn_scalar=16,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,  # a random tied model mostly repeats its input token
    )
    torch.manual_seed(0)
    hf = transformers.Gemma3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.05 if "embed" in name else 0.15)
    ours_config = config_from_hf(json.loads(config.to_json_string()))
    ours = GPTModel(ours_config).eval()
    ours.load_state_dict(hf_to_megatron(hf.state_dict(), ours_config, "gemma3_text"))
    return hf, ours


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["gathered", "cpu-kernel"])
@torch.no_grad()
def test_gemma3_greedy_generation_equals_transformers(decode_kernel: bool) -> None:
    hf, ours = _models()
    prompt = torch.randint(1, VOCAB, (3 * WINDOW,), generator=torch.Generator().manual_seed(2))
    expected = hf.generate(
        prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0
    )[0, len(prompt) :].tolist()
    assert len(expected) == NEW_TOKENS and len(set(expected)) > 16  # not a degenerate loop
    runner = ModelRunner(ours, 2, 64, block_size=4)
    if decode_kernel:  # decode rows read their blocks in place, each layer with its window
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
