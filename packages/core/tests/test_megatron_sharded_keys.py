"""Our parameter names -> megatron-core 0.16.1's `sharded_state_dict` keys (CPU, one rank)."""

from __future__ import annotations

import warnings

import pytest

from mg.core.checkpoint.megatron_sharded_keys import KeyLayout, ShardedKey, megatron_sharded_key
from mg.core.models.gpt import GPTModel
from mg.core.testing.megatron_reference import TINY_SHAPES, tiny_config

pytestmark = pytest.mark.compat


def _their_entries(model) -> dict[str, list]:
    """Megatron's sharded tensors per state-dict name (a factory built into its parts)."""
    out: dict[str, list] = {}
    for name, entry in model.sharded_state_dict().items():
        if name.endswith("_extra_state"):
            continue
        built = entry.build() if hasattr(entry, "build") else [entry]
        out[name] = list(built.values()) if isinstance(built, dict) else list(built)
    return out


@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
def test_keys_layer_axis_and_shapes_match_megatron_core(tmp_path, shape) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron.core warns that TE and Apex are missing
        pytest.importorskip("megatron.core")
        from mg.core.testing.megatron_reference import megatron_gpt_model, megatron_on_cpu

        config = tiny_config(shape, num_layers=3)
        with megatron_on_cpu(tmp_path):
            theirs = _their_entries(megatron_gpt_model(config))
    ours = dict(GPTModel(config).named_parameters())
    assert set(ours) == set(theirs)
    for name, param in ours.items():
        mapped = megatron_sharded_key(name, KeyLayout(config.num_layers))
        for sharded in theirs[name]:
            assert sharded.key == mapped.key, name
            assert sharded.prepend_axis_num == mapped.prepend_axis_num, name
            if mapped.layer is not None:
                assert sharded.global_offset[0] == mapped.layer, name
                assert sharded.global_shape[0] == mapped.num_layers, name
            assert sharded.global_shape[mapped.prepend_axis_num :] == tuple(param.shape), name


def test_tied_output_layer_and_a_later_layer() -> None:
    embedding = ShardedKey("embedding.word_embeddings.weight")
    tied = KeyLayout(4, tied_output=True)
    assert megatron_sharded_key("output_layer.weight", tied) == embedding
    untied = megatron_sharded_key("output_layer.weight", KeyLayout(4))
    assert untied == ShardedKey("output_layer.weight")
    dense = megatron_sharded_key("decoder.layers.3.pre_mlp_layernorm.weight", KeyLayout(4))
    assert dense == ShardedKey("decoder.layers.mlp.linear_fc1.layer_norm_weight", 3, 4)
