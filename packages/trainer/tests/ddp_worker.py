"""Run by test_ddp.py as one rank (RANK/WORLD_SIZE set by the test).

Trains once per argv in the JSON list (one process group for all), and rank 0
dumps each run's losses.
"""

import json
import sys

import torch
import torch.distributed as dist

from mg.trainer.arguments import parse_args
from mg.trainer.distributed import read_world_size
from mg.trainer.training import Trainer

if __name__ == "__main__":
    out, argvs = sys.argv[1], json.loads(sys.argv[2])
    results = []
    for argv in argvs:
        trainer = Trainer(parse_args(argv, world_size=read_world_size()))
        seeds = [None] * trainer.env.world_size  # each rank's seed of its default generators
        if dist.is_initialized():
            dist.all_gather_object(seeds, torch.initial_seed())
        result = trainer.train()
        results.append(
            {
                "losses": result.losses,
                "grad_norms": result.grad_norms,
                "validation": result.validation,
                "extra_losses": result.extra_losses,
                "seeds": seeds,
            }
        )
    if trainer.env.rank == 0:
        with open(out, "w") as stream:
            json.dump(results, stream)
    # Tear the gloo group down before the interpreter does: left to exit, its
    # threads can abort the process ("terminate called without an active exception").
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
