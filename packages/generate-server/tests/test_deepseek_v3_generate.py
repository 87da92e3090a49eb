"""Greedy generation of a DeepSeek-V3 model (multi-latent attention, YaRN, sigmoid-routed
experts) through mg-serve's engine equals transformers' `generate()` for 32 tokens, the
prompt prefilled in chunks over cached blocks; the paged cache holds MLA's latent only:
(kv_lora_rank + qk_pos_emb_head_dim) × layers × dtype bytes a token, measured from the
pool and equal to what the server's block budget counts."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from mg.core.models import GPTModel, TransformerConfig  # noqa: E402
from mg.core.models.hf_mapping import config_from_hf, hf_to_megatron  # noqa: E402
from mg.core.models.paged_kv_cache import PagedKVCache  # noqa: E402
from mg.core.models.paged_latent_cache import PagedLatentCache  # noqa: E402
from mg.generate_server.engine import GenerationEngine  # noqa: E402
from mg.generate_server.runner import ModelRunner  # noqa: E402
from mg.generate_server.sampling import SamplingParams  # noqa: E402

VOCAB = 128
NEW_TOKENS = 32
KV_LORA, ROPE, LAYERS = 24, 8, 3


def _models(folder) -> tuple[torch.nn.Module, GPTModel]:
    config = transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=KV_LORA,
        q_lora_rank=32,
        qk_rope_head_dim=ROPE,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        num_nextn_predict_layers=0,  # no multi-token prediction layer here
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.15)
    hf.save_pretrained(folder)  # per-expert tensors, as on disk (transformers fuses them in memory)
    ours_config = config_from_hf(json.loads(config.to_json_string()))
    ours = GPTModel(ours_config).eval()
    state = load_file(folder / "model.safetensors")
    ours.load_state_dict(hf_to_megatron(state, ours_config, "deepseek_v3"))
    return hf, ours


def test_the_pool_holds_the_latent_only() -> None:
    """Bytes per token measured from the pool, and as the server's block budget counts them."""
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=VOCAB,
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        multi_latent_attention=True,
        kv_lora_rank=KV_LORA,
        qk_head_dim=16,
        qk_pos_emb_head_dim=ROPE,
        v_head_dim=12,
    )
    for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2)):
        model = GPTModel(config).to(dtype).eval()
        runner = ModelRunner(model, 2, 64, block_size=4)
        assert isinstance(runner.cache, PagedLatentCache)
        per_token = (KV_LORA + ROPE) * LAYERS * size
        assert runner.cache.bytes_per_token() == per_token
        assert PagedKVCache.block_bytes(model, 4) == 4 * per_token


@pytest.mark.slow  # transformers' generate() and ours, 32 tokens each: ~23 s on 2 CPUs
@torch.no_grad()
def test_deepseek_v3_greedy_generation_equals_transformers(tmp_path) -> None:
    hf, ours = _models(tmp_path)
    prompt = torch.randint(1, VOCAB, (13,), generator=torch.Generator().manual_seed(2))
    expected = hf.generate(
        prompt[None], max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=0
    )[0, len(prompt) :].tolist()
    assert len(expected) == NEW_TOKENS and len(set(expected)) > 8  # not a degenerate loop
    runner = ModelRunner(ours, 2, 64, block_size=4)
    assert isinstance(runner.cache, PagedLatentCache)
    per_token = (KV_LORA + ROPE) * LAYERS * 4  # fp32
    assert runner.cache.bytes_per_token() == per_token
    assert PagedKVCache.block_bytes(ours, 4) == 4 * per_token
    engine = GenerationEngine(
        runner, lambda ids: " ".join(map(str, ids)), VOCAB, max_num_batched_tokens=5
    )
    try:
        events = engine.generate(
            prompt.tolist(), SamplingParams(max_new_tokens=NEW_TOKENS, greedy=True)
        )
    finally:
        engine.shutdown()
    generated = [e.choice.token for e in events if e.choice is not None]
    assert generated == expected
