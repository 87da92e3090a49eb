"""Run by test_fsdp.py as one rank (RANK/WORLD_SIZE set by the test).

Trains once per argv in the JSON list (one process group for all); rank 0 dumps each
run's losses and grad norms, every rank's share of the parameters, and the FSDP units.
"""

import json
import sys

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from mg.trainer.arguments import parse_args
from mg.trainer.distributed import read_world_size
from mg.trainer.training import Trainer


def local_numel(model) -> int:
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


if __name__ == "__main__":
    out, argvs = sys.argv[1], json.loads(sys.argv[2])
    results = []
    for argv in argvs:
        trainer = Trainer(parse_args(argv, world_size=read_world_size()))
        model = trainer.model
        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        prefetching = sum(bool(m._get_fsdp_state()._states_to_forward_prefetch) for m in units)
        shares = [None] * trainer.env.world_size
        dist.all_gather_object(shares, local_numel(model))
        full = sum(p.numel() for p in model.parameters())
        result = trainer.train()
        results.append(
            {
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "validation": result.validation,
                "shares": shares,
                "numel": full,
                "units": len(units),
                "prefetching": prefetching,
                "tied_gradient": any(
                    getattr(m, "tied_gradient", None) is not None for m in model.modules()
                ),
                "vocab_shards": any(
                    getattr(m, "vocab_shards", None) is not None for m in model.modules()
                ),
            }
        )
    if trainer.env.rank == 0:
        with open(out, "w") as stream:
            json.dump(results, stream)
    # Tear the gloo group down before the interpreter does (see ddp_worker.py).
    dist.barrier()
    dist.destroy_process_group()
