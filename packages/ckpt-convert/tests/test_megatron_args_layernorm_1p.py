"""Megatron's --apply-layernorm-1p travels with a checkpoint's args both ways: a Megatron
checkpoint trained with it imports as a zero-centred model, and mg's exports say so."""

from mg.ckpt_convert.megatron_args import config_from_megatron_args
from mg.ckpt_convert.megatron_lm import megatron_args_from_config
from mg.core.models import TransformerConfig


def test_apply_layernorm_1p_round_trips_through_megatron_args() -> None:
    for zero_centered in (False, True):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            vocab_size=128,
            layernorm_zero_centered_gamma=zero_centered,
        )
        args = vars(megatron_args_from_config(config, None, tp=1, pp=1))
        assert args["apply_layernorm_1p"] is zero_centered
        back = config_from_megatron_args(args)
        assert back.layernorm_zero_centered_gamma is zero_centered
