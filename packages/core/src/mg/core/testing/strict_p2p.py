"""A point-to-point transport for multi-rank tests that enforces NCCL's rules on gloo.

gloo is forgiving where NCCL is not: it matches messages by tag, and a send
completes without the peer having posted its receive. Code that relies on
either runs on the CPU test ranks and hangs or mixes up tensors on GPUs.
`install()` patches `torch.distributed` in this process so that:

- `send`, `recv`, `isend` and `irecv` called directly raise: every exchange
  must be a `batch_isend_irecv` (Megatron's pattern; lone ops issued in the
  wrong order deadlock on NCCL);
- `batch_isend_irecv` refuses a `P2POp` with a non-zero tag (NCCL ignores
  tags and matches a pair's messages in issue order only);
- a batch is a rendezvous and blocks like an NCCL group: it returns only when
  each of its receives has its data and each of its sends has been received
  by the peer. After the real operations (tag 0) go out on the data group,
  each completed receive sends a small acknowledgement to its source over a
  separate gloo group, and each send waits for its acknowledgement. An order
  that would deadlock on NCCL then hangs here, and after `timeout_s` the
  batch raises an error naming what it waits for;
- the acknowledgement carries what the receive expected (the `message`
  label the pipeline runner attaches to its ops, the element count and
  dtype), and the sender checks it against what it sent: a receive posted
  out of the peer's send order fails at once instead of training on the
  wrong tensor.

Every operation is recorded (direction, peer, shape, dtype, label) in
`StrictP2P.records`, so a test can assert what crossed, e.g. that pipeline
activations travel in bf16. Never installed in production code paths: test
workers call `install()` right after `init_process_group` (it is collective:
every rank must call it, in the same order as other group creations).
"""

from __future__ import annotations

import contextlib
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

_PATCHED = ("send", "recv", "isend", "irecv", "batch_isend_irecv")
_NO_LABEL = -1


class StrictP2PError(RuntimeError):
    """A point-to-point use that NCCL would not run as intended (or a timed-out batch)."""


@dataclass
class P2PRecord:
    """One operation of a batch, as this rank issued it (peer is a global rank)."""

    op: str
    peer: int
    shape: tuple[int, ...]
    dtype: str
    message: tuple | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "op": self.op,
            "peer": self.peer,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "message": list(self.message) if self.message is not None else None,
        }


class _Waiter:
    """Waits for a gloo work on a daemon thread, so the batch can acknowledge receives in
    whatever order they complete (gloo's `is_completed` stays False until someone waits)
    and a hung peer does not block the interpreter's exit."""

    def __init__(self, work: dist.Work, changed: threading.Event) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._changed = changed
        threading.Thread(target=self._run, args=(work,), daemon=True).start()

    def _run(self, work: dist.Work) -> None:
        try:
            work.wait()
        except BaseException as err:  # re-raised on the batch's thread
            self.error = err
        finally:
            self.done.set()
            self._changed.set()

    def result(self) -> None:
        if self.error is not None:
            raise self.error


class _Done:
    """The work object a strict batch returns: it has already completed."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _code(text: str) -> int:
    """A stable small integer for a string (the same on every rank)."""
    return zlib.crc32(text.encode()) & 0x3FFFFFFF


@dataclass
class StrictP2P:
    """The installed transport: the patched functions' state and the record of operations."""

    timeout_s: float
    ack_group: dist.ProcessGroup
    originals: dict[str, Callable]
    records: list[P2PRecord] = field(default_factory=list)
    stand_ins: dict[str, Callable] = field(default_factory=dict)

    # --- the patched functions ---------------------------------------------------------------

    @staticmethod
    def lone_op(name: str) -> Callable:
        """A stand-in that raises: `P2POp(dist.isend, …)` still accepts it as the op."""

        def refuse(*args: Any, **kwargs: Any) -> None:
            raise StrictP2PError(
                f"torch.distributed.{name} outside batch_isend_irecv: on NCCL a lone "
                "send/receive is a rendezvous issued in order, so two ranks that send to "
                "each other before receiving deadlock; put each exchange in one batch"
            )

        refuse.__name__ = refuse.__qualname__ = name
        return refuse

    def batch_isend_irecv(self, ops: list[dist.P2POp]) -> list[_Done]:
        self._check(ops)
        self.records += [self._record(op) for op in ops]
        tag = self._ack_tag(ops[0].group)
        data = [self._issue(op) for op in ops]
        sends = [op for op in ops if self._is_send(op)]
        recvs = [(op, w) for op, w in zip(ops, data, strict=True) if not self._is_send(op)]
        expected = [self._ack_buffer() for _ in sends]
        acks = [
            self.originals["irecv"](buf, src=op.peer, group=self.ack_group, tag=tag)
            for op, buf in zip(sends, expected, strict=True)
        ]
        self._acknowledge([op for op, _ in recvs], [w for _, w in recvs], tag)
        self._await(acks, [f"acknowledgement of a send to rank {op.peer}" for op in sends])
        for op, buf in zip(sends, expected, strict=True):
            self._verify(op, buf)
        for op, work in zip(ops, data, strict=True):
            if self._is_send(op):  # receives were waited once already; gloo's wait is not
                work.wait()  # idempotent (a second one waits for another message)
        return [_Done() for _ in ops]

    # --- one batch ---------------------------------------------------------------------------

    def _is_send(self, op: dist.P2POp) -> bool:
        return op.op in (self.originals["isend"], self.stand_ins["isend"])

    def _check(self, ops: list[dist.P2POp]) -> None:
        if not isinstance(ops, list) or not ops:
            raise StrictP2PError("batch_isend_irecv needs a non-empty list of P2POp")
        for op in ops:
            if op.tag != 0:
                raise StrictP2PError(
                    f"P2POp with tag {op.tag} (peer {op.peer}): NCCL ignores tags and matches "
                    "a pair's messages in issue order only; use tag 0 and post receives in "
                    "the peer's send order"
                )
            if op.group is not ops[0].group:
                raise StrictP2PError("all operations of one batch must use the same group")

    def _record(self, op: dist.P2POp) -> P2PRecord:
        message = getattr(op, "message", None)
        return P2PRecord(
            "send" if self._is_send(op) else "recv",
            op.peer,
            tuple(op.tensor.shape),
            str(op.tensor.dtype),
            tuple(message) if message is not None else None,
        )

    def _issue(self, op: dist.P2POp) -> dist.Work:
        if self._is_send(op):
            return self.originals["isend"](op.tensor, dst=op.peer, group=op.group)
        return self.originals["irecv"](op.tensor, src=op.peer, group=op.group)

    @staticmethod
    def _ack_buffer() -> torch.Tensor:
        return torch.zeros(5, dtype=torch.int64)

    def _ack_tag(self, group: dist.ProcessGroup) -> int:
        """One acknowledgement channel per data group (a pair of ranks may share several)."""
        return _code(repr(dist.get_process_group_ranks(group))) % (1 << 20)

    def _header(self, op: dist.P2POp) -> torch.Tensor:
        """(kind, stage, micro, numel, dtype) of an operation, as the acknowledgement carries."""
        message = getattr(op, "message", None)
        label = (
            [_code(str(message[0])), int(message[1]), int(message[2])]
            if message is not None
            else [_NO_LABEL] * 3
        )
        return torch.tensor(
            [*label, op.tensor.numel(), _code(str(op.tensor.dtype))], dtype=torch.int64
        )

    def _acknowledge(self, recvs: list[dist.P2POp], works: list[dist.Work], tag: int) -> None:
        """Send each receive's acknowledgement once its data is in, in order per source."""
        changed = threading.Event()
        waiters = [_Waiter(work, changed) for work in works]
        acked = [False] * len(recvs)
        outgoing: list[tuple[dist.Work, torch.Tensor]] = []
        deadline = time.monotonic() + self.timeout_s
        while True:
            changed.clear()
            for i, (op, waiter) in enumerate(zip(recvs, waiters, strict=True)):
                earlier = [acked[j] for j in range(i) if recvs[j].peer == op.peer]
                if not acked[i] and waiter.done.is_set() and all(earlier):
                    waiter.result()  # a peer that died raises here
                    header = self._header(op)
                    work = self.originals["isend"](
                        header, dst=op.peer, group=self.ack_group, tag=tag
                    )
                    outgoing.append((work, header))
                    acked[i] = True
            if all(acked):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                self._timed_out(
                    [
                        f"data from rank {op.peer}"
                        for op, a in zip(recvs, acked, strict=True)
                        if not a
                    ]
                )
            changed.wait(min(left, 1.0))
        for work, _ in outgoing:
            work.wait()

    def _await(self, works: list[dist.Work], names: list[str]) -> None:
        waiters = [_Waiter(work, threading.Event()) for work in works]
        deadline = time.monotonic() + self.timeout_s
        for waiter in waiters:
            waiter.done.wait(max(deadline - time.monotonic(), 0.0))
        pending = [name for name, w in zip(names, waiters, strict=True) if not w.done.is_set()]
        if pending:
            self._timed_out(pending)
        for waiter in waiters:
            waiter.result()

    def _timed_out(self, waiting: list[str]) -> None:
        raise StrictP2PError(
            f"strict p2p batch still incomplete after {self.timeout_s:g} s, waiting for "
            f"{', '.join(waiting)}: on NCCL this order deadlocks (a send completes only once "
            "the peer posts the matching receive, and batches run in issue order)"
        )

    def _verify(self, op: dist.P2POp, ack: torch.Tensor) -> None:
        """The peer's receive expected what this send carried."""
        sent = self._header(op)
        labelled = sent[0] != _NO_LABEL and ack[0] != _NO_LABEL
        same_label = not labelled or torch.equal(sent[:3], ack[:3])
        if not same_label or not torch.equal(sent[3:], ack[3:]):
            raise StrictP2PError(
                f"send to rank {op.peer} of {getattr(op, 'message', None)} "
                f"({op.tensor.numel()} x {op.tensor.dtype}) was matched by a receive that "
                "expected another message (header [kind code, stage, micro, numel, dtype code] "
                f"{ack.tolist()}, sent {sent.tolist()}): the receiver posts its receives out "
                "of this rank's send order"
            )

    # --- installation ------------------------------------------------------------------------

    def patch(self) -> None:
        """One stand-in object per name in both modules: `P2POp` checks the op against
        `distributed_c10d`'s, callers pass `torch.distributed`'s."""
        self.stand_ins = {name: self.lone_op(name) for name in ("send", "recv", "isend", "irecv")}
        self.stand_ins["batch_isend_irecv"] = self.batch_isend_irecv
        for module in (dist, c10d):
            for name, function in self.stand_ins.items():
                setattr(module, name, function)

    def uninstall(self) -> None:
        """Put the real functions back (the acknowledgement group stays)."""
        for module in (dist, c10d):
            for name in _PATCHED:
                setattr(module, name, self.originals[name])

    def dump(self) -> list[dict[str, Any]]:
        return [r.as_dict() for r in self.records]


def install(timeout_s: float = 60.0) -> StrictP2P:
    """Patch torch.distributed in this process (collective: creates a gloo group)."""
    if not dist.is_initialized():
        raise StrictP2PError("install() needs an initialised default process group")
    ack_group = dist.new_group(backend="gloo")
    transport = StrictP2P(timeout_s, ack_group, {name: getattr(c10d, name) for name in _PATCHED})
    transport.patch()
    return transport


@contextlib.contextmanager
def strict_p2p(timeout_s: float = 60.0) -> Iterator[StrictP2P]:
    """`install()` for the duration of a block."""
    transport = install(timeout_s)
    try:
        yield transport
    finally:
        transport.uninstall()
