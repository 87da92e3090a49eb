"""Megatron-LM's args of an MLA model (what a torch / torch_dist checkpoint records and
Megatron-LM's `--use-checkpoint-args` reads) carry its shape both ways."""

from __future__ import annotations

import dataclasses

import pytest

from mg.ckpt_convert.megatron_lm import megatron_args_from_config
from mg.core.checkpoint.megatron_args import config_from_megatron_args
from mg.core.models import TransformerConfig

MLA = dict(
    num_layers=3,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    ffn_hidden_size=96,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    qk_layernorm=True,
    untie_embeddings_and_output_weights=True,
    multi_latent_attention=True,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=12,
)
FIELDS = (
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "original_max_position_embeddings",
)


@pytest.mark.parametrize(
    "extra",
    [
        dict(rope_type="yarn", rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0),
        dict(rope_type="rope", q_lora_rank=None),
    ],
    ids=["yarn", "rope-q-proj"],
)
def test_mla_args_round_trip(extra) -> None:
    config = TransformerConfig(**{**MLA, **extra})
    back = config_from_megatron_args(vars(megatron_args_from_config(config, None)))
    assert {f: getattr(back, f) for f in FIELDS} == {f: getattr(config, f) for f in FIELDS}


def test_megatron_mla_defaults_to_yarn() -> None:
    """Megatron-LM's MLA without --rope-type takes YaRN (MLATransformerConfig's default)."""
    args = vars(megatron_args_from_config(TransformerConfig(**MLA), None))
    del args["rope_type"]
    back = config_from_megatron_args({**args, "rotary_scaling_factor": 40.0})
    assert back.rope_type == "yarn" and back.rotary_scaling_factor == 40.0
    assert dataclasses.replace(back, rope_type="rope").multi_latent_attention
