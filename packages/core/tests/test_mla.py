"""Multi-latent attention against megatron-core 0.16.1's `MLASelfAttention` (local spec, CPU).

megatron-core builds its GPTModel with MLA on CPU (the patches of
`mg.core.testing.megatron_reference`); its state dict loads into ours with strict=True
(same names and shapes) and the logits agree in fp32. One adaptation: 0.16.1's local
`DotProductAttention` does not take the `k_channels`/`v_channels` that `MLASelfAttention`
passes it, so the spec gets a subclass that drops them (Megatron's kernel then computes
as it is, with kv_channels = v_head_dim giving its output width).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.config import ConfigError
from mg.core.models.mla import MLASelfAttention

pytest.importorskip("megatron.core")

from mg.core.testing.megatron_reference import (  # noqa: E402
    megatron_mla_gpt_model,
    megatron_on_cpu,
)

megatron_mla_gpt = megatron_mla_gpt_model

BASE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    seq_length=16,
    max_position_embeddings=64,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    ffn_hidden_size=96,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    multi_latent_attention=True,
    kv_lora_rank=24,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=12,
)

CONFIGS = {
    # DeepSeek-V3's kind: a query latent, norms on both latents, YaRN with mscale_all_dim
    "q-lora-yarn": dict(
        q_lora_rank=32,
        qk_layernorm=True,
        rope_type="yarn",
        rotary_scaling_factor=4.0,
        original_max_position_embeddings=8,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    # DeepSeek-V2-Lite's kind: queries projected directly, plain RoPE, no latent norms
    "q-proj-rope": dict(q_lora_rank=None, rope_type="rope", rotary_base=500.0),
}


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    import megatron.core.transformer.multi_latent_attention as mla_module

    # 0.16.1 takes its TE stubs (None classes) for Transformer Engine and fails an
    # isinstance check on them; without TE that branch is off
    with pytest.MonkeyPatch.context() as patches:
        patches.setattr(mla_module, "HAVE_TE", False)
        with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
            yield


@pytest.mark.slow  # megatron-core's import and build: ~40 s on 2 CPUs
@pytest.mark.compat
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_mla_equals_megatron_core(megatron, name: str) -> None:
    config = TransformerConfig(**BASE, **CONFIGS[name])
    torch.manual_seed(0)
    reference = megatron_mla_gpt(config)
    with torch.no_grad():  # Megatron's norms start at 1: give them values that matter
        for key, value in reference.state_dict().items():
            if "layernorm" in key and value.is_floating_point():
                value.copy_(1 + 0.1 * torch.randn_like(value))
    state = {k: v for k, v in reference.state_dict().items() if "_extra_state" not in k}
    ours = GPTModel(config).eval()
    ours.load_state_dict(state, strict=True)

    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length))
    positions = torch.arange(config.seq_length).expand(2, -1)
    with torch.no_grad():
        expected = reference(tokens, positions, attention_mask=None)
        got = ours(tokens)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if name == "q-lora-yarn":  # the YaRN softmax scale is really in play
        scale = ours.decoder.layers[0].self_attention.core_attention.softmax_scale
        assert scale == pytest.approx((0.1 * math.log(4.0) + 1) ** 2 / math.sqrt(24))


def test_mla_parameter_names_and_shapes() -> None:
    config = TransformerConfig(**BASE, **CONFIGS["q-lora-yarn"])
    with torch.device("meta"):
        attention = GPTModel(config).decoder.layers[0].self_attention
    assert isinstance(attention, MLASelfAttention)
    assert {k: tuple(v.shape) for k, v in attention.state_dict().items()} == {
        "linear_q_down_proj.weight": (32, 64),
        "linear_q_up_proj.weight": (4 * 24, 32),
        "linear_kv_down_proj.weight": (24 + 8, 64),
        "linear_kv_up_proj.weight": (4 * (16 + 12), 24),
        "q_layernorm.weight": (32,),
        "kv_layernorm.weight": (24,),
        "linear_proj.weight": (64, 4 * 12),
    }


def test_mla_config_errors_name_the_field() -> None:
    fields = {**BASE, **CONFIGS["q-proj-rope"]}
    with pytest.raises(ConfigError, match="num_query_groups"):
        TransformerConfig(**{**fields, "num_query_groups": 2})
    with pytest.raises(ConfigError, match="qk_pos_emb_head_dim"):
        TransformerConfig(**{**fields, "qk_pos_emb_head_dim": 7})
    with pytest.raises(ConfigError, match="multi_latent_attention"):
        TransformerConfig(**{**fields, "position_embedding_type": "none"})
    config = TransformerConfig(**fields)
    assert config.rotary_dim == 8
    assert dataclasses.replace(config, multi_latent_attention=False).rotary_dim == 16


def _flash_attn_stand_in(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **_):
    """flash-attn 2's contract (bshd, one head size for q, k and v), on the CPU."""
    assert q.shape[-1] == k.shape[-1] == v.shape[-1]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=causal,
        scale=softmax_scale,
    )
    return out.transpose(1, 2)


def test_mla_under_flash_attn_pads_its_values(monkeypatch) -> None:
    """flash-attn takes one head size: MLA's narrower values are zero-padded to the
    queries' and the output cut back; the logits are the SDPA path's."""
    import sys
    import types

    from mg.core.models import attention_backend

    stand_in = types.ModuleType("flash_attn")
    stand_in.flash_attn_func = _flash_attn_stand_in
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in)
    monkeypatch.setattr(attention_backend, "cuda_available", lambda: True)
    fields = {**BASE, **CONFIGS["q-lora-yarn"]}
    torch.manual_seed(0)
    sdpa = GPTModel(TransformerConfig(**fields)).eval()
    flash = GPTModel(TransformerConfig(**fields, attention_backend="flash")).eval()
    flash.load_state_dict(sdpa.state_dict())
    tokens = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(flash(tokens), sdpa(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # megatron-core's import and build
@pytest.mark.compat
def test_mla_torch_dist_keys_are_megatron_cores(megatron) -> None:
    """Our torch_dist keys of an MLA GPT are megatron-core 0.16.1's `sharded_state_dict`
    keys (its MLA local spec has no keys map: the layer norms keep their own names)."""
    from mg.core.checkpoint.megatron_sharded_keys import key_layout, megatron_sharded_key

    config = TransformerConfig(**BASE, **CONFIGS["q-lora-yarn"])
    reference = megatron_mla_gpt(config)
    theirs = {v.key for k, v in reference.sharded_state_dict().items() if "_extra_state" not in k}
    layout = key_layout(config)
    with torch.device("meta"):
        ours = {megatron_sharded_key(n, layout).key for n, _ in GPTModel(config).named_parameters()}
    assert ours == theirs
