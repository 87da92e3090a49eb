"""Run by test_pp_strict_p2p.py as one rank (RANK/WORLD_SIZE set by the test).

Joins the gloo process group, installs `mg.core.testing.strict_p2p` (NCCL's
point-to-point rules: batches only, no tags, rendezvous, per-message header
check), then trains once per argv in the JSON list. Every rank writes
`OUT_DIR/rank<R>.json`: each run's losses and grad norms, and what crossed
between ranks (operation, message kind, dtype, shape, how many).
"""

import json
import sys
from collections import Counter
from pathlib import Path

import torch.distributed as dist

from mg.core.testing.strict_p2p import P2PRecord, install
from mg.trainer.arguments import parse_args
from mg.trainer.distributed import read_world_size
from mg.trainer.training import Trainer


def crossings(records: list[P2PRecord]) -> list[dict]:
    """Distinct (op, kind, dtype, shape) of the records, with counts."""
    counts = Counter((r.op, r.message[0] if r.message else None, r.dtype, r.shape) for r in records)
    return [
        {"op": op, "kind": kind, "dtype": dtype, "shape": list(shape), "count": n}
        for (op, kind, dtype, shape), n in sorted(counts.items(), key=str)
    ]


if __name__ == "__main__":
    out, argvs = Path(sys.argv[1]), json.loads(sys.argv[2])
    dist.init_process_group("gloo")
    transport = install(timeout_s=60.0)
    results = []
    for argv in argvs:
        first = len(transport.records)
        result = Trainer(parse_args(argv, world_size=read_world_size())).train()
        results.append(
            {
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "p2p": crossings(transport.records[first:]),
            }
        )
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(results))
    # Tear the gloo groups down before the interpreter does (see ddp_worker.py).
    dist.barrier()
    transport.uninstall()
    dist.destroy_process_group()
