"""Tensor (and sequence) parallelism for a built GPT, BERT or T5 model, with DTensor styles.

`apply_tensor_parallel(model, tp_mesh, sequence_parallel)` turns the
parameters into DTensors on the tensor-parallel mesh and installs the
communication at module boundaries, Megatron's layout:

    embedding.word_embeddings   vocab-parallel (rows sharded, output all-reduced)
    self_attention.linear_qkv   column-parallel (whole query groups per rank); in the TE
                                spec its fused input norm stays whole (tensor_parallel_te)
    self_attention.linear_proj  row-parallel (output all-reduced / reduce-scattered)
    mlp.linear_fc1              column-parallel; gated: gate and up halves each sharded
    mlp.linear_fc2              row-parallel
    MoE mlp                     experts as the MLP (over TP or the expert TP mesh), router
                                replicated (moe.tensor_parallel)
    output layer + loss         vocab-parallel logits and cross-entropy (loss_parallel)

With `sequence_parallel` the norms and dropouts between those regions work on
sequence shards: activations are [b, s/tp, h] there, all-gathered before a
column-parallel layer and reduce-scattered after a row-parallel one.

BERT and T5 use the same layers, so the same plan: BERT's encoder layers
(pre-LN, or post-LN for imported HF weights), T5's encoder layers and its
decoder layers, whose cross-attention is sharded like self-attention
(linear_q and linear_kv column-parallel by heads, linear_proj row-parallel;
with sequence parallelism the encoder output is all-gathered before it, as
Megatron's linear_kv does). Their output layers have a bias, sharded with the
vocabulary. BERT's LM head, pooler and binary head are replicated, as in
Megatron (plain linears there too); with sequence parallelism the encoder
output is gathered at their inputs.

Layout notes:
- linear_qkv rows are grouped per query group (see SelfAttention), so a plain
  dim-0 shard gives each rank whole groups: its query heads with their key and
  value head. The module's head counts are set to the local ones here.
- A gated linear_fc1 is [gate; up]; each half is sharded (rank r holds
  [gate_r; up_r]) — `_StridedShard(0, split_factor=2)` in DTensor terms, so the
  DTensor's global view stays Megatron's [gate; up] layout.
- The logits never exist in full: each rank multiplies by its vocab slice of
  the output weight and the cross-entropy all-reduces [tokens]-sized values.

Dropout on replicated activations draws from each rank's default generator,
seeded identically on all tensor-parallel ranks; dropout inside tensor-parallel
regions (a rank's heads, or its sequence slice with SP) forks to a per-rank
stream, as Megatron does (mg.core.models.rng_stream).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.placement_types import _StridedShard

from mg.core.models.bert import BertModel
from mg.core.models.config import TransformerConfig
from mg.core.models.gpt import GPTModel
from mg.core.models.mamba import MambaConfig, MambaLayer, MambaModel
from mg.core.models.mla import MLASelfAttention
from mg.core.models.moe import MoELayer
from mg.core.models.moe.tensor_parallel import shard_moe_layer
from mg.core.models.rng_stream import RNGStream, set_model_parallel_stream
from mg.core.models.subclass import extend_class
from mg.core.models.t5 import T5Model
from mg.core.models.te_spec import LayerNormLinear
from mg.core.parallel.loss_parallel import VocabParallelOutputHead
from mg.core.parallel.row_parallel import RowParallelLinear
from mg.core.parallel.tensor_parallel_mamba import parallelize_mamba_layer
from mg.core.parallel.tensor_parallel_mla import (
    finish_mla_tensor_parallel,
    mla_tensor_parallel_plan,
)
from mg.core.parallel.tensor_parallel_te import LayerNormColwiseParallel


class TensorParallelError(ValueError):
    """The model's shapes do not split over the requested tensor-parallel size."""


class GatedColwiseParallel(ColwiseParallel):
    """Column parallelism for a fused [gate; up] linear: each half sharded on its own.

    Rank r's local weight is [gate rows of r; up rows of r], so the MLP's
    `chunk(2, dim=-1)` on the local output still yields matching gate/up slices.
    """

    def __init__(self) -> None:
        # The output keeps the strided layout: each rank's [gate_r | up_r] columns.
        super().__init__(output_layouts=_StridedShard(-1, split_factor=2))

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters():
            dist_param = nn.Parameter(
                distribute_tensor(
                    param,
                    device_mesh,
                    [_StridedShard(0, split_factor=2)],
                    src_data_rank=self.src_data_rank,
                ),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(param_name, dist_param)


class ForkedDropoutRNG:
    """Mixin: the module's forward draws from the tensor-parallel per-rank stream
    (`tp_rng_stream`), as Megatron's dropout inside tensor-parallel regions does."""

    tp_rng_stream: RNGStream

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.tp_rng_stream.fork():
            return super().forward(*args, **kwargs)


def check_tensor_parallel_sizes(
    config: TransformerConfig, tp: int, expert_tensor_parallel: bool = True, etp: int | None = None
) -> None:
    """Megatron's divisibility rules, with the flag to change in the message; `etp`: the
    size the experts are split over with `expert_tensor_parallel` (tp unless given)."""
    etp = tp if etp is None else etp
    if config.num_moe_experts and expert_tensor_parallel:
        ffn = config.moe_ffn_hidden_size or 0
        if ffn % etp:
            size = "--expert-tensor-parallel-size" if etp != tp else "--tensor-model-parallel-size"
            raise TensorParallelError(
                f"moe_ffn_hidden_size ({ffn}) is not divisible by {size} ({etp}); change "
                "--moe-ffn-hidden-size or the expert tensor-parallel size"
            )
    checks = [
        ("num_attention_heads", config.num_attention_heads, "--num-attention-heads"),
        ("num_query_groups", config.num_query_groups, "--num-query-groups"),
        ("ffn_hidden_size", config.ffn_hidden_size, "--ffn-hidden-size"),
        ("vocab_size (padded)", config.vocab_size, "--make-vocab-size-divisible-by"),
    ]
    if config.num_moe_experts:  # the shared experts' slices (split over TP)
        shared = config.moe_shared_expert_intermediate_size or 0
        flag = "--moe-shared-expert-intermediate-size"
        checks.append(("moe_shared_expert_intermediate_size", shared, flag))
    if isinstance(config, MambaConfig):  # Megatron's MambaMixer asserts both
        checks.append(("mamba_num_heads", config.mamba_num_heads, "--mamba-num-heads"))
        checks.append(("mamba_num_groups", config.mamba_num_groups, "--mamba-num-groups"))
    for name, value, flag in checks:
        if value % tp:
            raise TensorParallelError(
                f"{name} ({value}) is not divisible by --tensor-model-parallel-size ({tp}); "
                f"change {flag} or the tensor-parallel size"
            )


def _fork_tensor_parallel_dropout(
    model: nn.Module,
    layers: list[nn.Module],
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    seed: int | None,
    device: torch.device | None,
) -> None:
    """Dropout inside tensor-parallel regions draws from the per-rank stream."""
    base = torch.initial_seed() if seed is None else seed
    if device is None:
        device = next(model.parameters()).device
    stream = RNGStream(base + 2718 + tp_mesh.get_local_rank(), device)
    set_model_parallel_stream(stream)
    config = model.config
    modules: list[nn.Module] = []
    if config.attention_dropout > 0:
        for layer in layers:
            if not hasattr(layer, "self_attention"):  # a hybrid's Mamba or MLP layer
                continue
            modules.append(layer.self_attention.core_attention)
            if hasattr(layer, "cross_attention"):
                modules.append(layer.cross_attention.core_attention)
    if sequence_parallel and config.hidden_dropout > 0:
        modules += [layer.hidden_dropout for layer in layers]
    for module in modules:
        extend_class(module, ForkedDropoutRNG)
        module.tp_rng_stream = stream


def apply_tensor_parallel(
    model: GPTModel | BertModel | T5Model | MambaModel,
    tp_mesh: DeviceMesh,
    sequence_parallel: bool,
    seed: int | None = None,
    device: torch.device | None = None,
    expert_tensor_parallel: bool = True,
    expert_mesh: DeviceMesh | None = None,
    scatter_embedding: bool = True,
) -> None:
    """Shard `model` in place over the 1-D `tp_mesh` (every TP rank calls this).

    `expert_tensor_parallel=False`: MoE layers keep their routed experts whole
    (Megatron's --expert-tensor-parallel-size 1; mg.core.models.moe.tensor_parallel);
    `expert_mesh`: the mesh the routed experts are split over when it is not `tp_mesh`
    (an expert tensor-parallel size between 1 and tp: etp consecutive TP ranks);
    `scatter_embedding=False` (Megatron's `scatter_embedding_sequence_parallel`): with
    sequence parallelism the embedding's output stays whole, for a caller that adds to it
    (a vision-language model's image rows) and scatters it itself.

    The model is either fully materialized and identical on the TP ranks
    (each keeps its slice, no communication), or on the meta device: then the
    parameters become DTensors with meta local shards, to be materialized with
    `mg.core.parallel.materialize` (`device` names where the run computes). Dropout over this
    rank's heads (and, with sequence parallelism, over its slice of the
    sequence) draws from a per-rank stream seeded `seed + 2718 + tp_rank` as in
    Megatron (`seed`: torch's initial seed if None; see mg.core.models.rng_stream).
    """
    if isinstance(model, GPTModel | MambaModel):
        blocks = [model.decoder]
    elif isinstance(model, BertModel):
        blocks = [model.encoder]
    elif isinstance(model, T5Model):
        blocks = [model.encoder, model.decoder]
    else:
        raise TypeError(
            "tensor parallelism is implemented for GPTModel, BertModel, T5Model and "
            f"MambaModel, not {type(model).__name__}"
        )
    tp = tp_mesh.size()
    etp = expert_mesh.size() if expert_mesh is not None else tp
    check_tensor_parallel_sizes(model.config, tp, expert_tensor_parallel, etp)
    activations = Shard(1) if sequence_parallel else Replicate()  # [b, s, h]: dim 1 = sequence

    parallelize_module(
        model.embedding.word_embeddings,
        tp_mesh,
        RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        src_data_rank=None,
    )
    if sequence_parallel and scatter_embedding:
        # Positions are added to the full sequence, then each rank keeps its
        # slice (the backward all-gathers the slices' gradients).
        parallelize_module(
            model.embedding,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True
            ),
        )
    layers = [layer for block in blocks for layer in block.layers]
    mtp = getattr(model, "mtp", None)
    if mtp is not None:  # Megatron's MTP: eh_proj column-parallel with its output gathered,
        for depth in mtp.layers:  # the transformer layer as a decoder layer
            style = ColwiseParallel(output_layouts=Replicate())
            if sequence_parallel:  # norms on sequence shards; eh_proj's input gathered and
                for norm in (depth.enorm, depth.hnorm, depth.final_layernorm):  # its output
                    parallelize_module(norm, tp_mesh, SequenceParallel(), src_data_rank=None)
                style = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(1))
            parallelize_module(depth.eh_proj, tp_mesh, style, src_data_rank=None)
            layers.append(depth.transformer_layer)
    _fork_tensor_parallel_dropout(model, layers, tp_mesh, sequence_parallel, seed, device)
    for layer in layers:
        _parallelize_layer(
            layer, tp_mesh, activations, sequence_parallel, expert_tensor_parallel, expert_mesh
        )
    for block in blocks:
        final_norm = getattr(block, "final_layernorm", None) or getattr(block, "final_norm", None)
        if sequence_parallel and final_norm is not None:
            parallelize_module(final_norm, tp_mesh, SequenceParallel(), src_data_rank=None)
    if isinstance(model, BertModel) and sequence_parallel:
        # The LM head and the pooler are replicated: they see the whole sequence (their
        # inputs are gathered, wherever they run: the whole model or its last stage).
        for head in (model.lm_head, model.pooler):
            if head is not None:
                parallelize_module(
                    head,
                    tp_mesh,
                    PrepareModuleInput(
                        input_layouts=(Shard(1),),
                        desired_input_layouts=(Replicate(),),
                        use_local_output=True,
                    ),
                )
    output_layer = getattr(model, "output_layer", None)
    if isinstance(model, T5Model):
        output_layer = model.lm_head.output_layer
    if isinstance(output_layer, nn.Linear):
        # Only its weight (and bias) is used (output_and_loss), sharded by vocab rows.
        parallelize_module(output_layer, tp_mesh, ColwiseParallel(), src_data_rank=None)
    elif output_layer is not None:  # tied weight: the output layer holds only its bias
        bias = output_layer.bias
        output_layer.bias = nn.Parameter(
            distribute_tensor(bias.detach(), tp_mesh, [Shard(0)], src_data_rank=None),
            requires_grad=bias.requires_grad,
        )

    # the logits and the loss from the vocab-sharded output weight (a pipeline stage cut
    # from this model later takes this head with the rest of its last layers)
    model.output_head = VocabParallelOutputHead(tp_mesh)
    model.tensor_parallel_size = tp
    model.sequence_parallel = sequence_parallel


def _parallelize_layer(
    layer: nn.Module,
    tp_mesh: DeviceMesh,
    activations: Shard | Replicate,
    sequence_parallel: bool,
    expert_tensor_parallel: bool = True,
    expert_mesh: DeviceMesh | None = None,
) -> None:
    """Megatron's layout for one transformer layer (GPT's, BERT's pre- or post-LN, T5's
    decoder layer with cross-attention), whatever norms it has; a hybrid's layers have
    attention or an MLP alone, or a Mamba mixer (tensor_parallel_mamba)."""
    if isinstance(layer, MambaLayer):
        parallelize_mamba_layer(layer, tp_mesh, activations, sequence_parallel)
        return
    tp = tp_mesh.size()
    plan: dict[str, object] = {}
    mla = isinstance(getattr(layer, "self_attention", None), MLASelfAttention)
    if mla:  # multi-latent attention: heads split, latents replicated (tensor_parallel_mla)
        plan.update(mla_tensor_parallel_plan(layer.self_attention, "self_attention", activations))
    elif hasattr(layer, "self_attention"):
        fused = isinstance(layer.self_attention.linear_qkv, LayerNormLinear)  # the TE spec
        plan["self_attention"] = PrepareModuleInput(  # a DTensor: the whole sequence's shape
            input_layouts=(activations, None, None),
            desired_input_layouts=(activations if fused else Replicate(), None, None),
        )
        plan["self_attention.linear_qkv"] = (
            LayerNormColwiseParallel(sequence_parallel) if fused else ColwiseParallel()
        )
        plan["self_attention.linear_proj"] = RowParallelLinear(output_layouts=activations)
    moe = isinstance(getattr(layer, "mlp", None), MoELayer)
    if moe:  # it gathers and scatters the sequence itself (mg.core.models.moe.tensor_parallel)
        plan["mlp"] = PrepareModuleInput(
            input_layouts=(activations,),
            desired_input_layouts=(activations,),
            use_local_output=True,
        )
    elif hasattr(layer, "mlp") and isinstance(layer.mlp.linear_fc1, LayerNormLinear):
        # the TE spec: the pre-MLP norm inside linear_fc1 takes the activations as they are
        plan["mlp.linear_fc1"] = LayerNormColwiseParallel(sequence_parallel, layer.mlp.gated)
        plan["mlp.linear_fc2"] = RowParallelLinear(output_layouts=activations)
    elif hasattr(layer, "mlp"):
        plan["mlp"] = PrepareModuleInput(
            input_layouts=(activations,), desired_input_layouts=(Replicate(),)
        )
        plan["mlp.linear_fc1"] = GatedColwiseParallel() if layer.mlp.gated else ColwiseParallel()
        plan["mlp.linear_fc2"] = RowParallelLinear(output_layouts=activations)
    if hasattr(layer, "cross_attention"):
        plan["cross_attention"] = PrepareModuleInput(
            input_layouts=(activations, activations, None),
            desired_input_layouts=(Replicate(), Replicate(), None),
        )
        plan["cross_attention.linear_q"] = ColwiseParallel()
        plan["cross_attention.linear_kv"] = ColwiseParallel()  # rows grouped per head
        plan["cross_attention.linear_proj"] = RowParallelLinear(output_layouts=activations)
    if sequence_parallel:
        for name in ("input_layernorm", "pre_cross_attn_layernorm", "pre_mlp_layernorm"):
            # the TE spec's fused norms leave weightless identities here
            if hasattr(layer, name) and not isinstance(getattr(layer, name), nn.Identity):
                plan[name] = SequenceParallel()
        # post-LN norms feed the residual stream itself: local shards, like the sums
        for name in ("post_attention_layernorm", "post_mlp_layernorm"):
            if isinstance(getattr(layer, name, None), nn.Module):
                plan[name] = SequenceParallel(use_local_output=True)
    attention = getattr(layer, "self_attention", None)
    if not mla and getattr(attention, "q_layernorm", None) is not None:
        # replicated weights over this rank's heads ([b, s, heads, d], dim 2): their
        # gradients are partial sums, all-reduced like sequence-parallel norms'
        for name in ("self_attention.q_layernorm", "self_attention.k_layernorm"):
            plan[name] = SequenceParallel(sequence_dim=2, use_local_output=True)
    parallelize_module(layer, tp_mesh, plan, src_data_rank=None)
    if moe:
        shard_moe_layer(layer.mlp, tp_mesh, sequence_parallel, expert_tensor_parallel, expert_mesh)
    if mla:
        finish_mla_tensor_parallel(layer.self_attention, tp_mesh)
    if hasattr(layer, "self_attention"):
        _use_local_head_counts(layer.self_attention, tp)
        _shard_attention_sinks(layer.self_attention.core_attention, tp_mesh)
    if hasattr(layer, "cross_attention"):
        layer.cross_attention.num_heads //= tp
        _use_local_head_counts_of_core(layer.cross_attention.core_attention, tp)


def _use_local_head_counts(attention: nn.Module, tp: int) -> None:
    """SelfAttention reshapes its local QKV output with these counts."""
    attention.num_heads //= tp
    attention.num_groups //= tp
    _use_local_head_counts_of_core(attention.core_attention, tp)


def _shard_attention_sinks(core: nn.Module, tp_mesh: DeviceMesh) -> None:
    """The learnable sink logits, one per head (`softmax_offset`, gpt-oss): split with the
    heads, as Megatron shards them on dim 0 (rank r's heads are its query groups')."""
    sinks = getattr(core, "softmax_offset", None)
    if isinstance(sinks, nn.Parameter) and not isinstance(sinks, DTensor):
        core.softmax_offset = nn.Parameter(
            distribute_tensor(sinks.detach(), tp_mesh, [Shard(0)], src_data_rank=None),
            requires_grad=sinks.requires_grad,
        )


def _use_local_head_counts_of_core(core: nn.Module, tp: int) -> None:
    for attr in ("num_heads", "num_groups"):
        if hasattr(core, attr):
            setattr(core, attr, getattr(core, attr) // tp)


@torch.no_grad()
def sync_tensor_parallel_grads(model: nn.Module) -> None:
    """Bring every DTensor gradient to its parameter's layout, after the last backward.

    With sequence parallelism a norm's weight gradient is a partial sum per
    rank (each saw only its sequence slice); Megatron all-reduces those over
    the tensor-parallel group in `finalize_model_grads`, and so do we, in one
    collective per mesh (the routed experts' replicated biases are partial sums over
    the expert tensor-parallel mesh when it is not TP's). Other mismatches (a
    replicated gradient for a sharded embedding) are resolved locally by DTensor.
    """
    partial: list[nn.Parameter] = []
    for param in model.parameters():
        grad = param.grad
        if not isinstance(grad, DTensor) or grad.placements == param.placements:
            continue
        if all(p.is_partial() for p in grad.placements) and all(
            p.is_replicate() for p in param.placements
        ):
            partial.append(param)
        else:
            param.grad = grad.redistribute(param.device_mesh, param.placements)
    by_group: dict[tuple[int, ...], list[nn.Parameter]] = {}  # TP's, an expert TP mesh's
    for param in partial:
        by_group.setdefault(tuple(param.device_mesh.mesh.flatten().tolist()), []).append(param)
    for params in by_group.values():  # in parameter order: the same on every rank
        _all_reduce_partial(params)


def _all_reduce_partial(partial: list[nn.Parameter]) -> None:
    """Sum partial gradients over their mesh's group, in one collective."""
    locals_ = [p.grad.to_local() for p in partial]
    flat = torch.cat([t.reshape(-1) for t in locals_])
    dist.all_reduce(flat, group=partial[0].device_mesh.get_group())
    offset = 0
    for param, local in zip(partial, locals_, strict=True):
        reduced = flat[offset : offset + local.numel()].view_as(local)
        offset += local.numel()
        param.grad = DTensor.from_local(
            reduced, param.device_mesh, param.placements, run_check=False
        )
