"""Pipeline and context parallelism in the training loop: layout, model split, one schedule.

- `build_layout` turns the torchrun world and the PP/CP flags into the mesh of
  `mg.core.parallel.mesh` (Megatron's tp-cp-dp-pp rank order) and the groups
  the step needs: data × context for gradients, pipeline for the schedule and
  the gradient norm, context for the ring, and Megatron's embedding group
  (first and last pipeline stage) for the tied embedding.
- `parallelize` swaps in ring attention (CP) and cuts the model into this
  rank's chunks (PP), applying activation recompute per chunk.
- `pipeline_forward_backward` feeds a global batch's micro-batches through
  Megatron's 1F1B / interleaved schedule.

Context-parallel loss, as in Megatron: each cp rank's micro-batch loss is its
masked sum over the micro-batch's tokens on *all* cp ranks, times cp, and the
gradients are averaged over data × context ranks, which sums the cp ranks'
parts of one sequence and averages over data-parallel replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from mg.core.parallel.context_parallel import apply_context_parallel, shard_batch
from mg.core.parallel.pipeline import (
    PipelineChunk,
    embedding_group_ranks,
    shared_embedding_weight,
    split_model,
    virtual_size_from_layers,
)
from mg.core.parallel.pipeline_schedule import build_schedule, forward_only, run_schedule
from mg.core.parallel.tensor_parallel import apply_tensor_parallel
from mg.trainer.arguments import Args
from mg.trainer.distributed import DistEnv


@dataclass
class ParallelLayout:
    """This rank's place in the tp × cp × dp × pp layout and the groups it uses."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    virtual: int = 1
    dp_cp_group: dist.ProcessGroup | None = None
    pp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    embedding_group: dist.ProcessGroup | None = None
    tp_mesh: DeviceMesh | None = None
    sequence_parallel: bool = False

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def writes_checkpoint(self) -> bool:
        """One rank per (tp, pp) shard writes it: data- and context-parallel rank 0."""
        return self.dp_rank == 0 and self.cp_rank == 0

    def describe(self) -> str:
        return f"pipeline stage {self.pp_rank} of {self.pp}" if self.pp > 1 else ""


def build_layout(args: Args, env: DistEnv) -> ParallelLayout:
    """The layout for this run (every rank calls it: it creates process groups)."""
    d = args.distributed
    tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
    cp = d.context_parallel_size
    virtual = virtual_size_from_layers(
        args.model.num_layers, pp, d.num_layers_per_virtual_pipeline_stage
    )
    if env.world_size == 1:
        return ParallelLayout(virtual=virtual)
    from mg.core.parallel.mesh import ParallelDims

    dims = ParallelDims.from_world(env.world_size, tp=tp, pp=pp, cp=cp)
    mesh = dims.build_mesh(env.device.type)
    coords = dims.coordinates(env.rank)
    layout = ParallelLayout(
        tp=tp,
        pp=pp,
        cp=cp,
        dp=dims.dp,
        tp_rank=coords["tp"],
        pp_rank=coords["pp"],
        cp_rank=coords["cp"],
        dp_rank=coords["dp"],
        virtual=virtual,
        dp_cp_group=mesh.group("dp_cp"),
        pp_group=mesh.group("pp"),
        cp_group=mesh.group("cp"),
        tp_mesh=mesh["tp"],
        sequence_parallel=d.sequence_parallel,
    )
    if pp > 1 and not args.model.untie_embeddings_and_output_weights:
        # new_group is collective over the world: create every pipeline's pair, keep ours
        per_stage = env.world_size // pp
        for offset in range(per_stage):
            ranks = embedding_group_ranks([offset + s * per_stage for s in range(pp)])
            group = dist.new_group(ranks)
            if env.rank in ranks:
                layout.embedding_group = group
    return layout


class PipelineModel(nn.ModuleList):
    """This rank's model chunks (one, or several with the interleaved schedule)."""

    @property
    def chunks(self) -> list[PipelineChunk]:
        return list(self)


def parallelize(
    model: nn.Module, layout: ParallelLayout, recompute: Callable[[nn.Module], None]
) -> nn.Module:
    """Tensor and context parallelism, then this rank's pipeline chunks; recompute on each."""
    if layout.tp > 1:
        apply_tensor_parallel(model, layout.tp_mesh, layout.sequence_parallel)
    if layout.cp > 1:
        apply_context_parallel(model, layout.cp_group)
    if layout.pp == 1:
        recompute(model)
        return model
    chunks = split_model(model, layout.pp_rank, layout.pp, layout.virtual)
    for chunk in chunks:
        recompute(chunk)
    return PipelineModel(chunks)


def pipeline_optimizer_options(model: nn.Module, layout: ParallelLayout) -> dict:
    """What the distributed optimizer needs of a pipeline stage: the group its gradient
    norm and inf check are reduced over, and the tied embedding it holds with its group."""
    if not isinstance(model, PipelineModel):
        return {}
    return {
        "pipeline_group": layout.pp_group,
        "tied_weight": shared_embedding_weight(model.chunks),
        "tied_group": layout.embedding_group,
    }


def shard_for_context(batch: dict[str, Tensor], layout: ParallelLayout) -> dict[str, Tensor]:
    return shard_batch(batch, layout.cp_rank, layout.cp) if layout.cp > 1 else batch


def micro_batch_loss(loss_sum: Tensor, tokens: Tensor, layout: ParallelLayout) -> Tensor:
    """The loss to backpropagate for one micro-batch (before / num_micro and loss scaling).

    Megatron's per-micro-batch masked mean; under CP the token count is the
    whole sequence's and the loss is multiplied by cp (see the module doc)."""
    if layout.cp == 1:
        return loss_sum / tokens.clamp(min=1)
    total = tokens.detach().clone()
    dist.all_reduce(total, group=layout.cp_group)
    return loss_sum / total.clamp(min=1) * layout.cp


def pipeline_forward_backward(
    model: PipelineModel,
    layout: ParallelLayout,
    batches: Sequence[dict[str, Tensor]],
    *,
    hidden_size: int,
    loss_scale: float,
    autocast: Callable[[], contextlib.AbstractContextManager],
    backward: bool,
    device: torch.device,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> tuple[Tensor, Tensor]:
    """Run one global batch's micro-batches through the schedule.

    `no_sync` (the distributed optimizer's, with --overlap-grad-reduce) holds
    back the gradient reduction except in each chunk's last micro-batch, whose
    backward starts the buckets' reduce-scatters as their gradients complete.
    Returns this rank's (sum of loss × mask, tokens) — zero except on the last
    stage — for the caller's all-reduce."""
    num_micro = len(batches)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)

    def forward_step(chunk: PipelineChunk, inp: Tensor | None, batch: dict[str, Tensor]):
        with autocast():
            return chunk(
                inp if inp is not None else batch["tokens"],
                batch["position_ids"],
                batch.get("attention_mask"),
                batch["labels"] if chunk.is_last else None,
            )

    def loss_func(per_token: Tensor, batch: dict[str, Tensor]):
        nonlocal loss_sum, tokens
        mask = batch["loss_mask"].float()
        micro_sum, micro_tokens = (per_token.float() * mask).sum(), mask.sum()
        loss_sum = loss_sum + micro_sum.detach().double()
        tokens = tokens + micro_tokens.detach().double()
        return micro_batch_loss(micro_sum, micro_tokens, layout) / num_micro * loss_scale, None

    mbs, seq = batches[0]["tokens"].shape  # seq: this cp rank's tokens
    if layout.sequence_parallel:  # between layers activations are split over tp ranks
        seq //= layout.tp
    actions = build_schedule(num_micro, layout.pp_rank, layout.pp, len(model))

    def backward_context(chunk: int, micro: int) -> contextlib.AbstractContextManager:
        if no_sync is None or micro == num_micro - 1:
            return contextlib.nullcontext()
        return no_sync()

    run_schedule(
        actions if backward else forward_only(actions),
        model.chunks,
        batches,
        forward_step=forward_step,
        loss_func=loss_func,
        group=layout.pp_group,
        tensor_shape=(mbs, seq, hidden_size),
        dtype=torch.float32,
        device=device,
        backward=backward,
        backward_context=backward_context,
    )
    return loss_sum, tokens
