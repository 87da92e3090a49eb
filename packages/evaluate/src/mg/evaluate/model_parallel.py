"""GPT evaluation in a tensor/pipeline-parallel layout under torchrun, as Megatron's
``tasks/main.py`` runs it.

    torchrun --nproc-per-node 4 -m mg.evaluate.cli wikitext --load ckpt \\
        --valid-data wiki.test.tokens --tensor-model-parallel-size 2

The world splits into TP × PP × DP ranks in Megatron's order (core's
:class:`~mg.core.parallel.layout.ParallelLayout`). Each rank builds the model
on the meta device, keeps its part there — its tensor-parallel shard of each
layer and its pipeline stage, by the construction path's loading steps (core's
``mg.core.parallel.construct``) — and reads only that part from the checkpoint, whatever
layout it was saved in (core's ``load_model_part``). The ranks of one model
replica score the same data-parallel share of the examples together: micro-
batches go through core's pipeline schedule, forward only; the last stage's
per-micro-batch results are broadcast to the replica's other stages, so every
rank returns them and the data-parallel gather/sum works as without model
parallelism.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from mg.core.models import GPTModel
from mg.core.parallel.construct import ConstructOptions, PipelineModel, construct, steps_named
from mg.core.parallel.layout import ParallelLayout, build_parallel_layout
from mg.core.parallel.mesh import ParallelLayoutError
from mg.core.parallel.pipeline import PipelineChunk, PipelineConfigError
from mg.core.parallel.pipeline_schedule import build_schedule, forward_only, run_schedule
from mg.core.parallel.tensor_parallel import TensorParallelError
from mg.evaluate import distributed
from mg.evaluate.errors import EvalInputError

T = TypeVar("T")

Batch = dict[str, Tensor]
"""``tokens`` [b, s] model inputs, ``position_ids`` [b, s], optionally ``labels`` [b, s]
(then the model returns the per-token loss instead of logits) and
``attention_mask``; other keys ride along for the caller's ``collect``."""

PIPELINE_WINDOW = 32
"""Micro-batches per pipeline schedule run: enough to keep the stages busy, few
enough that a whole split is never collated at once."""


def build_eval_layout(tp: int, pp: int, device_type: str = "cpu") -> ParallelLayout:
    """The layout of ``--tensor-model-parallel-size`` / ``--pipeline-model-parallel-size``
    over torchrun's world (collective under torchrun: every rank calls it)."""
    for flag, size in (
        ("--tensor-model-parallel-size", tp),
        ("--pipeline-model-parallel-size", pp),
    ):
        if size < 1:
            raise EvalInputError(f"{flag} must be >= 1, got {size}")
    rank, world = distributed.rank_and_world()
    if world == 1:
        if tp * pp > 1:
            raise EvalInputError(
                f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} needs "
                f"{tp * pp} processes (or a multiple: the rest is data parallel), but this is "
                f"one; launch it as torchrun --nproc-per-node {tp * pp} -m mg.evaluate.cli ..."
            )
        return ParallelLayout()
    if world % (tp * pp):
        raise EvalInputError(
            f"world size {world} (torchrun's processes) is not divisible by "
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp}; launch a "
            f"multiple of {tp * pp} processes (the rest is data parallel) or change the flags"
        )
    try:
        return build_parallel_layout(world, rank, tp=tp, pp=pp, device_type=device_type)
    except ParallelLayoutError as err:
        raise EvalInputError(str(err)) from None


class EvalModel:
    """A GPT as this rank evaluates it: whole, tensor-parallel, or one pipeline stage.

    :meth:`run` is the one forward path of every GPT task; a plain module given
    to a task is wrapped with :meth:`whole` (data parallel over the world)."""

    def __init__(self, module: nn.Module, layout: ParallelLayout) -> None:
        self.module = module
        self.layout = layout
        first = next(module.parameters())
        self.device, self.dtype = first.device, first.dtype

    @classmethod
    def whole(cls, model: nn.Module | EvalModel) -> EvalModel:
        return model if isinstance(model, EvalModel) else cls(model, ParallelLayout())

    def num_parameters(self) -> int:
        """Parameters this rank holds (its tensor-parallel shards, its stage's layers)."""
        return sum(
            (p.to_local() if isinstance(p, DTensor) else p).numel()
            for p in self.module.parameters()
        )

    def describe(self) -> str:
        """Megatron's per-rank line, printed by the first data-parallel replica."""
        layout = self.layout
        return (
            " > number of parameters on (tensor, pipeline) model parallel rank "
            f"({layout.tp_rank}, {layout.pp_rank}): {self.num_parameters()}"
        )

    @property
    def fixed_shape(self) -> bool:
        """Micro-batches must share one shape (the pipeline's receive buffers have it)."""
        return self.layout.pp > 1

    @torch.no_grad()
    def run(self, batches: Iterable[Batch], collect: Callable[[Tensor, Batch], T]) -> list[T]:
        """``collect(output, batch)`` for each micro-batch, in order, on every rank.

        ``output`` is the logits [b, s, vocab] (gathered over tensor-parallel
        ranks), or the per-token loss [b, s] when the batch has ``labels``."""
        self.module.eval()
        if self.layout.pp == 1:
            return [collect(self._forward(self.module, None, b), b) for b in self._moved(batches)]
        results: list[T] = []
        batches = self._moved(batches)
        while window := list(islice(batches, PIPELINE_WINDOW)):
            results += self._pipeline(window, collect)
        return results

    def _moved(self, batches: Iterable[Batch]) -> Iterator[Batch]:
        for batch in batches:
            yield {k: v.to(self.device) for k, v in batch.items()}

    @staticmethod
    def _forward(module: nn.Module, hidden: Tensor | None, batch: Batch) -> Tensor:
        last = not isinstance(module, PipelineChunk) or module.is_last
        return module(
            batch["tokens"] if hidden is None else hidden,
            batch["position_ids"],
            batch.get("attention_mask"),
            batch.get("labels") if last else None,
        )

    def _pipeline(self, window: list[Batch], collect: Callable[[Tensor, Batch], T]) -> list[T]:
        """One forward-only schedule over ``window``; results broadcast from the last stage."""
        layout = self.layout
        rows = max(len(b["tokens"]) for b in window)
        padded = [_pad_rows(b, rows) for b in window]
        widths = {tuple(b["tokens"].shape) for b in padded}
        if len(widths) != 1:
            raise ValueError(f"pipeline micro-batches must share one shape, got {sorted(widths)}")
        index = {id(b): i for i, b in enumerate(padded)}
        results: list[Any] = [None] * len(window)

        def keep(output: Tensor, batch: Batch) -> tuple[None, None]:
            original = window[index[id(batch)]]
            results[index[id(batch)]] = collect(output[: len(original["tokens"])], original)
            return None, None  # no loss to backpropagate

        actions = forward_only(build_schedule(len(window), layout.pp_rank, layout.pp))
        run_schedule(
            actions,
            [self.module],
            padded,
            forward_step=self._forward,
            loss_func=keep,
            group=layout.pp_group,
            tensor_shape=(rows, padded[0]["tokens"].shape[1], self.module.config.hidden_size),
            dtype=self.dtype,
            device=self.device,
            backward=False,
            stage_name=f"mg-eval pipeline stage {layout.pp_rank} of {layout.pp}",
        )
        shared: list[Any] = [results if layout.is_last_stage else None]
        last = dist.get_global_rank(layout.pp_group, layout.pp - 1)
        dist.broadcast_object_list(shared, src=last, group=layout.pp_group)
        return shared[0]


def _pad_rows(batch: Batch, rows: int) -> Batch:
    """Rows up to ``rows`` by repeating row 0 (valid inputs; their results are dropped)."""
    missing = rows - len(batch["tokens"])
    if missing == 0:
        return batch
    return {k: torch.cat([v, v[:1].expand(missing, *v.shape[1:])]) for k, v in batch.items()}


@contextlib.contextmanager
def layout_errors() -> Iterator[None]:
    """A model that does not split over the layout, as mg-eval's input error (the message
    names the number that does not divide)."""
    try:
        yield
    except TensorParallelError as err:
        raise EvalInputError(f"cannot evaluate with tensor parallelism: {err}") from None
    except PipelineConfigError as err:
        raise EvalInputError(f"cannot evaluate with pipeline parallelism: {err}") from None


def parallelize_for_eval(model: GPTModel, layout: ParallelLayout) -> EvalModel:
    """This rank's part of ``model`` (the whole model, identical on every rank)."""
    device = next(model.parameters()).device
    options = ConstructOptions(layout=layout, device=device)
    with layout_errors():  # the construction path's steps for a model that has its weights
        built = construct(model, options, steps_named("tensor parallel", "pipeline split"))
    if isinstance(built, PipelineModel):
        (built,) = built.chunks
    return EvalModel(built, layout)
