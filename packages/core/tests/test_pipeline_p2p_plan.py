"""The pipeline's communication plan cannot deadlock on NCCL and delivers every message right.

A pure-Python model of NCCL point-to-point (no process, no torch.distributed):

- each rank issues its batches in order, one at a time, and blocks until the
  current batch completes; the operations of every batch it has issued so far
  count as posted;
- messages between an ordered pair of ranks match purely in issue order (no
  tags): the k-th send A→B is the k-th receive B posts from A;
- rendezvous: an operation completes only once the peer has posted its match,
  and a batch completes when all of its operations have.

`communication_plan` (the runner executes exactly this plan) is run through
the model for 1F1B and interleaved schedules, P = 2..8, v = 1..4, several
micro-batch counts, with backward passes and forward-only (evaluation); the
test asserts that every rank finishes and that every receive gets the
(kind, stage, micro-batch) message it expects. Two broken plans show that the
model catches what gloo would let through: each operation on its own (the
old runner's unbatched sends) deadlocks, receiving each message only when it
is needed deadlocks at P=2 interleaved, and receives posted in a fixed order
instead of the peer's send order get each other's messages at P=2.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest

from mg.core.parallel.pipeline_schedule import (
    ACTIVATION,
    GRADIENT,
    P2P,
    Action,
    CommBatch,
    Message,
    build_schedule,
    communication_plan,
    forward_only,
    schedules_of_all_ranks,
)


class Deadlock(AssertionError):
    """No rank's current batch can complete."""


def simulate(plans: Sequence[Sequence[CommBatch]]) -> list[tuple[int, int, Message, Message]]:
    """Run every rank's batches under NCCL's rules; raises `Deadlock`.

    Returns each matched pair as (source, destination, message sent, message
    the receive expected)."""
    size = len(plans)
    ordinal = [_ordinals(plan) for plan in plans]
    cumulative = [_cumulative(plan) for plan in plans]
    cursor = [0] * size

    def posted(rank: int, send: bool, peer: int) -> int:
        """Operations of this kind that `rank` has issued (its current batch included)."""
        upto = min(cursor[rank], len(plans[rank]) - 1)
        return cumulative[rank][upto][(send, peer)] if plans[rank] else 0

    def completes(rank: int) -> bool:
        batch = plans[rank][cursor[rank]]
        return all(
            posted(op.peer, not op.send, rank) > k
            for op, k in zip(batch, ordinal[rank][cursor[rank]], strict=True)
        )

    progressed = True
    while progressed:
        progressed = False
        for rank in range(size):
            while cursor[rank] < len(plans[rank]) and completes(rank):
                cursor[rank] += 1
                progressed = True
    stuck = [r for r in range(size) if cursor[r] < len(plans[r])]
    if stuck:
        raise Deadlock(
            "; ".join(
                f"rank {r} blocked in batch {cursor[r]}: {plans[r][cursor[r]]}" for r in stuck
            )
        )
    return _matches(plans)


def _ordinals(plan: Sequence[CommBatch]) -> list[list[int]]:
    """Each operation's index among its rank's operations of its direction and peer."""
    seen: Counter = Counter()
    out = []
    for batch in plan:
        out.append([])
        for op in batch:
            out[-1].append(seen[(op.send, op.peer)])
            seen[(op.send, op.peer)] += 1
    return out


def _cumulative(plan: Sequence[CommBatch]) -> list[Counter]:
    """After batch b: how many operations of each (send, peer) batches 0..b hold."""
    out, running = [], Counter()
    for batch in plan:
        running = running + Counter((op.send, op.peer) for op in batch)
        out.append(running)
    return out


def _matches(plans: Sequence[Sequence[CommBatch]]) -> list[tuple[int, int, Message, Message]]:
    """Pair the k-th send A→B with the k-th receive at B from A."""
    pairs = []
    for src, plan in enumerate(plans):
        for dst in range(len(plans)):
            sent = [op.message for batch in plan for op in batch if op.send and op.peer == dst]
            expected = [
                op.message for batch in plans[dst] for op in batch if not op.send and op.peer == src
            ]
            assert len(sent) == len(expected), (src, dst, sent, expected)
            pairs += [(src, dst, s, e) for s, e in zip(sent, expected, strict=True)]
    return pairs


def _io(action: Action, rank: int, size: int, chunks: int) -> tuple[Message | None, ...]:
    """(message the action needs, message it produces), from the stage arithmetic alone."""
    kind, chunk, micro = action
    stage, last = chunk * size + rank, size * chunks - 1
    if kind == "F":
        need = Message(ACTIVATION, stage, micro) if stage > 0 else None
        make = Message(ACTIVATION, stage + 1, micro) if stage < last else None
    else:
        need = Message(GRADIENT, stage, micro) if stage < last else None
        make = Message(GRADIENT, stage - 1, micro) if stage > 0 else None
    return need, make


def check_plan_serves_schedule(
    schedules: Sequence[Sequence[Action]], plans: Sequence[Sequence[CommBatch]], chunks: int
) -> None:
    """Batch i sends what action i−1 made (to the right rank) and has delivered what action
    i needs; nothing is received twice or left over."""
    size = len(schedules)
    for rank, (actions, plan) in enumerate(zip(schedules, plans, strict=True)):
        assert len(plan) == len(actions) + 1
        inbox: set[Message] = set()
        for i, batch in enumerate(plan):
            made = _io(actions[i - 1], rank, size, chunks)[1] if i > 0 else None
            sends = [op for op in batch if op.send]
            assert sends == ([P2P(True, made.stage % size, made)] if made else []), (rank, i)
            for op in batch:
                if not op.send:
                    assert op.message not in inbox, (rank, i, op)
                    assert op.message.stage % size == rank, (rank, i, op)
                    inbox.add(op.message)
            if i < len(actions):
                need = _io(actions[i], rank, size, chunks)[0]
                if need is not None:
                    assert need in inbox, (rank, i, actions[i], need)
                    inbox.remove(need)
        assert not inbox, (rank, inbox)


def _cases(size: int, chunks: int) -> list[int]:
    """Micro-batch counts: interleaving needs multiples of P; 1F1B also fewer than P."""
    if chunks > 1:
        return [size, 2 * size, 3 * size]
    return sorted({1, 2, size - 1, size, size + 1, 2 * size + 3} - {0})


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
@pytest.mark.parametrize("size", range(2, 9))
def test_plan_is_deadlock_free_and_fifo_correct_under_nccl_rules(size: int, chunks: int) -> None:
    for num_micro in _cases(size, chunks):
        full = [build_schedule(num_micro, r, size, chunks) for r in range(size)]
        for schedules in (full, [forward_only(s) for s in full]):
            plans = communication_plan(schedules, chunks)
            check_plan_serves_schedule(schedules, plans, chunks)
            for src, dst, sent, expected in simulate(plans):
                assert sent == expected, (size, chunks, num_micro, src, dst, sent, expected)
                assert sent.stage % size == dst


def test_every_rank_recovers_the_others_schedules() -> None:
    full = [build_schedule(4, r, 2, 2) for r in range(2)]
    assert schedules_of_all_ranks(full[1], 1, 2, 2, 4) == full
    forward = [forward_only(s) for s in full]
    assert schedules_of_all_ranks(forward[0], 0, 2, 2, 4) == forward
    with pytest.raises(ValueError, match="another order"):
        schedules_of_all_ranks(list(reversed(full[0])), 0, 2, 2, 4)


def test_unbatched_operations_deadlock_in_the_model() -> None:
    """Each send and receive on its own, sends first (the old runner's isend/irecv, had it
    been run on NCCL's rendezvous): 1F1B at P=2 deadlocks in its steady state."""
    schedules = [build_schedule(4, r, 2) for r in range(2)]
    plans = communication_plan(schedules, 1)
    split = [
        [(op,) for batch in plan for op in sorted(batch, key=lambda op: not op.send)]
        for plan in plans
    ]
    with pytest.raises(Deadlock):
        simulate(split)


def test_receiving_only_when_needed_deadlocks_at_p2_interleaved() -> None:
    """Each batch with just the previous action's send and the next action's input (no early
    receives): at P=2 with two chunks both ranks send a gradient the other needs only later,
    and each waits for the other to post its receive."""
    size, chunks = 2, 2
    schedules = [build_schedule(4, r, size, chunks) for r in range(size)]
    lazy = []
    for rank, actions in enumerate(schedules):
        plan = []
        for i in range(len(actions) + 1):
            made = _io(actions[i - 1], rank, size, chunks)[1] if i > 0 else None
            need = _io(actions[i], rank, size, chunks)[0] if i < len(actions) else None
            batch = [P2P(True, made.stage % size, made)] if made else []
            if need is not None:
                source = rank - 1 if need.kind == ACTIVATION else rank + 1
                batch.append(P2P(False, source % size, need))
            plan.append(tuple(batch))
        lazy.append(plan)
    with pytest.raises(Deadlock):
        simulate(lazy)


def test_receives_out_of_send_order_get_the_wrong_messages_at_p2() -> None:
    """At P=2 the previous and the next rank are the same peer, so one batch can receive an
    activation and a gradient from it. Posting them in a fixed order (gradients first, as a
    recv-next-before-recv-prev exchange would) instead of the peer's send order pairs each
    receive with the other message: it completes, silently wrong."""
    size, chunks = 2, 2
    schedules = [build_schedule(6, r, size, chunks) for r in range(size)]
    plans = communication_plan(schedules, chunks)
    assert any(sum(not op.send for op in batch) > 1 for plan in plans for batch in plan)
    fixed_order = [
        [
            tuple(sorted(batch, key=lambda op: (not op.send, op.message.kind != GRADIENT)))
            for batch in plan
        ]
        for plan in plans
    ]
    pairs = simulate(fixed_order)
    assert any(sent != expected for _, _, sent, expected in pairs)


def test_a_tensor_of_another_shape_is_refused_before_it_is_sent() -> None:
    """Receive buffers have the run's one shape: a different sequence length must not go out
    (NCCL would deliver a truncated or overrunning message without complaint)."""
    import torch

    from mg.core.parallel.pipeline_schedule import PipelineShapeError, _Exchange

    exchange = _Exchange(None, (2, 16, 8), torch.bfloat16, torch.device("cpu"), "stage 0 of 2")
    exchange.post(Message(ACTIVATION, 1, 0), torch.zeros(2, 16, 8))
    assert exchange.outbox[Message(ACTIVATION, 1, 0)].dtype == torch.bfloat16
    with pytest.raises(PipelineShapeError, match=r"shape \(2, 12, 8\).*\(2, 16, 8\)"):
        exchange.post(Message(ACTIVATION, 1, 1), torch.zeros(2, 12, 8))
