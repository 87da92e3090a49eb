"""Megatron-Core's torch_dist layout on one process: a GPT saved whole or a layer at a time
(StreamingDistWriter) reads back bit-exact under our names, in the model's order."""

from __future__ import annotations

import re

import pytest
import torch

from mg.core.checkpoint.dist_format import (
    load_full_state,
    load_model_tensors,
    save_dist_checkpoint,
)
from mg.core.checkpoint.dist_stream import StreamingDistWriter
from mg.core.checkpoint.megatron_dist import megatron_model_state
from mg.core.checkpoint.megatron_sharded_keys import key_layout
from mg.core.checkpoint.reader_guard import read_dcp_metadata
from mg.core.models.gpt import GPTModel
from mg.core.testing.megatron_reference import tiny_config

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")


def _model(shape: str) -> GPTModel:
    torch.manual_seed(0)
    model = GPTModel(tiny_config(shape, num_layers=3))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    return model


def _groups(names: list[str]) -> list[list[str]]:
    """Embeddings, each layer, the rest: how a converter walks the model."""
    layers: dict[int, list[str]] = {}
    first = [n for n in names if n.startswith("embedding.")]
    last = [n for n in names if not n.startswith("embedding.") and not _LAYER.match(n)]
    for name in names:
        if match := _LAYER.match(name):
            layers.setdefault(int(match.group(1)), []).append(name)
    return [first, *layers.values(), last]


@pytest.mark.parametrize("shape", ["gpt2", "llama"])
def test_whole_and_streamed_saves_read_back_bit_exact(tmp_path, shape) -> None:
    model = _model(shape)
    config = model.config
    weights = model.state_dict()
    layout = key_layout(config)
    state = megatron_model_state(weights, layout, extra_state=True)
    save_dist_checkpoint(tmp_path / "whole", 1, {**state.tensors, **state.objects}, {})
    writer = StreamingDistWriter(tmp_path / "streamed", 1)
    for group in _groups(list(weights)):
        part = megatron_model_state({n: weights[n] for n in group}, layout, extra_state=True)
        writer.add({**part.tensors, **part.objects})
    writer.finish({})
    whole = read_dcp_metadata(tmp_path / "whole" / "iter_0000001").state_dict_metadata
    streamed = read_dcp_metadata(tmp_path / "streamed" / "iter_0000001").state_dict_metadata
    assert whole.keys() == streamed.keys()
    qkv = whole["decoder.layers.self_attention.linear_qkv.weight"]
    assert (
        qkv.size[0] == config.num_layers
        and streamed["decoder.layers.self_attention.linear_qkv.weight"].size == qkv.size
    )
    assert "decoder.layers.mlp.linear_fc2._extra_state/shard_2_3" in whole
    for name in ("whole", "streamed"):
        read = load_full_state(tmp_path / name / "iter_0000001")
        assert list(read) == list(weights)  # our names, the model's order
        assert all(torch.equal(read[k], weights[k]) for k in weights)
    fresh = GPTModel(config)
    load_model_tensors(tmp_path / "streamed" / "iter_0000001", fresh.state_dict(), config)
    assert all(torch.equal(fresh.state_dict()[k], weights[k]) for k in weights)
