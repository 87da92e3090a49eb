"""The strict transport refuses what only gloo runs: lone ops, tags, unbatched crossings, swaps.

One 2-rank gloo launch (this file is also the rank worker: `python
test_strict_p2p.py OUT_DIR`) checks, in order, that under
`mg.core.testing.strict_p2p`:

- `dist.isend` outside a batch raises, and a `P2POp` with a non-zero tag is refused;
- a batch that sends to and receives from the peer delivers, and is recorded;
- a receive posted out of the sender's order (two labelled messages, swapped)
  fails on the sending rank;
- the classic NCCL deadlock (each rank sends to the other in one batch, then
  receives in the next), which gloo alone completes, stops with an error
  after the transport's timeout. It runs last, on a group of its own: the
  unmatched sends stay pending.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from mg.core.testing.launch import launch_workers
from mg.core.testing.strict_p2p import StrictP2PError, install

DEADLOCK_TIMEOUT_S = 3.0


def _error(call) -> str | None:
    try:
        call()
    except StrictP2PError as err:
        return str(err)
    return None


def _exchange(rank: int, peer: int) -> torch.Tensor:
    """Each rank sends its stage's activations to the other and receives the other's."""
    out, into = torch.full((3,), float(rank + 1)), torch.zeros(3)
    ops = [dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]
    ops[0].message, ops[1].message = ("activations", peer, 0), ("activations", rank, 0)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return into


def _swapped(rank: int) -> str | None:
    """Rank 0 sends A then B; rank 1 posts its receives expecting B then A."""
    a, b = ("activations", 1, 0), ("output gradient", 1, 0)
    if rank == 0:
        ops = [dist.P2POp(dist.isend, torch.full((2,), float(i)), 1) for i in range(2)]
        labels = [a, b]
    else:
        ops = [dist.P2POp(dist.irecv, torch.zeros(2), 0) for _ in range(2)]
        labels = [b, a]
    for op, label in zip(ops, labels, strict=True):
        op.message = label
    return _error(lambda: [w.wait() for w in dist.batch_isend_irecv(ops)])


def _crossing_sends(rank: int, group: dist.ProcessGroup) -> str | None:
    """Send in one batch, receive in the next, on both ranks: NCCL deadlocks."""
    peer = 1 - rank

    def run() -> None:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(4), peer, group)])
        dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(4), peer, group)])

    return _error(run)


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, peer = dist.get_rank(), 1 - dist.get_rank()
    transport = install(timeout_s=DEADLOCK_TIMEOUT_S)
    isolated = dist.new_group([0, 1])
    result = {
        "lone": _error(lambda: dist.isend(torch.ones(1), peer)),
        "tag": _error(
            lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, torch.ones(1), peer, tag=7)])
        ),
        "exchanged": _exchange(rank, peer).tolist(),
        "swapped": _swapped(rank),
    }
    result["records"] = transport.dump()
    dist.barrier()
    result["crossing"] = _crossing_sends(rank, isolated)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # the deadlocked sends are still pending: skip the group's teardown


def test_strict_transport_refuses_gloo_only_behaviour(tmp_path: Path) -> None:
    launch_workers(__file__, 2, [str(tmp_path)], timeout=120)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, r in enumerate(ranks):
        assert "outside batch_isend_irecv" in r["lone"]
        assert "tag 7" in r["tag"]
        assert r["exchanged"] == [float(2 - rank)] * 3
        assert r["records"][:2] == [
            {"op": "send", "peer": 1 - rank, "shape": [3], "dtype": "torch.float32",
             "message": ["activations", 1 - rank, 0]},
            {"op": "recv", "peer": 1 - rank, "shape": [3], "dtype": "torch.float32",
             "message": ["activations", rank, 0]},
        ]  # fmt: skip
        assert "still incomplete" in r["crossing"], r["crossing"]
    assert "out of this rank's send order" in ranks[0]["swapped"]


if __name__ == "__main__":
    _worker(sys.argv[1])
