"""save_checkpoint across real processes: gloo, torch.distributed.barrier, TP=2 x DP=2."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from mg.core.checkpoint import Layout, describe, load_checkpoint, read_latest_iteration

_RANK = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    from mg.core.checkpoint import mg_metadata, save_checkpoint
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    tp_rank, dp_rank = rank % 2, rank // 2          # 4 ranks: TP=2 x DP=2
    state = {"model": {"w": torch.full((4,), float(tp_rank))},
             "mg": mg_metadata({"hidden_size": 4}, None, tp=2, pp=1)}
    for iteration in (10, 20):
        save_checkpoint(
            sys.argv[1], iteration, state if dp_rank == 0 else None,
            tp_rank=tp_rank, tp_size=2, is_writer_of_latest=rank == 0, barrier=dist.barrier,
        )
    dist.destroy_process_group()
    """
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_four_ranks_gloo(tmp_path: Path) -> None:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    env["WORLD_SIZE"] = "4"
    procs = [
        subprocess.Popen([sys.executable, "-c", _RANK, str(tmp_path)], env={**env, "RANK": str(r)})
        for r in range(4)
    ]
    for proc in procs:
        assert proc.wait(timeout=240) == 0
    assert read_latest_iteration(tmp_path) == 20
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "iter_0000010",
        "iter_0000020",
        "latest_checkpointed_iteration.txt",
    ]
    assert describe(tmp_path).layout == Layout(tp=2, pp=1)
    for tp_rank in range(2):
        state, _ = load_checkpoint(tmp_path, tp_rank=tp_rank)
        assert torch.equal(state["model"]["w"], torch.full((4,), float(tp_rank)))
