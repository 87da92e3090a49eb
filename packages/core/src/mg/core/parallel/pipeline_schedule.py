"""Pipeline schedules: Megatron's 1F1B and interleaved 1F1B, run with batched point-to-point.

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
  must be a multiple of P. Megatron refuses P=2 here: its exchanges are
  written for a previous and a next rank that differ. The plan below orders
  each pair's messages itself, so the same order runs at P=2.

Communication is written to NCCL's semantics, which gloo (the test backend)
is more forgiving than:

- No tags. NCCL ignores them: messages between two ranks match purely in
  issue order. So the k-th receive a rank posts from a peer must be the k-th
  message that peer sent it. Every rank can compute every rank's action list
  (the schedules are deterministic), so `communication_plan` derives each
  ordered pair's send order and has the receiver post its receives in exactly
  that order; a message received before its action needs it is kept in a
  buffer until then. This matters at P=2, where the previous and the next
  rank are the same peer and one batch can receive an activation and a
  gradient from it.
- Batched exchanges. NCCL point-to-point is a rendezvous (a send completes
  only once the peer has posted the matching receive) and the operations on
  one communicator run in issue order, so two ranks that each send to the
  other before receiving deadlock. As Megatron-Core does
  (`p2p_communication._communicate`: `send_forward_recv_backward`,
  `send_backward_recv_forward`, …), each communication point between two
  compute actions is one `batch_isend_irecv`: the sends the previous action
  produced and the receives the next action needs, waited on as a whole
  before the next action runs. Where that alone would leave two ranks each
  waiting for the other to receive (P=2 interleaved), the plan has the
  receiver take the message early, in the batch it is waiting in.
  `communication_plan` is a pure function; a unit test simulates every rank's
  batches under these rules for 1F1B and interleaved schedules (and their
  forward-only orders) and checks that none deadlocks and that every receive
  gets the message it expects.
- Compute dtype on the wire. Activations and gradients travel in `dtype` (the
  autocast dtype under --bf16/--fp16, as Megatron sends in its params dtype).
  A received activation is cast to the dtype of the receiving chunk's
  parameters (the fp32 residual stream under autocast) with autograd flowing
  back to the received leaf, so its gradient is sent back in `dtype` too; a
  received gradient is cast to its output's dtype before backward. In fp32
  every cast is the identity.
- One shape per run. Receive buffers have the caller's fixed `tensor_shape`;
  an outgoing tensor of another shape is an error (as Megatron without
  --variable-seq-lengths), never a silent garbage message.

Why not `torch.distributed.pipelining`: its loss function sees only a target
tensor (our loss needs the loss mask and Megatron's per-micro-batch
averaging), and it has no P=2 interleaving; this runner is short and keeps
Megatron's exact order, which the bubble benchmark measures.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import Counter
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


# --- the communication plan ------------------------------------------------------------------

ACTIVATION, GRADIENT = "activations", "output gradient"


@dataclass(frozen=True)
class Message:
    """One tensor crossing between pipeline ranks: `kind` (ACTIVATION or GRADIENT) for
    virtual stage `stage` (the stage that consumes it) and micro-batch `micro`."""

    kind: str
    stage: int
    micro: int


@dataclass(frozen=True)
class P2P:
    """One operation of a rank's plan: send `message` to, or receive it from, pipeline
    rank `peer` (a rank of the pipeline group, not a global rank)."""

    send: bool
    peer: int
    message: Message


CommBatch = tuple[P2P, ...]
"""The operations of one communication point, issued as one `batch_isend_irecv`."""


def received_message(action: Action, rank: int, size: int, chunks: int) -> Message | None:
    """The message `action` of pipeline rank `rank` needs before it can run, if any."""
    kind, chunk, micro = action
    stage = chunk * size + rank
    if kind == "F":
        return Message(ACTIVATION, stage, micro) if stage > 0 else None
    return Message(GRADIENT, stage, micro) if stage < size * chunks - 1 else None


def sent_message(action: Action, rank: int, size: int, chunks: int) -> Message | None:
    """The message `action` of pipeline rank `rank` produces for another stage, if any."""
    kind, chunk, micro = action
    stage = chunk * size + rank
    if kind == "F":
        return Message(ACTIVATION, stage + 1, micro) if stage < size * chunks - 1 else None
    return Message(GRADIENT, stage - 1, micro) if stage > 0 else None


def message_source(message: Message, size: int) -> int:
    """The pipeline rank that sends `message`: the stage before (activations) or after."""
    step = -1 if message.kind == ACTIVATION else 1
    return (message.stage + step) % size


def send_orders(
    schedules: Sequence[Sequence[Action]], chunks: int
) -> dict[tuple[int, int], list[Message]]:
    """(source, destination) → the messages the source sends there, in issue order.

    NCCL matches a pair's messages in this order, so it is the order the
    destination must post its receives in."""
    size = len(schedules)
    orders: dict[tuple[int, int], list[Message]] = {}
    for rank, actions in enumerate(schedules):
        for action in actions:
            message = sent_message(action, rank, size, chunks)
            if message is not None:
                orders.setdefault((rank, message.stage % size), []).append(message)
    return orders


def communication_plan(schedules: Sequence[Sequence[Action]], chunks: int) -> list[list[CommBatch]]:
    """Every pipeline rank's communication batches for `schedules` (one action list per rank).

    Rank r's plan has len(actions) + 1 batches: batch i runs before action i
    (batch len(actions) after the last one). It holds the send of what action
    i−1 produced and the receives action i needs: its own message and, before
    it, any message the same peer sent earlier that is not yet received (FIFO;
    the runner keeps those until their action runs).

    That alone can deadlock under NCCL's rendezvous: at P=2 interleaved, two
    ranks may each send the other a gradient that the other needs only later.
    So the plan is built by running the ranks through NCCL's rules (see
    `_PlanBuilder`): whenever every rank is blocked, each pending send's
    receive joins the batch its receiver is blocked in, so the receiver takes
    that message early (Megatron's fused send/receive pairs do the same in
    effect). Whether a plan completes under those rules does not depend on
    timing, so one run of the model proves the plan for every run. A pure
    function: the runner and the deadlock simulator in the tests execute the
    same plan."""
    return _PlanBuilder(schedules, chunks).build()


class _PlanBuilder:
    """Builds `communication_plan` by running every rank's batches under NCCL's rules.

    A rank issues its next batch once the current one completes; an operation
    is matched once the peer has posted its counterpart (the k-th send A→B
    and the k-th receive at B from A)."""

    def __init__(self, schedules: Sequence[Sequence[Action]], chunks: int) -> None:
        self.schedules, self.chunks, self.size = schedules, chunks, len(schedules)
        self.fifo = send_orders(schedules, chunks)
        self.sends: Counter[tuple[int, int]] = Counter()  # (source, destination) → posted
        self.recvs: Counter[tuple[int, int]] = Counter()
        self.batches: list[list[list[tuple[P2P, int]]]] = [[] for _ in schedules]
        self.received: list[set[Message]] = [set() for _ in schedules]

    def build(self) -> list[list[CommBatch]]:
        for rank in range(self.size):
            self._issue(rank)
        while not all(self._finished(rank) for rank in range(self.size)):
            if not self._advance() and not self._unblock_sends():
                raise ValueError(f"pipeline schedules deadlock: {self._blocked()}")
        return [[tuple(op for op, _ in batch) for batch in plan] for plan in self.batches]

    def _advance(self) -> bool:
        """Complete every batch that can complete, issuing the next ones; True if any did."""
        progressed = False
        for rank in range(self.size):
            while not self._finished(rank) and self._complete(rank):
                self._issue(rank)
                progressed = True
        return progressed

    def _unblock_sends(self) -> bool:
        """Every rank is blocked: receivers post the receives of the pending sends."""
        progressed = False
        for rank in range(self.size):
            for op, k in self.batches[rank][-1]:
                if op.send and not self._matched(rank, op, k):
                    if self._finished(op.peer):
                        raise ValueError(f"pipeline rank {op.peer} never receives {op.message}")
                    self._receive_through(op.peer, rank, k)
                    progressed = True
        return progressed

    def _issue(self, rank: int) -> None:
        """Open the rank's next batch: the previous action's send, the next action's input."""
        actions, point = self.schedules[rank], len(self.batches[rank])
        self.batches[rank].append([])
        if point > 0:
            made = sent_message(actions[point - 1], rank, self.size, self.chunks)
            if made is not None:
                self._post(rank, P2P(True, made.stage % self.size, made))
        if point < len(actions):
            needed = received_message(actions[point], rank, self.size, self.chunks)
            if needed is not None and needed not in self.received[rank]:
                source = message_source(needed, self.size)
                queue = self.fifo.get((source, rank), [])
                if needed not in queue:
                    raise ValueError(
                        f"pipeline rank {rank} needs {needed} but rank {source}'s schedule never "
                        "sends it; the ranks' schedules do not belong together"
                    )
                self._receive_through(rank, source, queue.index(needed))

    def _receive_through(self, rank: int, source: int, index: int) -> None:
        """Post, into the rank's open batch, the receives from `source` up to FIFO `index`."""
        queue = self.fifo[(source, rank)]
        while self.recvs[(source, rank)] <= index:
            message = queue[self.recvs[(source, rank)]]
            self._post(rank, P2P(False, source, message))
            self.received[rank].add(message)

    def _post(self, rank: int, op: P2P) -> None:
        counter, pair = (self.sends, (rank, op.peer)) if op.send else (self.recvs, (op.peer, rank))
        self.batches[rank][-1].append((op, counter[pair]))
        counter[pair] += 1

    def _matched(self, rank: int, op: P2P, k: int) -> bool:
        if op.send:
            return self.recvs[(rank, op.peer)] > k
        return self.sends[(op.peer, rank)] > k

    def _complete(self, rank: int) -> bool:
        return all(self._matched(rank, op, k) for op, k in self.batches[rank][-1])

    def _finished(self, rank: int) -> bool:
        return len(self.batches[rank]) == len(self.schedules[rank]) + 1 and self._complete(rank)

    def _blocked(self) -> str:
        return "; ".join(
            f"rank {rank} in batch {len(plan) - 1}: {[op for op, _ in plan[-1]]}"
            for rank, plan in enumerate(self.batches)
            if not self._finished(rank)
        )


def schedules_of_all_ranks(
    actions: Sequence[Action], rank: int, size: int, chunks: int, num_micro: int
) -> list[list[Action]]:
    """Every pipeline rank's action list, given this rank's (from `build_schedule`, possibly
    `forward_only`): what each rank needs to know its peers' send orders."""
    full = [build_schedule(num_micro, r, size, chunks) for r in range(size)]
    if list(actions) == full[rank]:
        return full
    forward = [forward_only(s) for s in full]
    if list(actions) == forward[rank]:
        return forward
    raise ValueError(
        f"run_schedule runs build_schedule's order (or its forward_only) for {num_micro} "
        f"micro-batches, {chunks} chunk(s) per rank; pipeline rank {rank} of {size} was given "
        "another order, so the other ranks' send order is unknown"
    )


# --- the runner ------------------------------------------------------------------------------


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


@functools.lru_cache(maxsize=16)
def _cached_plan(schedules: tuple[tuple[Action, ...], ...], chunks: int) -> list[list[CommBatch]]:
    """`communication_plan`, built once per schedule (every step of a run uses the same)."""
    return communication_plan(schedules, chunks)


class PipelineShapeError(PipelineConfigError):
    """A tensor to send does not have the run's fixed pipeline tensor shape."""


class _Exchange:
    """Executes one rank's communication batches over the pipeline group.

    `post` queues a tensor the next batch sends (checked against the fixed
    shape, cast to the wire dtype); `run` issues a batch and waits for it;
    `take` hands out a received buffer."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        tensor_shape: Sequence[int],
        dtype: torch.dtype,
        device: torch.device,
        where: str,
    ) -> None:
        self.group = group
        self.shape = tuple(tensor_shape)
        self.dtype, self.device, self.where = dtype, device, where
        self.guard = watchdog_mod.current()
        self.outbox: dict[Message, Tensor] = {}
        self.inbox: dict[Message, Tensor] = {}

    def post(self, message: Message, tensor: Tensor) -> None:
        if tuple(tensor.shape) != self.shape:
            raise PipelineShapeError(
                f"{self.where}: {message.kind} of micro-batch {message.micro} have shape "
                f"{tuple(tensor.shape)}, but the pipeline's tensor shape for this run is "
                f"{self.shape}; every micro-batch must have the same shape (variable sequence "
                "lengths are not supported with pipeline parallelism, as in Megatron without "
                "--variable-seq-lengths): pad or pack the data to one sequence length"
            )
        self.outbox[message] = tensor.detach().to(self.dtype).contiguous()

    def take(self, message: Message) -> Tensor:
        return self.inbox.pop(message)

    def run(self, batch: CommBatch) -> None:
        if not batch:
            return
        ops, received = [], {}
        for p2p in batch:
            peer = dist.get_global_rank(self.group, p2p.peer)
            if p2p.send:
                tensor = self.outbox.pop(p2p.message)
                ops.append(dist.P2POp(dist.isend, tensor, peer, self.group))
            else:
                tensor = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                received[p2p.message] = tensor
                ops.append(dist.P2POp(dist.irecv, tensor, peer, self.group))
            # what the message is, for diagnostics only (NCCL and gloo ignore it; the
            # strict test transport checks that both ends agree)
            ops[-1].message = (p2p.message.kind, p2p.message.stage, p2p.message.micro)
        description = self.describe(batch)
        with self.guard.operation(description):
            for work in dist.batch_isend_irecv(ops) or []:
                self.guard.wait(work, description)
        self.inbox.update(received)

    def describe(self, batch: CommBatch) -> str:
        """E.g. "pipeline stage 0 of 2: send activations of micro-batch 1 to rank 1, receive
        output gradient of micro-batch 0 from rank 1" (ranks are global)."""
        parts = []
        for p2p in batch:
            peer = dist.get_global_rank(self.group, p2p.peer)
            what = f"{p2p.message.kind} of micro-batch {p2p.message.micro}"
            parts.append(
                f"send {what} to rank {peer}" if p2p.send else f"receive {what} from rank {peer}"
            )
        return f"{self.where}: {', '.join(parts)}"


def _input_dtype(chunk: nn.Module, wire: torch.dtype) -> torch.dtype:
    """The dtype a chunk computes its hidden states in: its floating parameters' (the fp32
    residual stream under autocast), or the wire dtype for a chunk without any."""
    for p in chunk.parameters():
        if p.is_floating_point():
            return p.dtype
    return wire


def run_schedule(
    actions: Sequence[Action],
    chunks: Sequence[nn.Module],
    micro_batches: Sequence[Any],
    *,
    forward_step: ForwardStep,
    loss_func: LossFunc,
    group: dist.ProcessGroup,
    tensor_shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    device: torch.device,
    backward: bool = True,
    stage_name: str | None = None,
    backward_context: Callable[[int, int], contextlib.AbstractContextManager] | None = None,
) -> ScheduleResult:
    """Run `actions` (from `build_schedule`, or its `forward_only`) on this rank's `chunks`.

    Virtual stage c·P + r (chunk c of pipeline rank r) takes its input from the
    previous virtual stage, on rank r−1 (wrapping to P−1 with chunk c−1). The
    first virtual stage calls forward_step with input None; the last one calls
    loss_func on its output and backpropagates the returned loss (already
    scaled by the caller, e.g. divided by the number of micro-batches).
    Activations and gradients cross in `dtype` with the fixed `tensor_shape`
    (see the module doc). `backward_context(chunk, micro)` wraps each backward
    pass: a data-parallel wrapper's no-sync context for all but a chunk's last
    micro-batch lets its gradient reduction overlap the rest of the schedule."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    num_virtual = size * len(chunks)
    schedules = schedules_of_all_ranks(actions, rank, size, len(chunks), len(micro_batches))
    plan = _cached_plan(tuple(tuple(s) for s in schedules), len(chunks))[rank]
    where = stage_name or f"pipeline stage {rank} of {size}"
    exchange = _Exchange(group, tensor_shape, dtype, device, where)
    input_dtypes = [_input_dtype(chunk, dtype) for chunk in chunks]

    result = ScheduleResult(start=time.perf_counter())
    inputs: dict[tuple[int, int], Tensor | None] = {}
    outputs: dict[tuple[int, int], Tensor] = {}
    for i, action in enumerate(actions):
        exchange.run(plan[i])
        kind, c, micro = action
        needed = received_message(action, rank, size, len(chunks))
        outgoing = sent_message(action, rank, size, len(chunks))
        if kind == "F":
            # the received buffer is the autograd leaf: its .grad comes back in the wire dtype
            leaf = exchange.take(needed).requires_grad_(backward) if needed else None
            inp = leaf.to(input_dtypes[c]) if leaf is not None else None
            begin = time.perf_counter()
            out = forward_step(chunks[c], inp, micro_batches[micro])
            if c * size + rank == num_virtual - 1:
                out, terms = loss_func(out, micro_batches[micro])
                result.loss_terms.append(terms)
            result.trace.append(TraceEvent("F", c, micro, begin, time.perf_counter()))
            if outgoing is not None:
                exchange.post(outgoing, out)
            if backward:
                inputs[(c, micro)], outputs[(c, micro)] = leaf, out
        else:
            out, leaf = outputs.pop((c, micro)), inputs.pop((c, micro))
            grad = exchange.take(needed).to(out.dtype) if needed else None
            begin = time.perf_counter()
            with backward_context(c, micro) if backward_context else contextlib.nullcontext():
                torch.autograd.backward(out, grad_tensors=grad)
            result.trace.append(TraceEvent("B", c, micro, begin, time.perf_counter()))
            if outgoing is not None:
                exchange.post(outgoing, leaf.grad)
    exchange.run(plan[-1])
    result.end = time.perf_counter()
    return result
