"""Fully sharded data parallelism on PyTorch's FSDP2 (`fully_shard`, DTensor parameters).

Megatron's `--use-megatron-fsdp` and `--use-torch-fsdp2` both land here: one
implementation, PyTorch's own, not a hand-written sharder. `apply_fully_shard`
makes one FSDP unit of each transformer layer (the children of every `layers`
list: GPT, BERT and T5 stacks, Mamba hybrids, MoE layers), with a large layer's
attention and MLP linear layers units inside it (`sublayer_units`), one of the embedding
(and one of its learned positions, if any), one of the output layer, and the root
unit (the final norm, what is left).

FSDP gathers a unit around its module's calls only, and the output head reads
its weight as a tensor (`output_weight()`). So the head's use of the weight is
made a call of the module that owns it (`output_unit`): the untied output layer's
own forward (`OutputModuleHead`), or, tied, the embedding's `tied_logits`
registered as an FSDP forward method (`FullyShardedTiedHead`); the same numbers
as the plain head. The output weight is then whole only around the head (and,
tied, the lookup), not from the first forward to the end of the last backward as
in the root unit (at vocab × hidden, the largest tensors of a small model); the
untied output layer's gradient is reduce-scattered as soon as the head's backward
ends, a tied one when the embedding's backward has added its part, in the one
tensor the head's part waited in (`TiedGradient`: not the three whole-size
tensors autograd's sum of a leaf's two gradients holds). Another head (fused
cross-entropy, vocab-parallel, a bias) keeps the output weight in the root unit,
gathered for the whole step.

Under a sharded strategy on a 1-D mesh, a tied embedding without MTP or tensor
parallelism is no unit at all: its weight stays a DTensor sharded by vocabulary rows
that FSDP leaves alone (`ignored_params`), and its lookup and the head's logits
exchange tokens over the data-parallel group instead of gathering the weight
(`vocab_shards`, `shard_vocabulary`); what follows is for the other cases.

The embedding's backward needs no weight (it only scatters the gradient rows),
so it does not gather the embedding again (`set_unshard_in_backward(False)`);
tied, the head's forward keeps the weight gathered for its own backward, which
follows at once, and that backward's end frees it (not with MTP, whose heads'
backwards are apart: there each gathers the weight).

Megatron's `--data-parallel-sharding-strategy` in FSDP2's terms:

| strategy | FSDP2 | between forward and backward |
| --- | --- | --- |
| `no_shard` | a (replicate = DP, shard = 1) mesh | all of it, always (DDP) |
| `optim` | as `optim_grads` (see below) | a unit gathered once, kept |
| `optim_grads` | `reshard_after_forward=False` | a unit gathered once, kept |
| `optim_grads_params` | `reshard_after_forward=True` (ZeRO-3) | re-gathered for backward |

FSDP2 cannot keep whole gradients beside a sharded optimizer state, so `optim`
runs as `optim_grads`: its gradients are sharded too (less memory, the same numbers).

Between steps every sharded strategy keeps 1/DP of the parameters; `optim` and
`optim_grads` differ from ZeRO-3 in holding each unit gathered from its forward
to its backward. The numbers are the same at every strategy. With
`replicas` > 1 (`--num-distributed-optimizer-instances`) the data-parallel ranks
form a (replicate, shard) mesh: sharded within groups of DP / replicas ranks,
replicated across them (HSDP). Data parallelism spans data × context ranks, as
Megatron's gradient reduction does; with tensor parallelism the parameters are
already DTensors on the tensor-parallel mesh, and FSDP shards them over the
data × context dim of the same root mesh (2-D).

Mixed precision is FSDP2's `MixedPrecisionPolicy`: the sharded parameters stay
fp32 (the main copy the optimizer steps), units are gathered and computed in
`param_dtype` (bf16 under --bf16), and gradients are reduce-scattered (and
summed over micro-batches without sync) in `reduce_dtype`.

This is a construction step (`mg.core.parallel.construct`), the last one, and
not a wrapper in the trainer as DDP is: `fully_shard` replaces every parameter
by a DTensor shard, so the optimizer must be built after it, over those; and it
must see the modules every other step left (Transformer Engine's, recompute's
wrappers, compiled layers), as torchtitan's `apply_fsdp` follows TP, activation
checkpointing and compile.

On gloo (CPU) every unit all-gathers and reduce-scatters in place
(`fully_sharded_gloo`): gloo's own collectives copy a unit's worth beside FSDP2's
buffers, and a one-parameter unit gathers into its parameter's storage.

Gradient accumulation: under `optim_grads` and `optim_grads_params` each
micro-batch's gradients are reduce-scattered into the shards
(`FullyShardedOptimizer.reduce_every_micro_batch`); under `no_shard` and `optim`,
`no_gradient_sync` around every micro-batch's backward but the last, and each unit's
gradients are reduced once, as its last backward ends.

Expert parallelism: a rank's routed experts (`is_expert_parameter`) differ across
its expert-parallel group, so each MoE layer's experts are a unit of their own,
sharded over the expert data-parallel ranks (`expert_mesh`), inside the layer's
unit; FSDP averages their gradients there, and the optimizer rescales them to the
sum over data × context ranks that the dense ones get (Megatron's expert gradient
scaling; FSDP2's own divide factor needs NCCL's PreMulSum, which gloo lacks). The
norm adds the experts' squares over the expert-parallel group (`clip_grad_norm`'s
`expert_group`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import (
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from torch.distributed.tensor import DTensor, Shard

from mg.core.models.language_model import LanguageModelEmbedding
from mg.core.models.output_head import OutputHead, OutputModuleHead, is_plain_output
from mg.core.models.tied_gradient import TiedGradient
from mg.core.parallel.collective_device import collective_device
from mg.core.parallel.expert_parallel import is_expert_parameter
from mg.core.parallel.fully_sharded_gloo import use_in_place_collectives
from mg.core.parallel.grad_norm import global_sum, squares_in_dtype
from mg.core.parallel.vocab_shards import VocabShards

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class FullyShardedOptions:
    """What `apply_fully_shard` needs: the strategy (Megatron's name), the number of
    replicas (HSDP), the dtypes, and whether to prefetch the next unit's all-gather."""

    strategy: str = "optim_grads_params"
    replicas: int = 1
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    prefetch: bool = False
    split_layer_bytes: int = 64 * 2**20
    """Layers whose parameters take more than this get their linear layers as units inside
    the layer's (`sublayer_units`): at 113 MB a layer (757M GPT, fp32) that cut a rank's
    peak from 4.56 to 4.45 GB; at 28 MB (124M GPT) five times as many units cost 6% of
    the tokens/s on gloo (0.79x against 0.84x of the distributed optimizer)."""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown sharding strategy {self.strategy!r}; one of {STRATEGIES}")


def data_parallel_mesh(root: DeviceMesh, options: FullyShardedOptions) -> DeviceMesh:
    """The mesh FSDP shards over: `root`'s flattened data × context dim ("dp_cp"), 1-D, or
    (replicate, shard) for `no_shard` (shard size 1) and for HSDP (`replicas` > 1)."""
    mesh = root["dp_cp"]
    size = mesh.size()
    replicas = size if options.strategy == "no_shard" else options.replicas
    if replicas == 1:
        return mesh
    if size % replicas:
        raise ValueError(f"{replicas} replicas do not divide {size} data-parallel ranks")
    return mesh._unflatten(0, (replicas, size // replicas), ("dp_replicate", "dp_shard"))


def output_unit(model: nn.Module) -> nn.Module | None:
    """The module that owns the output weight, where the plain head (no bias) can use it
    through a call of that module: the untied output layer (an nn.Linear) or the tied
    embedding. None: the head reads the weight otherwise, which stays in the root unit."""
    if not (hasattr(model, "output_head") and hasattr(model, "output_weight")):
        return None
    if not is_plain_output(model) or model.output_bias() is not None:
        return None
    weight = model.output_weight()
    layer = getattr(model, "output_layer", None)
    if type(layer) is nn.Linear and layer.bias is None and layer.weight is weight:
        return layer
    embedding = getattr(model, "embedding", None)
    if isinstance(embedding, LanguageModelEmbedding) and embedding.word_embeddings.weight is weight:
        return embedding
    return None


def units(model: nn.Module) -> list[nn.Module]:
    """The modules that become FSDP units below the root, in forward order: the embedding
    (unless the head reads its weight as a tensor), every layer of every `layers` list,
    and the untied output layer where the head calls it (`output_unit`)."""
    found: list[nn.Module] = []
    output = output_unit(model)
    embedding = getattr(model, "embedding", None)
    if embedding is not None and (embedding is output or not _holds_output_weight(model)):
        found.append(embedding)
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] == "layers" and isinstance(module, nn.ModuleList):
            found.extend(module)
    if output is not None and output is not embedding:
        found.append(output)
    return found


SUBLAYERS = ("self_attention", "cross_attention", "mlp")


def sublayer_units(
    layers: Sequence[nn.Module], min_bytes: int = 0
) -> dict[nn.Module, list[nn.Module]]:
    """The units inside each layer's unit, in forward order: the linear layers of its
    attention and MLP (each sublayer's children that hold parameters: qkv and proj, fc1
    and fc2), or a sublayer whole where it holds parameters of its own. FSDP holds a
    unit's weights and gradients at once (and, gathering, its all-gather buffer beside
    its parameters; reducing, its gradients beside the reduce-scatter's input), and a
    layer's unit is gathered from the start of its backward: with these a dense layer's
    backward holds one linear layer's weight twice (fc1's: a third of the layer) and its
    own unit only the norms, not the whole layer twice. A sublayer that holds another
    unit (expert-parallel experts, a Retro encoder's layers) is left in the layer's; so
    is every layer of at most `min_bytes` of parameters."""
    inner = set(layers)
    found: dict[nn.Module, list[nn.Module]] = {}
    for layer in layers:
        if sum(p.numel() * p.element_size() for p in layer.parameters()) <= min_bytes:
            continue
        parts: list[nn.Module] = []
        for name in SUBLAYERS:
            sublayer = getattr(layer, name, None)
            if not isinstance(sublayer, nn.Module) or not _holds_parameters(sublayer):
                continue
            if any(isinstance(m, FSDPModule) or m in inner for m in sublayer.modules()):
                continue
            children = [c for c in sublayer.children() if _holds_parameters(c)]
            own = _holds_parameters(sublayer, recurse=False)
            parts.extend([sublayer] if own or not children else children)
        if parts:
            found[layer] = parts
    return found


def _holds_parameters(module: nn.Module, recurse: bool = True) -> bool:
    return any(True for _ in module.parameters(recurse=recurse))


def shard_vocabulary(
    model: nn.Module, mesh: DeviceMesh, options: FullyShardedOptions
) -> VocabShards | None:
    """Make the tied embedding's weight a DTensor sharded by rows over `mesh` that FSDP
    leaves alone, and its lookup and logits exchange tokens instead (`vocab_shards`), where
    the tied weight is used once by each per forward (no MTP), `mesh` is 1-D (no HSDP, no
    `no_shard`) and the weight is a plain tensor (no tensor parallelism). None elsewhere."""
    embedding = getattr(model, "embedding", None)
    if not isinstance(embedding, LanguageModelEmbedding) or getattr(model, "mtp", None):
        return None
    weight = embedding.word_embeddings.weight
    if mesh.ndim != 1 or options.strategy == "no_shard" or isinstance(weight, DTensor):
        return None
    group = mesh.get_group()
    rank, size = group.rank(), group.size()
    chunks = torch.chunk(weight.detach(), size, dim=0)
    local = chunks[rank].clone() if rank < len(chunks) else weight.new_empty(0, weight.shape[1])
    sharded = DTensor.from_local(
        local, mesh, [Shard(0)], run_check=False, shape=weight.shape, stride=weight.stride()
    )
    embedding.word_embeddings.weight = nn.Parameter(sharded, requires_grad=weight.requires_grad)
    embedding.word_embeddings.weight.__dict__.update(weight.__dict__)  # marks set on it
    embedding.vocab_shards = VocabShards(group, weight.shape[0], options.param_dtype)
    return embedding.vocab_shards


def position_unit(model: nn.Module) -> nn.Module | None:
    """A GPT-2 embedding's learned positions, made a unit of their own (inside the
    embedding's) so that the embedding's unit holds its one vocab × hidden weight, which
    gloo then gathers straight into the weight's storage (`fully_sharded_gloo`)."""
    embedding = getattr(model, "embedding", None)
    positions = getattr(embedding, "position_embeddings", None)
    if not isinstance(positions, nn.Embedding):
        return None
    return positions


def _holds_output_weight(model: nn.Module) -> bool:
    """Whether the embedding holds the weight the output head reads (tied)."""
    if not hasattr(model, "output_weight"):  # no head of its own: untied by construction
        return getattr(model, "output_layer", None) is None
    weight = model.output_weight()
    return any(p is weight for p in model.embedding.parameters())


class FullyShardedTiedHead(OutputHead):
    """The plain head's numbers, its logits from the tied embedding's `tied_logits` (an
    FSDP forward method). With `keep` (ZeRO-3, one head call per forward: no MTP) the
    weight stays gathered from the head's forward to its backward, which follows at once,
    and the embedding's backward, which needs no weight, does not gather it again."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep

    def logits_from(self, model: nn.Module, hidden: Tensor) -> Tensor:
        embedding = model.embedding
        if not (self.keep and torch.is_grad_enabled()):
            return embedding.tied_logits(hidden)
        embedding.set_reshard_after_forward(False, recurse=False)
        try:
            return embedding.tied_logits(hidden)
        finally:  # the lookup at the start of the next forward reshards after it again
            embedding.set_reshard_after_forward(True, recurse=False)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(keep={self.keep})"


def _route_head_through(model: nn.Module, output: nn.Module, reshard: bool) -> bool:
    """Make the head's use of the output weight a call of `output` (see the docstring);
    True where the tied weight stays gathered from the head's forward to its backward."""
    if output is not getattr(model, "embedding", None):
        model.output_head = OutputModuleHead()  # the output layer's forward: F.linear
        return False
    register_fsdp_forward_method(output, "tied_logits")
    # with MTP the head runs once per depth: each call's backward needs the weight again
    single_head = getattr(model, "mtp", None) is None
    if single_head:  # the head's and the lookup's gradients summed in one tensor
        output.tied_gradient = TiedGradient()
    keep = reshard and single_head
    model.output_head = FullyShardedTiedHead(keep)
    return keep


def expert_units(model: nn.Module) -> list[nn.Module]:
    """Every module named `experts` whose parameters are all expert-parallel experts."""
    return [
        module
        for name, module in model.named_modules()
        if name.rsplit(".", 1)[-1] == "experts"
        and _holds_parameters(module)
        and all(is_expert_parameter(p) for p in module.parameters())
    ]


def apply_fully_shard(
    model: nn.Module,
    mesh: DeviceMesh,
    options: FullyShardedOptions,
    *,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Make `model` fully sharded over `mesh` (see the module docstring): one unit per
    layer and the embedding, then the root; expert-parallel experts over `expert_mesh`."""
    policy = MixedPrecisionPolicy(
        param_dtype=options.param_dtype, reduce_dtype=options.reduce_dtype
    )
    reshard = options.strategy == "optim_grads_params"
    experts = expert_units(model)
    if experts and expert_mesh is None:
        raise ValueError("expert-parallel experts need an expert data-parallel mesh")
    expert_names = {n for n, p in model.named_parameters() if is_expert_parameter(p)}
    for module in experts:  # before their layers, which then leave them out
        fully_shard(module, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=policy)
    output = output_unit(model)
    inner = units(model)
    embedding = getattr(model, "embedding", None)
    vocab = shard_vocabulary(model, mesh, options) if output is embedding else None
    if vocab is not None:  # the tied weight stays sharded: no unit gathers it
        inner.remove(embedding)
    positions = position_unit(model) if embedding in inner or vocab is not None else None
    if positions is not None:  # the embedding's unit then holds its one weight
        fully_shard(positions, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        positions.set_unshard_in_backward(False)  # its backward scatters rows only
    # the unit that runs last in the forward has its backward at once: keep it gathered
    # (the untied output layer, else the last layer's last unit; not the tied embedding,
    # which runs first too, nor the layer before the head's gathered weight)
    gathered_head = output is embedding and output is not None and vocab is None
    parts = sublayer_units(inner, options.split_layer_bytes)
    forward = [unit for module in inner for unit in (module, *parts.get(module, ()))]
    kept = None if gathered_head else forward[-1] if forward else None
    nested = [unit for units_of_layer in parts.values() for unit in units_of_layer]
    for module in [*nested, *inner]:  # units inside a layer's before the layer's own
        keep = module is kept
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard and not keep, mp_policy=policy)
    ignored = {embedding.word_embeddings.weight} if vocab is not None else None
    fully_shard(
        model, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, ignored_params=ignored
    )
    use_in_place_collectives(model.modules())  # on gloo: see fully_sharded_gloo.py
    if vocab is not None:  # the head calls the embedding's tied_logits, on the shards
        model.output_head = FullyShardedTiedHead(keep=False)
        kept_for_head = False
    else:
        kept_for_head = output is not None and _route_head_through(model, output, reshard)
    # the lookup's backward reads no weight: not gathered for it, unless the head's is
    lookup_only = embedding in inner and (embedding is not output or kept_for_head)
    if lookup_only:
        embedding.set_unshard_in_backward(False)
    for name, param in model.named_parameters():  # fully_shard made new parameters
        if name in expert_names:
            param.allreduce = False
    if options.prefetch and len(forward) > 1:  # --overlap-param-gather: the next unit's
        for current, following in zip(forward, forward[1:], strict=False):  # all-gather early
            current.set_modules_to_forward_prefetch([following])
        # backward gathers a layer's unit (its output's gradient comes first), then the
        # ones inside it in reverse; not the embedding where its backward reads no weight
        backward = [
            unit
            for module in reversed(inner)
            if not (module is embedding and lookup_only)
            for unit in (module, *reversed(parts.get(module, ())))
        ]
        for current, following in zip(backward, backward[1:], strict=False):
            current.set_modules_to_backward_prefetch([following])


@contextlib.contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Accumulate this backward's gradients unreduced (every micro-batch but the last)."""
    if not isinstance(model, FSDPModule):
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def grad_norm_squares(grads: Iterable[Tensor]) -> Tensor:
    """The sum of squares of all gradients as if unsharded (float64, the same on every
    rank; each tensor's norm in its own dtype): `grad_norm.global_sum`."""
    return torch.tensor(global_sum(grads, squares_in_dtype), dtype=torch.float64)


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[nn.Parameter],
    max_norm: float,
    expert_group: dist.ProcessGroup | None = None,
) -> float:
    """Scale the gradients so that their global norm is at most `max_norm` (> 0); returns
    the norm before clipping (a non-finite norm is returned and nothing is scaled).
    `expert_group`: the expert-parallel group, whose ranks hold other experts."""
    params = [p for p in params if p.grad is not None]
    grads = [p.grad for p in params]
    squares = grad_norm_squares([p.grad for p in params if not is_expert_parameter(p)])
    if expert_group is not None:
        experts = grad_norm_squares([p.grad for p in params if is_expert_parameter(p)])
        experts = experts.to(collective_device(expert_group))
        dist.all_reduce(experts, group=expert_group)
        squares = squares + experts.cpu()
    norm = math.sqrt(float(squares))
    if max_norm > 0 and math.isfinite(norm):
        coefficient = max_norm / (norm + 1e-6)
        if coefficient < 1.0:
            for grad in grads:
                _local(grad).mul_(coefficient)
    return norm


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
