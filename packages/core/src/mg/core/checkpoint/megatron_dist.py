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

`GlobalChunks` is what DCP is given for one key: a rank's pieces of the global
tensor with their offsets (torch DCP's checkpointable-tensor protocol, as
Megatron-Core's `CheckpointableShardedTensor`). The pieces are views of the
parameters, so a save copies nothing and a load writes into the model.

mg's earlier `torch_dist` checkpoints stored one tensor per parameter under
`model.<name>`; `is_megatron_layout` tells the two apart and the readers take both.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from mg.core.checkpoint.megatron_sharded_keys import EXPERTS_KEY, megatron_sharded_key

LEGACY_MODEL_PREFIX = "model."  # mg's earlier layout: model.<parameter name>
EXTRA_STATE = "_extra_state"
# The modules of a layer that Megatron-Core gives an `_extra_state` object: the linear
# layers (both specs) and Transformer Engine's attention (written too, so that a TE-spec
# model finds it; a local-spec load leaves it unread).
_EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "self_attention.core_attention",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
    "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2",
    "mlp.experts.experts.linear_fc1",
    "mlp.experts.experts.linear_fc2",
)
# Our GPT parameter names that have a Megatron-Core key (dense GPT, local layer spec).
_SUPPORTED = re.compile(
    r"^(embedding\.(word|position)_embeddings\.weight"
    r"|output_layer\.weight"
    r"|decoder\.final_layernorm\.(weight|bias)"
    r"|decoder\.layers\.\d+\.(input_layernorm|pre_mlp_layernorm|self_attention\.q_layernorm"
    r"|self_attention\.k_layernorm|self_attention\.linear_qkv|self_attention\.linear_proj"
    r"|mlp\.linear_fc1|mlp\.linear_fc2)\.(weight|bias))$"
)
# An MoE layer's tensors (router, routed experts sequential or grouped, shared experts)
_SUPPORTED_MOE = re.compile(
    r"^decoder\.layers\.\d+\.mlp\.(router\.(weight|expert_bias)"
    r"|experts\.local_experts\.\d+\.linear_fc[12]\.(weight|bias)"
    r"|experts\.linear_fc[12]\.(weight|bias)\d+"
    r"|shared_experts\.(linear_fc[12]\.(weight|bias)|gate_weight))$"
)
_LAYER_LINEAR = re.compile(r"^decoder\.layers\.\d+\.(.+)\.weight\d*$")
# A layer key's fused-norm names (both specs store them so) -> the local spec's modules.
_UNFUSED_NORMS = (
    ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
)


def our_layer_name(rest: str) -> str:
    """A layer key's tail (after `decoder.layers.`) as our parameter name's tail."""
    for fused, ours in _UNFUSED_NORMS:
        if rest.startswith(fused):
            return ours + rest[len(fused) :]
    return rest


class GlobalChunks(Tensor):
    """One rank's pieces of a global tensor, each at its global offsets, for DCP.

    A wrapper tensor of the global shape holding no data of its own; DCP asks it for
    its chunks (`__create_chunk_list__`), write items and the tensor of one chunk
    (`__get_tensor_shard__`), which is the piece itself, so reads land in it."""

    @staticmethod
    def __new__(cls, global_shape: Iterable[int], pieces: list[tuple[Tensor, tuple[int, ...]]]):
        first = pieces[0][0]
        return Tensor._make_wrapper_subclass(
            cls, torch.Size(global_shape), dtype=first.dtype, device=first.device
        )

    def __init__(
        self, global_shape: Iterable[int], pieces: list[tuple[Tensor, tuple[int, ...]]]
    ) -> None:
        self.global_shape = torch.Size(global_shape)
        self.pieces = [(tensor, torch.Size(offset)) for tensor, offset in pieces]

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise NotImplementedError(f"GlobalChunks is a checkpoint index, not for {func}")

    def __repr__(self) -> str:  # the default would print data this wrapper does not have
        return f"GlobalChunks({tuple(self.global_shape)}, {len(self.pieces)} pieces)"

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=o, sizes=t.shape) for t, o in self.pieces]

    def __create_write_items__(self, fqn: str, obj: Any, index: int | None = None) -> list:
        return [
            WriteItem(
                index=MetadataIndex(fqn, offset, i),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=offset, sizes=tensor.shape),
                    properties=TensorProperties.create_from_tensor(tensor),
                    size=self.global_shape,
                ),
            )
            for i, (tensor, offset) in enumerate(self.pieces)
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        if index.index is not None and index.index < len(self.pieces):
            tensor, offset = self.pieces[index.index]
            if offset == index.offset:
                return tensor
        for tensor, offset in self.pieces:
            if offset == index.offset:
                return tensor
        raise ValueError(f"{index.fqn}: no piece at offsets {index.offset}")

    def host_copy(self) -> GlobalChunks:
        """The same pieces copied to host memory (what an async save writes from)."""
        return GlobalChunks(
            self.global_shape, [(t.detach().to("cpu", copy=True), o) for t, o in self.pieces]
        )


def tensor_pieces(value: Tensor) -> list[tuple[Tensor, tuple[int, ...]]]:
    """A tensor's pieces of its global tensor with their offsets: a plain tensor is whole;
    a DTensor gives its local shard (or a strided shard's chunks) at their offsets. Views
    over exactly their own bytes (`own_storage`), so DCP writes without cloning."""
    from torch.distributed.tensor import DTensor

    from mg.core.checkpoint.dist_format import dtensor_pieces, own_storage

    if isinstance(value, GlobalChunks):
        return list(value.pieces)
    if isinstance(value, DTensor):
        return dtensor_pieces(value)
    return [(own_storage(value), (0,) * value.dim())]


def as_global_chunks(value: Tensor) -> GlobalChunks:
    """Any tensor or DTensor as the `GlobalChunks` of its global tensor."""
    if isinstance(value, GlobalChunks):
        return value
    return GlobalChunks(value.shape, tensor_pieces(value))


def supports_megatron_layout(names: Iterable[str], moe: bool = False) -> bool:
    """Whether every name is a GPT parameter with a Megatron-Core key: a dense GPT's, and
    with `moe` an MoE GPT's too (mg-train keeps an MoE in mg's earlier per-parameter
    layout, as Mamba, BERT and T5; mg-convert writes it in Megatron-Core's)."""
    names = list(names)
    return bool(names) and all(
        _SUPPORTED.match(n) or (moe and _SUPPORTED_MOE.match(n)) for n in names
    )


@dataclass
class ModelState:
    """A rank's model in Megatron-Core's layout: what DCP saves or fills, and the copies
    to make after a load (a tied output layer held beside the embedding it shares)."""

    tensors: dict[str, GlobalChunks]
    objects: dict[str, io.BytesIO] = field(default_factory=dict)
    copies: list[tuple[Tensor, Tensor]] = field(default_factory=list)

    def finish_load(self) -> None:
        with torch.no_grad():
            for target, source in self.copies:
                target.copy_(source)


def megatron_model_state(
    named: Mapping[str, Tensor],
    num_layers: int,
    *,
    tied: bool,
    extra_state: bool = False,
    num_experts: int | None = None,
    layer_keys: bool = False,
) -> ModelState:
    """`named` (our global parameter names → this rank's tensors or DTensors, views that a
    load writes into) keyed as Megatron-Core keys them; `extra_state` adds the layers'
    `_extra_state` objects (None, as the local spec's linears hold) for a save. An MoE
    gives `num_experts` and `layer_keys` (`per_layer_keys` of its `moe_layer_freq`)."""
    pieces: dict[str, list[tuple[Tensor, tuple[int, ...]]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    copies: list[tuple[Tensor, Tensor]] = []
    for name, value in named.items():
        sharded = megatron_sharded_key(
            name, num_layers, tied_output=tied, num_experts=num_experts, layer_keys=layer_keys
        )
        shape = tuple(value.shape)
        parts = tensor_pieces(value)
        if sharded.prepended:
            index = tuple(i for i, _ in sharded.prepended)
            shape = (*(size for _, size in sharded.prepended), *shape)
            lead = (1,) * len(index)
            parts = [(t.reshape(*lead, *t.shape), (*index, *o)) for t, o in parts]
        shapes.setdefault(sharded.key, shape)
        held = pieces.setdefault(sharded.key, [])
        for tensor, offset in parts:
            same = [t for t, o in held if tuple(o) == tuple(offset)]
            if same:  # a replica on this rank (tied output layer): filled from the first
                copies.append((tensor, same[0]))
            else:
                held.append((tensor, offset))
    state = ModelState({key: GlobalChunks(shapes[key], parts) for key, parts in pieces.items()})
    state.copies = copies
    if extra_state:
        state.objects = extra_state_objects(named, num_layers, num_experts, layer_keys)
    return state


def sharded_object(data: Any) -> io.BytesIO:
    """A Megatron-Core ShardedObject's stored bytes: `torch.save([data])` (a load gives the
    list back). dist_format saves an `io.BytesIO` as it is."""
    buffer = io.BytesIO()
    torch.save([data], buffer)
    return buffer


def extra_state_objects(
    names: Iterable[str],
    num_layers: int,
    num_experts: int | None = None,
    layer_keys: bool = False,
) -> dict[str, io.BytesIO]:
    """Megatron-Core's `_extra_state` ShardedObjects of the layers in `names`, keyed by
    their DCP key (`<key>/shard_<offsets>_<sizes>` over the prepended axes: the layer's
    `shard_3_24`, a routed expert's `shard_3.5_24.8`, none: `shard_0_1`), each holding None."""
    out: dict[str, io.BytesIO] = {}
    for name in names:
        match = _LAYER_LINEAR.match(name)
        if not match:
            continue
        sharded = megatron_sharded_key(
            name, num_layers, num_experts=num_experts, layer_keys=layer_keys
        )
        module = sharded.key.removesuffix(".weight")
        modules = [module]
        if module.endswith("self_attention.linear_qkv"):
            modules.append(module.removesuffix("linear_qkv") + "core_attention")
        axes = sharded.prepended or ((0, 1),)
        shard = ".".join(str(i) for i, _ in axes) + "_" + ".".join(str(n) for _, n in axes)
        for m in modules:
            if m.endswith(_EXTRA_STATE_MODULES):
                out[f"{m}.{EXTRA_STATE}/shard_{shard}"] = sharded_object(None)
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

    @property
    def index(self) -> tuple[int, ...]:
        """Its offsets along the prepended (layer, expert) axes."""
        return tuple(i for i in (self.layer, self.expert) if i is not None)


def _is_model_tensor(key: str) -> bool:
    return not key.startswith(("optimizer.", "rng_state")) and "/" not in key


_NUMBERED_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _expert_name(layer: int, rest: str, expert: int, grouped: bool) -> str:
    """Our name of routed expert `expert`'s tensor (`rest`: Megatron's `mlp.experts.experts.`
    key tail), sequential (`local_experts.N.linear_fc1.weight`) or grouped (`weightN`)."""
    tail = rest[len(EXPERTS_KEY) :]  # linear_fc1.weight
    if grouped:
        return f"decoder.layers.{layer}.mlp.experts.{tail}{expert}"
    return f"decoder.layers.{layer}.mlp.experts.local_experts.{expert}.{tail}"


def stored_parameters(metadata: Metadata, grouped: bool = False) -> dict[str, StoredParameter]:
    """Our parameter names (whole model, layers numbered from 0) of a Megatron-layout
    checkpoint's model tensors, with where each lives; in the model's order (embeddings,
    layer by layer, then the final norm and output layer). Layer-stacked keys and keys
    per numbered layer (a model whose layers differ) alike; routed experts (an expert
    axis after the layer's) under sequential names, or grouped GEMM's with `grouped`."""
    first: dict[str, StoredParameter] = {}
    last: dict[str, StoredParameter] = {}
    layers: dict[int, dict[str, StoredParameter]] = {}
    for key, meta in metadata.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata) or not _is_model_tensor(key):
            continue
        dtype = meta.properties.dtype
        if key.startswith("decoder.layers."):
            numbered = _NUMBERED_LAYER.match(key)
            if numbered:  # one layer's key: no layer axis
                spans, rest = [(int(numbered[1]), None)], numbered[2]
            else:
                rest = key[len("decoder.layers.") :]
                spans = [(layer, layer) for layer in range(meta.size[0])]
            for layer, along in spans:
                own = meta.size[0 if along is None else 1 :]
                if rest.startswith(EXPERTS_KEY):
                    for expert in range(own[0]):
                        name = _expert_name(layer, rest, expert, grouped)
                        where = StoredParameter(key, along, torch.Size(own[1:]), dtype, expert)
                        layers.setdefault(layer, {})[name] = where
                    continue
                name = f"decoder.layers.{layer}.{our_layer_name(rest)}"
                where = StoredParameter(key, along, torch.Size(own), dtype)
                layers.setdefault(layer, {})[name] = where
        else:
            where = StoredParameter(key, None, torch.Size(meta.size), dtype)
            (first if key.startswith("embedding.") else last)[key] = where
    out = dict(first)
    for layer in sorted(layers):
        out.update(layers[layer])
    out.update(last)
    return out


def read_parameters(
    folder: str | Path, stored: Mapping[str, StoredParameter], names: Iterable[str]
) -> dict[str, Tensor]:
    """The whole tensors `names` of a Megatron-layout checkpoint, on one process without a
    process group: DCP reads only their byte ranges (one layer's slice of a stacked key)."""
    import torch.distributed.checkpoint as dcp

    from mg.core.checkpoint.dist_format import single_process_is_intended
    from mg.core.checkpoint.reader_guard import guard_dcp_load, read_dcp_metadata

    out: dict[str, Tensor] = {}
    pieces: dict[str, list[tuple[Tensor, tuple[int, ...]]]] = {}
    for name in names:
        where = stored[name]
        tensor = torch.empty(where.shape, dtype=where.dtype)
        out[name] = tensor
        index = where.index
        piece = tensor.reshape(*(1,) * len(index), *tensor.shape)
        pieces.setdefault(where.key, []).append((piece, (*index, *(0,) * tensor.dim())))
    if not pieces:
        return out
    metadata = read_dcp_metadata(folder).state_dict_metadata
    request = {key: GlobalChunks(metadata[key].size, parts) for key, parts in pieces.items()}
    with single_process_is_intended(), guard_dcp_load(Path(folder)):
        dcp.load(request, storage_reader=dcp.FileSystemReader(folder), no_dist=True)
    return out


def checkpoint_is_megatron_layout(folder: str | Path) -> bool:
    """Whether the torch_dist iteration folder stores its model in Megatron-Core's layout."""
    from mg.core.checkpoint.reader_guard import read_dcp_metadata

    return is_megatron_layout(read_dcp_metadata(folder))


def load_model_tensors(
    folder: str | Path,
    named: Mapping[str, Tensor],
    num_layers: int,
    *,
    tied: bool,
    process_group: Any = None,
) -> dict[str, Any]:
    """Fill `named` (our global names → this rank's tensors or DTensors) from a torch_dist
    checkpoint of either layout, collectively; returns common.pt."""
    from mg.core.checkpoint.dist_format import load_dist_checkpoint

    if not checkpoint_is_megatron_layout(folder):
        return load_dist_checkpoint(folder, {"model": dict(named)}, process_group=process_group)
    state = megatron_model_state(named, num_layers, tied=tied)
    common = load_dist_checkpoint(folder, dict(state.tensors), process_group=process_group)
    state.finish_load()
    return common
