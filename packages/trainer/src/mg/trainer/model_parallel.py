"""Pipeline and context parallelism in the training loop: layout, model split, one schedule.

- `build_layout` turns the torchrun world and the TP/PP/CP flags into core's
  `ParallelLayout` (Megatron's tp-cp-dp-pp rank order) with the groups the
  step needs: data × context for gradients, pipeline for the schedule and the
  gradient norm, context for the ring, and Megatron's embedding group (first
  and last pipeline stage) for the tied embedding.
- the model itself is built by `mg.core.parallel.construct` (the ordered
  construction steps: TP, CP, the PP split, materialisation, EP, ...), which
  returns this rank's chunks as a `PipelineModel` under pipeline parallelism.
- `pipeline_forward_backward` feeds a global batch's micro-batches through
  Megatron's 1F1B / interleaved schedule; a family's `PipelineSteps` say how
  a micro-batch enters a chunk and how the last stage's output becomes its
  loss (GPT's by default; BERT's carry token types and the sentence-order loss).
- `amax_reduction_group` is Megatron's FP8 amax-reduction group (the stage's
  tensor × context × data ranks, or tensor × context with `--tp-only-amax-red`),
  which the trainer gives TE's `fp8_autocast`.

Context-parallel loss, as in Megatron: each cp rank's micro-batch loss is its
masked sum over the micro-batch's tokens on *all* cp ranks, times cp, and the
gradients are averaged over data × context ranks, which sums the cp ranks'
parts of one sequence and averages over data-parallel replicas.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mg.core.parallel.construct import PipelineModel
from mg.core.parallel.context_parallel import shard_batch
from mg.core.parallel.layout import ParallelLayout, build_parallel_layout, new_groups
from mg.core.parallel.pipeline import shared_embedding_weight, virtual_size_from_layers
from mg.core.parallel.pipeline_schedule import build_schedule, forward_only, run_schedule
from mg.trainer.arguments import Args
from mg.trainer.distributed import DistEnv


def build_layout(args: Args, env: DistEnv) -> ParallelLayout:
    """The layout for this run (every rank calls it: it creates process groups)."""
    d = args.distributed
    virtual = virtual_size_from_layers(
        args.model.num_layers,
        d.pipeline_model_parallel_size,
        d.num_layers_per_virtual_pipeline_stage,
    )
    return build_parallel_layout(
        env.world_size,
        env.rank,
        tp=d.tensor_model_parallel_size,
        pp=d.pipeline_model_parallel_size,
        cp=d.context_parallel_size,
        virtual=virtual,
        sequence_parallel=d.sequence_parallel,
        # with MTP the last stage holds an embedding copy too (Megatron's embedding group)
        tied_embedding=not args.model.untie_embeddings_and_output_weights
        or bool(args.mtp.mtp_num_layers),
        device_type=env.device.type,
        ep=args.moe.expert_model_parallel_size,
        etp=args.moe.expert_tensor_parallel_size,
    )


def amax_reduction_rank_groups(layout: ParallelLayout, tp_only: bool = False) -> list[list[int]]:
    """Every FP8 amax-reduction group's ranks, in the order Megatron's RankGenerator
    lists them (`parallel_state.get_amax_reduction_group(with_context_parallel=True,
    tp_only_amax_red=tp_only)`): the tensor × context × data ranks of each pipeline
    stage, or with `tp_only` (`--tp-only-amax-red`) the tensor × context ranks of each
    data-parallel replica of a stage. In the tp-cp-dp-pp rank order both are runs of
    consecutive ranks, listed from rank 0 up."""
    size = layout.tp * layout.cp * (1 if tp_only else layout.dp)
    return [list(range(start, start + size)) for start in range(0, layout.world_size, size)]


def amax_reduction_group(layout: ParallelLayout, tp_only: bool = False) -> dist.ProcessGroup | None:
    """The group TE's `fp8_autocast` reduces this rank's FP8 amaxes over (`fp8_group`):
    this rank's group of `amax_reduction_rank_groups`, within its pipeline stage, so
    other stages, which hold other layers and run other steps of the schedule, never
    join the reduction. Collective when it creates groups: every rank calls it, in the
    same place. None with one process (no distribution)."""
    if layout.world_size == 1:
        return None
    if tp_only and layout.cp == 1:  # the tensor-parallel group the layout already has
        return layout.tp_mesh.get_group()
    if not tp_only and layout.pp == 1:  # the stage is the whole world
        return dist.group.WORLD
    if not tp_only and layout.stage_group is not None:  # built for MoE's token counts
        return layout.stage_group
    ranks = amax_reduction_rank_groups(layout, tp_only)  # all of them, on every rank
    return new_groups(ranks, _global_rank(layout))[0]


def _global_rank(layout: ParallelLayout) -> int:
    """This rank's number in the tp-cp-dp-pp order (`mg.core.parallel.mesh`)."""
    return (
        (layout.pp_rank * layout.dp + layout.dp_rank) * layout.cp + layout.cp_rank
    ) * layout.tp + layout.tp_rank


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


def gpt_stage_forward(chunk: nn.Module, inp: Tensor | None, batch: dict[str, Tensor]) -> Tensor:
    """A GPT chunk's forward: token ids on the first stage, labels on the last."""
    return chunk(
        inp if inp is not None else batch["tokens"],
        batch["position_ids"],
        batch.get("attention_mask"),
        batch["labels"] if chunk.is_last else None,
    )


def gpt_stage_loss_terms(per_token: Tensor, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(sum of the per-token loss x loss mask, tokens) of the last stage's output."""
    mask = batch["loss_mask"].float()
    return (per_token.float() * mask).sum(), mask.sum()


def no_extra_losses(args: Args) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class PipelineSteps:
    """How a family's micro-batch goes through pipeline chunks.

    `input_key`: the batch entry the first stage reads ([b, s] token ids; its
    shape is the activations' between stages). `forward(chunk, received, batch)`
    runs one chunk (`received` is None on the first stage). `loss_terms(output,
    batch)` turns the last stage's output into (loss sum, tokens) and, for BERT,
    a dict of extra losses, each a mean over the micro-batch (as `loss_terms` of
    `ModelFamily`). `extra_losses(args)` names those extra losses, so that every
    stage, not only the last, reduces the same values."""

    input_key: str = "tokens"
    forward: Callable[[nn.Module, Tensor | None, dict[str, Tensor]], Any] = gpt_stage_forward
    loss_terms: Callable[[Any, dict[str, Tensor]], tuple] = gpt_stage_loss_terms
    extra_losses: Callable[[Args], tuple[str, ...]] = no_extra_losses


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
    dtype: torch.dtype = torch.float32,
    steps: PipelineSteps = PipelineSteps(),
    extra_names: Sequence[str] = (),
    per_token_scale: float | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """Run one global batch's micro-batches through the schedule.

    `no_sync` (the distributed optimizer's, with --overlap-grad-reduce) holds
    back the gradient reduction except in each chunk's last micro-batch, whose
    backward starts the buckets' reduce-scatters as their gradients complete.
    `dtype` is the autocast dtype (bf16/fp16, fp32 without): the one
    activations and gradients cross stages in. Returns this rank's (sum of
    loss × mask, tokens, {extra loss: sum over micro-batches}) — zero except on
    the last stage; `extra_names` (`steps.extra_losses(args)`) on every stage —
    for the caller's all-reduce. `per_token_scale` (--calculate-per-token-loss):
    each micro-batch backpropagates its loss sum times this factor instead of
    its masked mean / num_micro."""
    num_micro = len(batches)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = torch.zeros((), dtype=torch.float64, device=device)
    extra_sums = {n: torch.zeros((), dtype=torch.float64, device=device) for n in extra_names}

    def forward_step(chunk: nn.Module, inp: Tensor | None, batch: dict[str, Tensor]):
        with autocast():
            return steps.forward(chunk, inp, batch)

    def loss_func(output: Any, batch: dict[str, Tensor]):
        nonlocal loss_sum, tokens
        terms = steps.loss_terms(output, batch)
        micro_sum, micro_tokens = terms[0], terms[1]
        loss_sum = loss_sum + micro_sum.detach().double()
        tokens = tokens + micro_tokens.detach().double()
        if per_token_scale is not None:
            loss = micro_sum * per_token_scale
        else:
            loss = micro_batch_loss(micro_sum, micro_tokens, layout) / num_micro
        for name, value in (terms[2] if len(terms) > 2 else {}).items():
            extra_sums[name] = extra_sums[name] + value.detach().double()
            loss = loss + value / num_micro
        return loss * loss_scale, None

    mbs, seq = batches[0][steps.input_key].shape  # seq: this cp rank's tokens
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
        dtype=dtype,  # activations and gradients cross stages in the compute dtype
        device=device,
        backward=backward,
        backward_context=backward_context,
    )
    return loss_sum, tokens, extra_sums
