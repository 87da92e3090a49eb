"""A model's tensors in a `torch_dist` checkpoint, laid out as Megatron-Core lays them out.

Megatron-Core keys its `torch_dist` tensors by `sharded_state_dict` key, not by
parameter name: every transformer layer's tensor of one kind is a slice of one
global tensor with a leading layer axis (`decoder.layers.mlp.linear_fc1.weight`
of shape [num_layers, 2F, h]), stored at the top level of the DCP index with no
`model.` prefix; each linear layer also has an `_extra_state` object per layer
(`decoder.layers.mlp.linear_fc1._extra_state/shard_<layer>_<num_layers>`). A
tensor-parallel rank's part of a tensor is a chunk of the global tensor at its
offsets, so a SwiGLU fc1 of rank r is two chunks, gate rows r and up rows r of
[gate; up] (Megatron's `apply_swiglu_sharded_factory`): our `_StridedShard`.

What DCP is given for one key is a `GlobalChunks` (`global_chunks`): a rank's
pieces of the global tensor with their offsets, views of the parameters, so a save
copies nothing and a load writes into the model. Transformer Engine's modules
also keep an `_extra_state` entry in their state dict (FP8 scaling state): it is
the value of their ShardedObject, as Megatron-Core stores it.

How a model is keyed is decided from its configuration (`megatron_sharded_keys.
key_layout`), not from its parameter names; a hybrid Mamba's mixer tensors that
Megatron-Core splits into named row blocks are cut into them (`_split_rows`) and read
back whole. mg's earlier `torch_dist` checkpoints stored one tensor per parameter under
`model.<name>`; nothing writes that layout now, `is_megatron_layout` tells the two apart
by the stored keys and the readers take both.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mg.core.checkpoint.global_chunks import (
    GlobalChunks,
    single_process_is_intended,
    tensor_pieces,
)
from mg.core.checkpoint.megatron_sharded_keys import (
    EXPERTS_KEY,
    FUSED_NORMS,
    MAMBA_SPLITS,
    KeyLayout,
    ShardedKey,
    megatron_aliases,
    megatron_sharded_key,
)
from mg.core.checkpoint.reader_guard import guard_dcp_load, read_dcp_metadata

LEGACY_MODEL_PREFIX = "model."  # mg's earlier layout: model.<parameter name>
EXTRA_STATE = "_extra_state"
# The modules of a layer that Megatron-Core gives an `_extra_state` object: the linear
# layers (both specs) and Transformer Engine's attention (written too, so that a TE-spec
# model finds it; a local-spec load leaves it unread).
_EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "self_attention.core_attention",
    "self_attention.linear_q_proj",  # multi-latent attention's linears
    "self_attention.linear_q_down_proj",
    "self_attention.linear_q_up_proj",
    "self_attention.linear_kv_down_proj",
    "self_attention.linear_kv_up_proj",
    "cross_attention.linear_q",
    "cross_attention.linear_kv",
    "cross_attention.linear_proj",
    "mixer.in_proj",
    "mixer.out_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
    "mlp.experts.experts.linear_fc1",
    "mlp.experts.experts.linear_fc2",
)
# The output layers outside the layers that have one (a BERT's, a T5's LM head's).
_HEAD_LINEARS = (
    "output_layer",
    "lm_head.output_layer",
    "language_model.output_layer",  # a LLaVA's, and its projector's linears
    "vision_projection.encoder.linear_fc1",
    "vision_projection.encoder.linear_fc2",
)
_LAYER_LINEAR = re.compile(
    r"^(?:language_model\.|vision_model\.)?(?:encoder|decoder)\.layers\.\d+\.(.+)\.weight\d*$"
)
# A layer key's fused-norm names (both specs store them so) -> the local spec's modules.
_UNFUSED_NORMS = tuple((theirs, ours) for ours, theirs in FUSED_NORMS)


def our_layer_name(rest: str) -> str:
    """A layer key's tail (after `decoder.layers.`) as our parameter name's tail."""
    for fused, ours in _UNFUSED_NORMS:
        if rest.startswith(fused):
            return ours + rest[len(fused) :]
    return rest


@dataclass
class ModelState:
    """A rank's model in Megatron-Core's layout: what DCP saves or fills, and the copies
    to make after a load (a tied output layer held beside the embedding it shares).

    `extra_states` maps the DCP key of each `_extra_state` object to the name of the
    state-dict entry it holds (Transformer Engine's modules keep their FP8 scaling
    state there): a save writes the entries' values, a load reads them back for the
    modules' `set_extra_state`."""

    tensors: dict[str, GlobalChunks]
    objects: dict[str, io.BytesIO] = field(default_factory=dict)
    copies: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    extra_states: dict[str, str] = field(default_factory=dict)

    def finish_load(self) -> None:
        with torch.no_grad():
            for target, source in self.copies:
                target.copy_(source)


def is_extra_state(name: str) -> bool:
    """Whether a state-dict entry is a module's `_extra_state` (an object, not a weight)."""
    return name.endswith(f".{EXTRA_STATE}")


def megatron_model_state(
    named: Mapping[str, Any], layout: KeyLayout, *, extra_state: bool = False
) -> ModelState:
    """`named` (our global parameter names → this rank's tensors or DTensors, views that a
    load writes into) keyed as Megatron-Core keys them in `layout` (`key_layout` of the
    model's config). Its `_extra_state` entries (a state dict's, under Transformer
    Engine) are objects, not tensors: their keys are in `ModelState.extra_states`.
    `extra_state` adds the layers' `_extra_state` objects for a save: the entries'
    values where `named` has them, None elsewhere (as the local spec's linears hold)."""
    pieces: dict[str, list[tuple[Tensor, tuple[int, ...]]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    copies: list[tuple[Tensor, Tensor]] = []
    extras = {name: value for name, value in named.items() if is_extra_state(name)}
    for name, value in named.items():
        if name in extras:
            continue
        sharded = megatron_sharded_key(name, layout)
        for key, shape, parts in _split_rows(sharded, tuple(value.shape), tensor_pieces(value)):
            if sharded.prepended:
                index = tuple(i for i, _ in sharded.prepended)
                shape = (*(size for _, size in sharded.prepended), *shape)
                lead = (1,) * len(index)
                parts = [(t.reshape(*lead, *t.shape), (*index, *o)) for t, o in parts]
            shapes.setdefault(key, shape)
            held = pieces.setdefault(key, [])
            for tensor, offset in parts:
                same = [t for t, o in held if tuple(o) == tuple(offset)]
                if same:  # a replica on this rank (tied output layer): filled from the first
                    copies.append((tensor, same[0]))
                else:
                    held.append((tensor, offset))
    for key, alias in megatron_aliases(list(pieces)).items():  # the same tensor, twice
        pieces[alias], shapes[alias] = pieces[key], shapes[key]
    state = ModelState({key: GlobalChunks(shapes[key], parts) for key, parts in pieces.items()})
    state.copies = copies
    for name in extras:
        module = name.removesuffix(f".{EXTRA_STATE}")
        state.extra_states[extra_state_key(module, layout)] = name
    if extra_state:
        weights = [name for name in named if name not in extras]
        state.objects = extra_state_objects(weights, layout)
        for key, name in state.extra_states.items():
            state.objects[key] = sharded_object(extras[name])
        for key, alias in megatron_aliases(list(state.objects)).items():
            state.objects[alias] = state.objects[key]
    return state


Pieces = list[tuple[Tensor, tuple[int, ...]]]


def _split_rows(
    sharded: ShardedKey, shape: tuple[int, ...], parts: Pieces
) -> list[tuple[str, tuple[int, ...], Pieces]]:
    """(key, global shape, pieces) of each tensor a parameter is stored as: itself, or
    the row blocks Megatron-Core stores apart (`sharded.splits`, a Mamba mixer's
    `in_proj.weight.z` …), each piece of ours cut where the blocks meet."""
    if not sharded.splits:
        return [(sharded.key, shape, parts)]
    out = []
    first = 0
    for suffix, rows in sharded.splits:
        cut = []
        for tensor, offset in parts:
            start = max(first, offset[0])
            stop = min(first + rows, offset[0] + tensor.shape[0])
            if start < stop:
                piece = tensor.narrow(0, start - offset[0], stop - start)
                cut.append((piece, (start - first, *offset[1:])))
        out.append((f"{sharded.key}.{suffix}", (rows, *shape[1:]), cut))
        first += rows
    if first != shape[0]:
        raise ValueError(f"{sharded.key}: row blocks of {first} rows, the tensor has {shape[0]}")
    return out


def sharded_object(data: Any) -> io.BytesIO:
    """A Megatron-Core ShardedObject's stored bytes: `torch.save([data])` (a load gives the
    list back). dist_format saves an `io.BytesIO` as it is."""
    buffer = io.BytesIO()
    torch.save([data], buffer)
    return buffer


def _object_shard(sharded: ShardedKey) -> str:
    """A ShardedObject's key suffix over the prepended axes: `<offsets>_<sizes>` (the
    layer's `3_24`, a routed expert's `3.5_24.8`, none: `0_1`)."""
    axes = sharded.prepended or ((0, 1),)
    return ".".join(str(i) for i, _ in axes) + "_" + ".".join(str(n) for _, n in axes)


def extra_state_key(module: str, layout: KeyLayout) -> str:
    """The DCP key of Megatron-Core's `_extra_state` ShardedObject of our module `module`
    (`decoder.layers.3.self_attention.linear_qkv`): `<key>._extra_state/shard_3_24`."""
    sharded = megatron_sharded_key(f"{module}.weight", layout)
    key = sharded.key.removesuffix(".weight")
    return f"{key}.{EXTRA_STATE}/shard_{_object_shard(sharded)}"


def extra_state_objects(names: Iterable[str], layout: KeyLayout) -> dict[str, io.BytesIO]:
    """Megatron-Core's `_extra_state` ShardedObjects of the layers in `names`, keyed by
    their DCP key (`<key>/shard_<offsets>_<sizes>` over the prepended axes: the layer's
    `shard_3_24`, a routed expert's `shard_3.5_24.8`, none: `shard_0_1`), each holding None."""
    out: dict[str, io.BytesIO] = {}
    for name in names:
        module = name.rpartition(".")[0]
        if module in _HEAD_LINEARS:  # one object, no layer axis
            out[f"{module}.{EXTRA_STATE}/shard_0_1"] = sharded_object(None)
            continue
        match = _LAYER_LINEAR.match(name)
        if not match:
            continue
        sharded = megatron_sharded_key(name, layout)
        module = sharded.key.removesuffix(".weight")
        modules = [module]
        if module.endswith("self_attention.linear_qkv"):
            modules.append(module.removesuffix("linear_qkv") + "core_attention")
        for m in modules:
            if m.endswith(_EXTRA_STATE_MODULES):
                out[f"{m}.{EXTRA_STATE}/shard_{_object_shard(sharded)}"] = sharded_object(None)
    return out


def is_megatron_layout(metadata: Metadata) -> bool:
    """False for mg's earlier layout (tensors under `model.<name>`), True otherwise."""
    return not any(k.startswith(LEGACY_MODEL_PREFIX) for k in metadata.state_dict_metadata)


@dataclass(frozen=True)
class StoredParameter:
    """Where one of our parameters is in a Megatron-layout checkpoint."""

    key: str
    layer: int | None  # index along the layer axis, None when the tensor has none
    shape: torch.Size  # the parameter's own shape (without the prepended axes)
    dtype: torch.dtype
    expert: int | None = None  # a routed expert's index along the expert axis
    # Row blocks stored apart (a Mamba mixer's `in_proj.weight.z` …): (their key, rows)
    # in order; `key` is then their common stem.
    parts: tuple[tuple[str, int], ...] = ()

    @property
    def index(self) -> tuple[int, ...]:
        """Its offsets along the prepended (layer, expert) axes."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def _is_model_tensor(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng_state")) and "/" not in key


_BLOCKS = ("encoder", "decoder")  # in the model's order
_BLOCK_LAYER = re.compile(r"^(encoder|decoder)\.layers\.(?:(\d+)\.)?(.+)$")
# a multi-token prediction depth's transformer layer: keyed by depth, no layer axis
_MTP_LAYER = re.compile(r"^(mtp\.layers\.\d+\.transformer_layer)\.(.+)$")


def _expert_name(layers: str, rest: str, expert: int, grouped: bool) -> str:
    """Our name of routed expert `expert`'s tensor (`layers`: its layer's name,
    `decoder.layers.3`; `rest`: Megatron's `mlp.experts.experts.` key tail), sequential
    (`local_experts.N.linear_fc1.weight`) or grouped (`weightN`)."""
    tail = rest[len(EXPERTS_KEY) :]  # linear_fc1.weight
    if grouped:
        return f"{layers}.mlp.experts.{tail}{expert}"
    return f"{layers}.mlp.experts.local_experts.{expert}.{tail}"


def stored_parameters(metadata: Metadata, grouped: bool = False) -> dict[str, StoredParameter]:
    """Our parameter names (whole model, layers numbered from 0) of a Megatron-layout
    checkpoint's model tensors, with where each lives; in the model's order (embeddings,
    the encoder's layers and its other tensors, the decoder's alike, then the heads).
    Layer-stacked keys and keys per numbered layer (a model whose layers differ) alike;
    routed experts (an expert axis after the layer's) under sequential names, or grouped
    GEMM's with `grouped`."""
    first: dict[str, StoredParameter] = {}
    last: dict[str, StoredParameter] = {}
    layers: dict[str, dict[int, dict[str, StoredParameter]]] = {b: {} for b in _BLOCKS}
    rest_of: dict[str, dict[str, StoredParameter]] = {b: {} for b in _BLOCKS}
    aliases = set(megatron_aliases(metadata.state_dict_metadata).values())  # stored twice
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or not _is_model_tensor(key):
            continue
        if key in aliases:
            continue
        dtype = meta.properties.dtype
        if mtp := _MTP_LAYER.match(key):  # a layer's norms and experts, after the heads
            prefix, rest = mtp.groups()
            if rest.startswith(EXPERTS_KEY):
                for expert in range(meta.size[0]):
                    ours = _expert_name(prefix, rest, expert, grouped)
                    size = torch.Size(meta.size[1:])
                    last[ours] = StoredParameter(key, None, size, dtype, expert)
            else:
                ours = f"{prefix}.{our_layer_name(rest)}"
                last[ours] = StoredParameter(key, None, torch.Size(meta.size), dtype)
            continue
        block = _BLOCK_LAYER.match(key)
        if block is None:
            where = StoredParameter(key, None, torch.Size(meta.size), dtype)
            head = key.partition(".")[0]
            if head in rest_of:  # the block's final norm
                rest_of[head][key] = where
            else:
                (first if key.startswith("embedding.") else last)[key] = where
            continue
        name, numbered, rest = block.groups()
        if numbered is not None:  # one layer's key: no layer axis
            spans = [(int(numbered), None)]
        else:
            spans = [(layer, layer) for layer in range(meta.size[0])]
        for layer, along in spans:
            own = meta.size[0 if along is None else 1 :]
            held = layers[name].setdefault(layer, {})
            prefix = f"{name}.layers.{layer}"
            if rest.startswith(EXPERTS_KEY):
                for expert in range(own[0]):
                    ours = _expert_name(prefix, rest, expert, grouped)
                    held[ours] = StoredParameter(key, along, torch.Size(own[1:]), dtype, expert)
                continue
            stem, _, block_name = rest.rpartition(".")
            if block_name in MAMBA_SPLITS.get(stem, ()):  # one row block of a split tensor
                ours = f"{prefix}.{stem}"
                blocks = held.get(ours)
                order = MAMBA_SPLITS[stem]  # the blocks in the tensor's row order
                parts = tuple(
                    sorted(
                        (*(blocks.parts if blocks else ()), (key, own[0])),
                        key=lambda part: order.index(part[0].rpartition(".")[2]),
                    )
                )
                rows = sum(n for _, n in parts)
                shape = torch.Size((rows, *own[1:]))
                held[ours] = StoredParameter(
                    key.removesuffix(f".{block_name}"), along, shape, dtype, parts=parts
                )
                continue
            held[f"{prefix}.{our_layer_name(rest)}"] = StoredParameter(
                key, along, torch.Size(own), dtype
            )
    out = dict(first)
    for name in _BLOCKS:
        for layer in sorted(layers[name]):
            out.update(layers[name][layer])
        out.update(rest_of[name])
    out.update(last)
    return out


def read_parameters(
    folder: str | Path, stored: Mapping[str, StoredParameter], names: Iterable[str]
) -> dict[str, Tensor]:
    """The whole tensors `names` of a Megatron-layout checkpoint, on one process without a
    process group: DCP reads only their byte ranges (one layer's slice of a stacked key)."""
    out: dict[str, Tensor] = {}
    pieces: dict[str, list[tuple[Tensor, tuple[int, ...]]]] = {}
    for name in names:
        where = stored[name]
        tensor = torch.empty(where.shape, dtype=where.dtype)
        out[name] = tensor
        index = where.index
        first = 0
        for key, rows in where.parts or ((where.key, where.shape[0] if where.shape else 0),):
            block = tensor.narrow(0, first, rows) if where.parts else tensor
            piece = block.reshape(*(1,) * len(index), *block.shape)
            pieces.setdefault(key, []).append((piece, (*index, *(0,) * tensor.dim())))
            first += rows
    if not pieces:
        return out
    metadata = read_dcp_metadata(folder).state_dict_metadata
    request = {key: GlobalChunks(metadata[key].size, parts) for key, parts in pieces.items()}
    with single_process_is_intended(), guard_dcp_load(Path(folder)):
        dcp.load(request, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return out


def checkpoint_is_megatron_layout(folder: str | Path) -> bool:
    """Whether the torch_dist iteration folder stores its model in Megatron-Core's layout."""
    return is_megatron_layout(read_dcp_metadata(folder))
