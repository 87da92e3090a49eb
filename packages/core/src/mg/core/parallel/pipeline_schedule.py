"""Pipeline schedules: Megatron's 1F1B and interleaved 1F1B, run with tagged point-to-point.

A schedule is a list of actions per pipeline rank, ("F" | "B", model chunk,
micro-batch), in Megatron-Core's order
(`megatron/core/pipeline_parallel/schedules.py`):

- 1F1B (`forward_backward_pipelining_without_interleaving`): rank r runs
  min(P−r−1, m) warm-up forwards, then alternates one forward and one
  backward, then drains the remaining backwards.
- interleaved (`..._with_interleaving`), v chunks per rank: the m·v forward
  passes run in groups of P micro-batches per chunk (virtual micro-batch k
  is chunk (k mod P·v) // P, micro-batch (k // P·v)·P + k mod P, backwards in
  the mirrored chunk order), with (P−r−1)·2 + (v−1)·P warm-up forwards. m
  must be a multiple of P. Megatron refuses P=2 here only because of its
  fused send/receive pairs; with tagged messages the same order runs at P=2.

The runner (`run_schedule`) receives each stage's input just before it is
needed (a blocking receive, waited on by the watchdog) and sends outputs and
input gradients asynchronously, every message tagged with (kind, virtual
stage, micro-batch). Sends never block, so the only waits are true data
dependencies and any order that respects them is deadlock free; gloo and NCCL
both run it. Why not `torch.distributed.pipelining`: its loss function sees
only a target tensor (our loss needs the loss mask and Megatron's
per-micro-batch averaging), and it has no P=2 interleaving; this runner is
short and keeps Megatron's exact order, which the bubble benchmark measures.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mg.core.parallel import watchdog as watchdog_mod
from mg.core.parallel.pipeline import PipelineConfigError

Action = tuple[str, int, int]
"""("F" or "B", model chunk, micro-batch)."""


def one_f_one_b(num_micro: int, rank: int, size: int) -> list[Action]:
    """Megatron's non-interleaved 1F1B order for pipeline rank `rank` of `size`."""
    warmup = min(size - rank - 1, num_micro)
    actions: list[Action] = [("F", 0, i) for i in range(warmup)]
    for i in range(num_micro - warmup):
        actions += [("F", 0, warmup + i), ("B", 0, i)]
    actions += [("B", 0, i) for i in range(num_micro - warmup, num_micro)]
    return actions


def _virtual(k: int, size: int, chunks: int, forward: bool) -> tuple[int, int]:
    """Virtual micro-batch k → (model chunk, micro-batch), Megatron's grouping by P."""
    group = size * chunks
    chunk = (k % group) // size
    if not forward:
        chunk = chunks - 1 - chunk
    return chunk, (k // group) * size + k % size


def interleaved_1f1b(num_micro: int, rank: int, size: int, chunks: int) -> list[Action]:
    """Megatron's interleaved 1F1B order: `chunks` model chunks per rank."""
    if num_micro % size:
        raise PipelineConfigError(
            f"number of microbatches ({num_micro}) is not divisible by pipeline-model-parallel-"
            f"size ({size}) when using interleaved schedule; change --global-batch-size or "
            "--micro-batch-size"
        )
    total = num_micro * chunks
    warmup = min((size - rank - 1) * 2 + (chunks - 1) * size, total)
    actions: list[Action] = [("F", *_virtual(k, size, chunks, True)) for k in range(warmup)]
    for k in range(total - warmup):
        actions.append(("F", *_virtual(k + warmup, size, chunks, True)))
        actions.append(("B", *_virtual(k, size, chunks, False)))
    actions += [("B", *_virtual(k, size, chunks, False)) for k in range(total - warmup, total)]
    return actions


def build_schedule(num_micro: int, rank: int, size: int, chunks: int = 1) -> list[Action]:
    """1F1B for one chunk per rank, interleaved for several."""
    if chunks == 1:
        return one_f_one_b(num_micro, rank, size)
    return interleaved_1f1b(num_micro, rank, size, chunks)


def forward_only(actions: Sequence[Action]) -> list[Action]:
    """The forward passes of a schedule in its order (evaluation)."""
    return [a for a in actions if a[0] == "F"]


@dataclass
class TraceEvent:
    """One compute action's wall-clock span (time.perf_counter seconds)."""

    kind: str
    chunk: int
    micro: int
    start: float
    end: float


@dataclass
class ScheduleResult:
    """Per-micro-batch loss terms from the last stage (empty elsewhere) and the trace."""

    loss_terms: list[Any] = field(default_factory=list)
    trace: list[TraceEvent] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0


ForwardStep = Callable[[nn.Module, Tensor | None, Any], Tensor]
"""(chunk, received input or None on the first stage, micro-batch) → output."""
LossFunc = Callable[[Tensor, Any], tuple[Tensor, Any]]
"""(last stage's output, micro-batch) → (loss to backpropagate, terms to report)."""

_ACTIVATION, _GRADIENT = 0, 1


def run_schedule(
    actions: Sequence[Action],
    chunks: Sequence[nn.Module],
    micro_batches: Sequence[Any],
    *,
    forward_step: ForwardStep,
    loss_func: LossFunc,
    group: dist.ProcessGroup,
    tensor_shape: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    backward: bool = True,
    stage_name: str | None = None,
    backward_context: Callable[[int, int], contextlib.AbstractContextManager] | None = None,
) -> ScheduleResult:
    """Run `actions` (from `build_schedule`) on this rank's `chunks` over `group`.

    Virtual stage c·P + r (chunk c of pipeline rank r) takes its input from the
    previous virtual stage, on rank r−1 (wrapping to P−1 with chunk c−1). The
    first virtual stage calls forward_step with input None; the last one calls
    loss_func on its output and backpropagates the returned loss (already
    scaled by the caller, e.g. divided by the number of micro-batches).
    `backward_context(chunk, micro)` wraps each backward pass: a data-parallel
    wrapper's no-sync context for all but a chunk's last micro-batch lets its
    gradient reduction overlap the rest of the schedule."""
    guard = watchdog_mod.current()
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    next_rank = dist.get_global_rank(group, (rank + 1) % size)
    prev_rank = dist.get_global_rank(group, (rank - 1) % size)
    num_virtual, num_micro = size * len(chunks), len(micro_batches)
    where = stage_name or f"pipeline stage {rank} of {size}"

    def tag(kind: int, stage: int, micro: int) -> int:
        return (kind * num_virtual + stage) * num_micro + micro

    def receive(kind: int, stage: int, micro: int, src: int, what: str) -> Tensor:
        buffer = torch.empty(tuple(tensor_shape), dtype=dtype, device=device)
        work = dist.irecv(buffer, src=src, group=group, tag=tag(kind, stage, micro))
        guard.wait(work, f"{where}: receive {what} of micro-batch {micro} from rank {src}")
        return buffer

    sends: list[tuple[dist.Work, str]] = []

    def send(tensor: Tensor, kind: int, stage: int, micro: int, dst: int, what: str) -> None:
        payload = tensor.detach().to(dtype).contiguous()
        with guard.operation(f"{where}: send {what} of micro-batch {micro} to rank {dst}"):
            work = dist.isend(payload, dst=dst, group=group, tag=tag(kind, stage, micro))
        sends.append((work, f"{where}: send {what} of micro-batch {micro} to rank {dst}"))

    result = ScheduleResult(start=time.perf_counter())
    inputs: dict[tuple[int, int], Tensor | None] = {}
    outputs: dict[tuple[int, int], Tensor] = {}
    for kind, c, micro in actions:
        stage = c * size + rank
        if kind == "F":
            inp = None
            if stage > 0:
                inp = receive(_ACTIVATION, stage, micro, prev_rank, "activations")
                inp.requires_grad_(backward)
            begin = time.perf_counter()
            out = forward_step(chunks[c], inp, micro_batches[micro])
            if stage == num_virtual - 1:
                out, terms = loss_func(out, micro_batches[micro])
                result.loss_terms.append(terms)
            result.trace.append(TraceEvent("F", c, micro, begin, time.perf_counter()))
            if stage < num_virtual - 1:
                send(out, _ACTIVATION, stage + 1, micro, next_rank, "activations")
            if backward:
                inputs[(c, micro)], outputs[(c, micro)] = inp, out
        else:
            out, inp = outputs.pop((c, micro)), inputs.pop((c, micro))
            grad = None
            if stage < num_virtual - 1:
                grad = receive(_GRADIENT, stage, micro, next_rank, "output gradient")
            begin = time.perf_counter()
            with backward_context(c, micro) if backward_context else contextlib.nullcontext():
                torch.autograd.backward(out, grad_tensors=grad)
            result.trace.append(TraceEvent("B", c, micro, begin, time.perf_counter()))
            if stage > 0:
                send(inp.grad, _GRADIENT, stage - 1, micro, prev_rank, "input gradient")
    for work, name in sends:
        guard.wait(work, name)
    result.end = time.perf_counter()
    return result
