"""YaRN RoPE scaling against transformers' "yarn" rope init and Megatron-Core's formulas."""

from __future__ import annotations

import math

import pytest
import torch

from mg.core.models.config import ConfigError, TransformerConfig
from mg.core.models.rope import RotaryEmbedding
from mg.core.models.yarn import mla_softmax_scale, yarn_concentration_factor, yarn_inv_freq


def _config(**kw) -> TransformerConfig:
    base = dict(
        num_layers=1,
        hidden_size=256,
        num_attention_heads=4,
        vocab_size=128,
        position_embedding_type="rope",
        rotary_base=10000.0,
        rope_type="yarn",
        rotary_scaling_factor=8.0,
        original_max_position_embeddings=512,
        seq_length=64,
        max_position_embeddings=4096,
    )
    base.update(kw)
    return TransformerConfig(**base)


def _hf_yarn(rope: dict, head_dim: int = 64, base: float = 10000.0, max_positions: int = 4096):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(
        hidden_size=head_dim * 4,
        num_attention_heads=4,
        max_position_embeddings=max_positions,
        rope_parameters={"rope_type": "yarn", "rope_theta": base, **rope},
    )
    return ROPE_INIT_FUNCTIONS["yarn"](config, torch.device("cpu"))


@pytest.mark.parametrize(
    ("mg_fields", "hf_fields"),
    [
        # the YaRN paper's defaults: concentration 0.1 ln s + 1
        (
            dict(rotary_scaling_factor=8.0, original_max_position_embeddings=512),
            dict(factor=8.0, original_max_position_embeddings=512),
        ),
        # DeepSeek-V3's: mscale = mscale_all_dim = 1 (concentration 1), other betas
        (
            dict(
                rotary_scaling_factor=40.0,
                original_max_position_embeddings=256,
                mscale=1.0,
                mscale_all_dim=1.0,
                beta_fast=16.0,
                beta_slow=2.0,
                rotary_base=50000.0,
            ),
            dict(
                factor=40.0,
                original_max_position_embeddings=256,
                mscale=1.0,
                mscale_all_dim=1.0,
                beta_fast=16.0,
                beta_slow=2.0,
            ),
        ),
        # gpt-oss': the ramp band not rounded to whole channels (HF truncate=False)
        (
            dict(
                rotary_scaling_factor=32.0,
                original_max_position_embeddings=1024,
                yarn_correction_range_round_to_int=False,
                rotary_base=150000.0,
            ),
            dict(factor=32.0, original_max_position_embeddings=1024, truncate=False),
        ),
    ],
)
def test_yarn_matches_transformers(mg_fields: dict, hf_fields: dict) -> None:
    config = _config(**mg_fields)
    hf_inv_freq, hf_factor = _hf_yarn(hf_fields, base=config.rotary_base)
    inv_freq = yarn_inv_freq(config, config.rotary_dim)
    torch.testing.assert_close(inv_freq, hf_inv_freq, rtol=0, atol=0)
    assert yarn_concentration_factor(config) == pytest.approx(hf_factor, rel=1e-12)

    # the tables RotaryEmbedding hands to every layer: HF's cos/sin × attention factor
    positions = torch.tensor([[0, 1, 7, 511, 2047, 4095]])
    cos, sin = RotaryEmbedding(config)(positions)
    angles = positions.float()[..., None] * hf_inv_freq
    angles = torch.cat((angles, angles), dim=-1)[:, :, None, :]
    torch.testing.assert_close(cos, angles.cos() * hf_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, angles.sin() * hf_factor, rtol=0, atol=1e-6)


def test_yarn_keeps_high_and_stretches_low_frequencies() -> None:
    """The first channel (fastest) is untouched, the last divided by the factor."""
    config = _config()
    plain = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    inv_freq = yarn_inv_freq(config, 64)
    assert inv_freq[0] == plain[0]
    assert inv_freq[-1] == pytest.approx(plain[-1].item() / 8.0, rel=1e-6)


def test_mla_softmax_scale_takes_mscale_all_dim_squared() -> None:
    """DeepSeek-V3: (0.1·1·ln 40 + 1)² / √192, as HF's DeepseekV3Attention.scaling."""
    config = _config(rotary_scaling_factor=40.0, mscale=1.0, mscale_all_dim=1.0)
    expected = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192)
    assert mla_softmax_scale(config, 192) == pytest.approx(expected, rel=1e-15)
    assert mla_softmax_scale(_config(rope_type="rope"), 192) == 1 / math.sqrt(192)


def test_yarn_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="rope_type"):
        _config(position_embedding_type="learned_absolute")
    with pytest.raises(ConfigError, match="rotary_scaling_factor"):
        _config(rotary_scaling_factor=0.0)
    with pytest.raises(ConfigError, match="rope_type"):
        _config(rope_type="ntk")
