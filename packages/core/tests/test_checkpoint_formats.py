"""The torch_dist key layout is chosen from the model's family and configuration, and both
layer specs (local, Transformer Engine) key a GPT alike in Megatron-Core's layout."""

from __future__ import annotations

import dataclasses
import io

import pytest
import torch

from mg.core.checkpoint import CheckpointError
from mg.core.checkpoint.formats import DistLayout, check_savable, dist_layout
from mg.core.checkpoint.megatron_dist import megatron_model_state
from mg.core.checkpoint.megatron_sharded_keys import key_layout
from mg.core.models.gpt import GPTModel
from mg.core.testing.megatron_reference import tiny_config


def test_the_layout_follows_from_family_and_configuration() -> None:
    dense = tiny_config("llama")
    te = dataclasses.replace(dense, transformer_impl="transformer_engine")
    moe = dataclasses.replace(dense, num_moe_experts=4, moe_router_topk=2)
    assert dist_layout("gpt", dense) is DistLayout.MEGATRON
    assert dist_layout("gpt", te) is DistLayout.MEGATRON
    assert dist_layout("gpt", moe) is DistLayout.MEGATRON
    for family in ("bert", "t5", "mamba", "retro", "vlm"):  # every family: Megatron's layout
        assert dist_layout(family, dense) is DistLayout.MEGATRON
    with pytest.raises(CheckpointError, match=r"^--ckpt-format torch_dist: a 'clip' model"):
        dist_layout("clip", dense)  # a family must declare its layout
    assert check_savable("torch", te, family="gpt") is None
    assert check_savable("torch_dist", te, family="gpt") is DistLayout.MEGATRON


@pytest.mark.parametrize("fmt", ["zarr"])
def test_a_format_without_a_writer_is_refused_naming_the_flag(fmt) -> None:
    with pytest.raises(CheckpointError, match=rf"^--ckpt-format {fmt}: .*torch_dist"):
        check_savable(fmt, tiny_config("gpt2"), family="gpt")


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_both_layer_specs_have_the_same_megatron_keys(shape) -> None:
    """The TE spec's fused norms are Megatron's own keys for the local spec's norms: both
    models give the same tensors (keys, global shapes, values) and `_extra_state` objects;
    the TE spec's `_extra_state` entries are objects, not tensors."""
    local_config = tiny_config(shape)
    te_config = dataclasses.replace(local_config, transformer_impl="transformer_engine")
    torch.manual_seed(0)
    local = GPTModel(local_config)
    te = GPTModel(te_config)
    weights = te.state_dict()
    for name, value in local.state_dict().items():  # the same values under the TE names
        for norm, fused in (("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
                            ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_")):  # fmt: skip
            name = name.replace(norm, fused)
        weights[name] = value
    te_named = {**weights, "decoder.layers.0.self_attention.linear_qkv._extra_state": b"fp8"}
    layout = key_layout(local_config)
    ours = megatron_model_state(local.state_dict(), layout, extra_state=True)
    theirs = megatron_model_state(te_named, layout, extra_state=True)
    assert ours.tensors.keys() == theirs.tensors.keys()
    for key, chunks in ours.tensors.items():
        assert chunks.global_shape == theirs.tensors[key].global_shape
        (mine, _), (other, _) = chunks.pieces[0], theirs.tensors[key].pieces[0]
        assert torch.equal(mine, other), key
    assert ours.objects.keys() == theirs.objects.keys()
    qkv = "decoder.layers.self_attention.linear_qkv._extra_state/shard_0_2"
    assert theirs.extra_states == {qkv: "decoder.layers.0.self_attention.linear_qkv._extra_state"}
    stored = {k: torch.load(io.BytesIO(v.getvalue())) for k, v in theirs.objects.items()}
    assert stored[qkv] == [b"fp8"]  # the module's own, as Megatron-Core stores it
    assert torch.load(io.BytesIO(ours.objects[qkv].getvalue())) == [None]
