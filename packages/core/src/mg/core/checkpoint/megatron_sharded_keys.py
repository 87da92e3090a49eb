"""Megatron-Core's `sharded_state_dict` keys for our GPT parameter names.

Megatron's `torch_dist` checkpoints do not store one tensor per layer: every
transformer layer's tensor of one kind is a slice of one global tensor with a
leading layer axis (`decoder.layers.self_attention.linear_qkv.weight` of shape
[num_layers, 3h', h]), each pipeline stage writing the rows of its layers. The
local layer spec (ours) also stores its pre-attention and pre-MLP norms under
the Transformer Engine spec's names, where they are fused into the next linear
(`input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`), so
both specs read the same checkpoint. And the last pipeline stage's copy of a
tied output layer is stored under the embedding's key (Megatron marks it a
replica, so the first stage's copy is what is written).

`megatron_sharded_key` gives, for one of our global parameter names, the key,
the layer index along the prepended axis and the number of layers; the tensor
axes after it are the parameter's own, sharded over tensor parallelism as our
DTensors already say.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")

# Megatron's local spec (`get_gpt_layer_local_spec`): `sharded_state_dict_keys_map`.
_FUSED_NORMS = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
)


@dataclass(frozen=True)
class ShardedKey:
    """Where a parameter lives in a Megatron `torch_dist` checkpoint."""

    key: str
    layer: int | None = None  # index along the prepended layer axis; None: no layer axis
    num_layers: int | None = None  # that axis' global size

    @property
    def prepend_axis_num(self) -> int:
        return 0 if self.layer is None else 1


def megatron_sharded_key(name: str, num_layers: int, *, tied_output: bool = False) -> ShardedKey:
    """The sharded key of our global parameter `name` (layers numbered over the whole
    model). `tied_output`: the output layer shares the embedding's weight."""
    if tied_output and name == "output_layer.weight":
        return ShardedKey("embedding.word_embeddings.weight")
    match = _LAYER.match(name)
    if match is None:
        return ShardedKey(name)
    layer, rest = int(match.group(1)), match.group(2)
    for ours, theirs in _FUSED_NORMS:
        if rest.startswith(ours):
            rest = theirs + rest[len(ours) :]
            break
    return ShardedKey(f"decoder.layers.{rest}", layer, num_layers)
