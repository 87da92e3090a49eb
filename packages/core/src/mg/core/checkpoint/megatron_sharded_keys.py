"""Megatron-Core's `sharded_state_dict` keys for our parameter names (GPT, BERT, T5, Mamba,
LLaVA).

Megatron's `torch_dist` checkpoints do not store one tensor per layer: every
transformer layer's tensor of one kind is a slice of one global tensor with a
leading layer axis (`decoder.layers.self_attention.linear_qkv.weight` of shape
[num_layers, 3h', h]; a BERT's and a T5's `encoder.layers.…` alike, each block on
its own axis), each pipeline stage writing the rows of its layers. The
local layer spec (ours) also stores its pre-attention and pre-MLP norms under
the Transformer Engine spec's names, where they are fused into the next linear
(`input_layernorm.weight` -> `self_attention.linear_qkv.layer_norm_weight`), so
both specs read the same checkpoint. And the last pipeline stage's copy of a
tied output layer is stored under the embedding's key (Megatron marks it a
replica, so the first stage's copy is what is written).

A hybrid Mamba model (Megatron-Core's `MambaStack`) keys each layer by its number,
its layers differing, and its mixer splits two fused tensors into named row blocks
(`mixer.in_proj.weight.z` … `.dt`, `mixer.conv1d.weight.x`/`.B`/`.C`), each
tensor-parallel rank holding its slice of every block.

What the keys depend on comes from the model's configuration (`key_layout`), and
`megatron_sharded_key` gives, for one of our global parameter names, the key, the
layer index along the prepended axis and the number of layers, and the row blocks
it is split into; the tensor axes after it are the parameter's own, sharded over
tensor parallelism as our DTensors already say.

A LLaVA model (Megatron-Core's `LLaVAModel`) keys each tower under its attribute:
`language_model.` as a GPT (`language_model.decoder.layers.…` on the language model's
layer axis), `vision_model.` with the ViT's layers on an axis of their own
(`vision_model.decoder.layers.self_attention.linear_qkv.weight` of [vision layers, …];
`conv1`, `class_token`, `position_embeddings`, `ln_pre`/`ln_post` as named), the
projector `vision_projection.encoder.linear_fc1/2.*` as named. The layers' norms take
the Transformer Engine spec's fused names in both towers (the spec `pretrain_vlm.py`
builds by default; megatron-core's local LLaVA specs have no keys map and keep
`input_layernorm.*`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

from mg.core.models.config import TransformerConfig
from mg.core.models.mamba.config import MambaConfig
from mg.core.models.retro import RetroConfig
from mg.core.models.vision.llava import LLaVAConfig

_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(\d+)\.(.+)$")
# a multi-token prediction depth's transformer layer: keyed by its depth, no layer axis
# (Megatron-Core's MultiTokenPredictionBlock.sharded_state_dict), norms as a layer's
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.+)$")

# Megatron's local spec (`get_gpt_layer_local_spec`): `sharded_state_dict_keys_map`; a
# Mamba layer's norm is fused into its mixer's in_proj as Megatron-LM's TE spec has it.
FUSED_NORMS = (
    ("input_layernorm.", "self_attention.linear_qkv.layer_norm_"),
    ("pre_mlp_layernorm.", "mlp.linear_fc1.layer_norm_"),
    ("norm.", "mixer.in_proj.layer_norm_"),
)
# Megatron-Core's MambaMixer.sharded_state_dict: the fused tensors it splits, row blocks
# in order (their sizes: `key_layout`).
MAMBA_SPLITS = {
    "mixer.in_proj.weight": ("z", "x", "B", "C", "dt"),
    "mixer.conv1d.weight": ("x", "B", "C"),
    "mixer.conv1d.bias": ("x", "B", "C"),
}


# A routed expert's tensor, sequential (`local_experts.N.linear_fc1.weight`) or grouped
# GEMM (`linear_fc1.weightN`): Megatron-Core keys both alike (SequentialMLP's and
# TEGroupedMLP's sharded_state_dict are interchangeable).
_ROUTED_EXPERT = re.compile(
    r"^mlp\.experts\.(?:local_experts\.(?P<seq>\d+)\.(?P<fc>linear_fc[12])\.(?P<kind>weight|bias)"
    r"|(?P<gfc>linear_fc[12])\.(?P<gkind>weight|bias)(?P<num>\d+))$"
)
EXPERTS_KEY = "mlp.experts.experts."  # Megatron-Core's key of the routed experts' linears


@dataclass(frozen=True)
class ShardedKey:
    """Where a parameter lives in a Megatron `torch_dist` checkpoint."""

    key: str
    layer: int | None = None  # index along the prepended layer axis; None: no layer axis
    num_layers: int | None = None  # that axis' global size
    expert: int | None = None  # a routed expert's index along the expert axis (after it)
    num_experts: int | None = None
    splits: tuple[tuple[str, int], ...] = ()  # row blocks stored apart: (key suffix, rows)

    @property
    def prepended(self) -> tuple[tuple[int, int], ...]:
        """(index, global size) of each axis put before the parameter's own."""
        out = () if self.layer is None else ((self.layer, self.num_layers or 0),)
        if self.expert is not None:
            out += ((self.expert, self.num_experts or 0),)
        return out

    @property
    def prepend_axis_num(self) -> int:
        return len(self.prepended)


# megatron-core's T5Model also holds its LM head's output layer and its position table as
# attributes of its own (`self.output_layer = self.lm_head.output_layer`,
# `self.position_embeddings`), so its sharded_state_dict stores each under both names.
_T5_ALIASES = (
    ("lm_head.output_layer.", "output_layer."),
    ("embedding.position_embeddings.", "position_embeddings."),
)


def megatron_aliases(keys: Iterable[str]) -> dict[str, str]:
    """The second key Megatron-Core stores some of `keys` (its sharded keys) under: a T5's
    (a model with an `lm_head.output_layer`) output layer and position table."""
    keys = list(keys)
    if not any(k.startswith("lm_head.output_layer.") for k in keys):
        return {}
    return {
        key: alias + key[len(prefix) :]
        for key in keys
        for prefix, alias in _T5_ALIASES
        if key.startswith(prefix)
    }


@dataclass(frozen=True)
class KeyLayout:
    """What a model's Megatron-Core keys depend on, from its configuration (`key_layout`).

    `num_layers`: each block's layer axis; `tied_output`: the output layer shares the
    embedding's weight; `num_experts`: the routed experts' axis; `layer_keys`: layers
    keyed by number, with no layer axis; `row_splits`: a layer tensor's tail → its row
    blocks (key suffix, rows), stored as separate tensors."""

    num_layers: int
    tied_output: bool = False
    num_experts: int | None = None
    layer_keys: bool = False
    row_splits: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()
    fused_norm_names: bool = True
    """The layer norms under the TE spec's fused names (`FUSED_NORMS`); False for
    multi-latent attention, whose local spec has no keys map (its norms keep their names)."""
    towers: tuple[tuple[str, KeyLayout], ...] = ()
    """A model of several towers (a LLaVA's `language_model.`, `vision_model.`): each
    prefix's names keyed by its own layout under that prefix; other names as they are."""


def key_layout(config: TransformerConfig) -> KeyLayout:
    """The key layout of a model with `config`: a GPT's, BERT's or T5's layers stacked
    (by number where an MoE's layers differ: `per_layer_keys`), a hybrid Mamba's by
    number with its mixer's fused tensors split (`MAMBA_SPLITS`)."""
    if isinstance(config, LLaVAConfig):  # each tower its own layer axis, under its prefix
        vision = KeyLayout(config.vision.num_layers)
        towers = (("language_model.", key_layout(config.language)), ("vision_model.", vision))
        return KeyLayout(config.language.num_layers, towers=towers)
    tied = not config.untie_embeddings_and_output_weights
    experts = config.num_moe_experts or None
    if isinstance(config, RetroConfig):  # RetroModel's layers differ: keyed by number
        return KeyLayout(config.num_layers, tied, None, True)
    if not isinstance(config, MambaConfig):
        moe_layers = per_layer_keys(config.moe_layer_freq) if experts else False
        fused = not getattr(config, "multi_latent_attention", False)
        return KeyLayout(config.num_layers, tied, experts, moe_layers, fused_norm_names=fused)
    inner = config.mamba_d_inner
    groups = config.mamba_num_groups * config.mamba_state_dim
    rows = {"z": inner, "x": inner, "B": groups, "C": groups, "dt": config.mamba_num_heads}
    splits = tuple(
        (tail, tuple((suffix, rows[suffix]) for suffix in suffixes))
        for tail, suffixes in MAMBA_SPLITS.items()
    )
    return KeyLayout(config.num_layers, tied, experts, True, splits)


# Retro's neighbour encoder, inside its first Retro decoder layer: its layers' norms
# have the local spec's fused names too, but for its first layer's per-neighbour norm
# (`pre_mlp_layernorm.norm`, no entry in its keys map)
_RETRO_ENCODER_LAYER = re.compile(r"^(cross_attention\.encoder\.layers\.\d+\.)(.+)$")


def _retro_encoder_norms(rest: str) -> str:
    """A Retro encoder layer's norm under the fused name Megatron-Core keys it by."""
    match = _RETRO_ENCODER_LAYER.match(rest)
    if match is None or match.group(2).startswith("pre_mlp_layernorm.norm."):
        return rest
    for ours, theirs in FUSED_NORMS[:2]:
        if match.group(2).startswith(ours):
            return match.group(1) + theirs + match.group(2)[len(ours) :]
    return rest


def per_layer_keys(moe_layer_freq: int | list[int] | None) -> bool:
    """Megatron-Core's `non_homogeneous_layers`: a model whose layers differ (MoE every
    N-th layer, N > 1, or a per-layer list) keys each layer's tensors by its number
    (`decoder.layers.3.mlp.router.weight`) instead of stacking them on a layer axis."""
    if isinstance(moe_layer_freq, list):
        return True
    return isinstance(moe_layer_freq, int) and moe_layer_freq > 1


def megatron_sharded_key(name: str, layout: KeyLayout) -> ShardedKey:
    """The sharded key of our global parameter `name` (layers numbered over the whole
    model; an encoder's and a decoder's each over its own axis) in `layout`. A routed
    expert's tensor gets an expert axis after the layer axis (SequentialMLP's
    `decoder.layers.mlp.experts.experts.linear_fc1.weight` of [L, E, 2F, h]); a tensor
    of `layout.row_splits` its row blocks."""
    for prefix, tower in layout.towers:
        if name.startswith(prefix):
            sharded = megatron_sharded_key(name[len(prefix) :], tower)
            return dataclasses.replace(sharded, key=prefix + sharded.key)
    if layout.towers:  # between the towers (a LLaVA's projector): its name
        return ShardedKey(name)
    if layout.tied_output and name == "output_layer.weight":
        return ShardedKey("embedding.word_embeddings.weight")
    match = _LAYER.match(name)
    mtp = _MTP_LAYER.match(name) if match is None else None
    if match is None and mtp is None:
        return ShardedKey(name)
    if mtp is not None:
        block, layer, rest = mtp.group(1), None, mtp.group(2)
    else:
        block, layer, rest = match.group(1), int(match.group(2)), match.group(3)
    for ours, theirs in FUSED_NORMS if layout.fused_norm_names else ():
        if rest.startswith(ours):
            rest = theirs + rest[len(ours) :]
            break
    rest = _retro_encoder_norms(rest)
    splits = dict(layout.row_splits).get(rest, ())
    expert = None
    if routed := _ROUTED_EXPERT.match(rest):
        if layout.num_experts is None:
            raise ValueError(f"{name}: a routed expert's key needs the number of experts")
        if routed["seq"] is not None:
            expert, rest = int(routed["seq"]), f"{EXPERTS_KEY}{routed['fc']}.{routed['kind']}"
        else:
            expert, rest = int(routed["num"]), f"{EXPERTS_KEY}{routed['gfc']}.{routed['gkind']}"
    experts = layout.num_experts if expert is not None else None
    if layer is None:
        return ShardedKey(f"{block}.{rest}", None, None, expert, experts, splits)
    if layout.layer_keys:
        return ShardedKey(f"{block}.layers.{layer}.{rest}", None, None, expert, experts, splits)
    return ShardedKey(f"{block}.layers.{rest}", layer, layout.num_layers, expert, experts, splits)
