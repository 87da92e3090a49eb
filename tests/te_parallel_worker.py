"""Run by test_te_parallel_training.py as one rank: mg-train once per argv of a JSON list, with
the stand-in Transformer Engine (mg.core.testing.te_standin) installed, so that
`--transformer-impl transformer_engine` runs TE's API, collectives included, on the CPU.
Rank 0 writes each run's losses to OUT."""

import json
import sys

import pytest
import torch.distributed as dist

from mg.core.testing import te_standin
from mg.trainer.arguments import parse_args
from mg.trainer.distributed import read_world_size
from mg.trainer.training import Trainer

if __name__ == "__main__":
    out, argvs = sys.argv[1], json.loads(sys.argv[2])
    losses, rank = [], 0
    with pytest.MonkeyPatch.context() as patch:
        te_standin.install(patch)
        for argv in argvs:
            trainer = Trainer(parse_args(argv, world_size=read_world_size()))
            rank = trainer.env.rank
            losses.append(trainer.train().losses)
    if rank == 0:
        with open(out, "w") as stream:
            json.dump(losses, stream)
    if dist.is_initialized():  # torn down before the interpreter exits (gloo's threads)
        dist.barrier()
        dist.destroy_process_group()
