"""TransformerConfig: Megatron's derived defaults, validation messages, presets."""

import json

import pytest

from mg.core.models import (
    ConfigError,
    RopeScaling,
    TransformerConfig,
    pad_vocab_size,
    presets,
    swiglu_ffn_hidden_size,
)


def test_megatron_defaults_are_derived():
    c = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    assert c.ffn_hidden_size == 256  # 4h
    assert c.kv_channels == 16
    assert c.num_query_groups == 4  # MHA
    assert c.max_position_embeddings == c.seq_length
    assert (c.normalization, c.activation, c.add_bias_linear) == ("LayerNorm", "gelu", True)
    assert (c.attention_dropout, c.hidden_dropout, c.init_method_std) == (0.1, 0.1, 0.02)


def test_swiglu_ffn_default_follows_megatron_rounding():
    # megatron/training/arguments.py: int((4 * h * 2 / 3) / 64) * 64
    assert swiglu_ffn_hidden_size(4096) == 10880
    assert swiglu_ffn_hidden_size(64) == 128
    c = TransformerConfig(
        num_layers=1, hidden_size=4096, num_attention_heads=32, vocab_size=8, activation="swiglu"
    )
    assert c.ffn_hidden_size == 10880 and c.swiglu and c.gated_linear_unit


def test_pad_vocab_size_like_megatron():
    assert pad_vocab_size(50257) == 50304
    assert pad_vocab_size(50257, 128, tensor_parallel_size=2) == 50432
    assert pad_vocab_size(32000) == 32000


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(hidden_size=65), "not divisible by the number of attention heads"),
        (dict(num_query_groups=3), "must be a multiple of the number of query groups"),
        (dict(seq_length=64, max_position_embeddings=32), "longer than the maximum number"),
        (dict(position_embedding_type="alibi"), "position_embedding_type"),
        (dict(normalization="BatchNorm"), "normalization"),
        (dict(activation="tanh"), "activation"),
        (dict(attention_backend="xformers"), "attention_backend"),
        (dict(window_size=(8, 8)), "right == 0"),
        (dict(position_embedding_type="rope", rotary_percent=0.1), "must be even"),
        (dict(rope_scaling=RopeScaling()), "only applies with position_embedding_type='rope'"),
        (dict(hidden_dropout=1.0), "hidden_dropout"),
        (dict(num_layers=0), "num_layers"),
        (dict(num_moe_experts=4, moe_router_topk=5), "moe_router_topk"),
        (dict(num_moe_experts=4, moe_router_topk=1), "moe_router_pre_softmax"),
        (dict(num_moe_experts=4, moe_layer_freq=[1, 2]), "moe_layer_freq"),
        (dict(num_moe_experts=4, moe_router_enable_expert_bias=True), "sigmoid"),
        (dict(num_moe_experts=4, moe_pad_expert_input_to_capacity=True), "capacity"),
        (dict(num_moe_experts=6, moe_router_num_groups=4, moe_router_group_topk=2), "divisible"),
        (dict(num_moe_experts=4, moe_shared_expert_gate=True), "moe_shared_expert_gate"),
    ],
)
def test_validation_messages(fields, message):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=100)
    with pytest.raises(ConfigError, match=message) as info:
        TransformerConfig(**{**base, **fields})
    assert str(info.value).startswith("TransformerConfig.")


def test_moe_defaults_and_layer_pattern():
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=100)
    assert TransformerConfig(**base).moe_layer_pattern == [False] * 4
    c = TransformerConfig(**base, num_moe_experts=8, moe_layer_freq=2)
    assert c.moe_ffn_hidden_size == c.ffn_hidden_size
    assert c.moe_layer_pattern == [True, False, True, False]
    first_dense = TransformerConfig(**base, num_moe_experts=8, moe_layer_freq=[0, 1, 1, 1])
    assert first_dense.moe_layer_pattern == [False, True, True, True]
    assert TransformerConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_kv_channels_may_be_set_when_hidden_is_not_divisible():
    c = TransformerConfig(
        num_layers=1, hidden_size=65, num_attention_heads=4, kv_channels=16, vocab_size=8
    )
    assert c.query_projection_size == 64


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_presets_validate_and_round_trip_through_json(name):
    config = presets.PRESETS[name]()
    again = TransformerConfig.from_dict(json.loads(json.dumps(config.to_dict())))
    assert again == config


def test_preset_shapes():
    assert presets.llama31_8b().rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert presets.mistral_7b().window_size == (4095, 0)
    assert presets.llama3_8b().num_query_groups == 8
    assert presets.gpt2_124m().activation == "gelu_tanh"
    assert presets.llama3_8b(num_layers=2).num_layers == 2


def test_from_dict_rejects_unknown_fields():
    data = presets.tiny_gpt2().to_dict() | {"num_experts": 4}
    with pytest.raises(ConfigError, match="num_experts"):
        TransformerConfig.from_dict(data)
