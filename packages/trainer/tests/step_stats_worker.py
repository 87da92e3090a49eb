"""Run by test_step_stats_parallel.py as one rank (RANK/WORLD_SIZE set by the test).

Trains once per argv in the JSON list with --log-params-norm --log-num-zeros-in-grad
and records, per iteration, what the trainer logged, every rank's value of it, and
references built from whole tensors (DTensor shards gathered): the parameters' norm
and the zeros of the gradients (where each rank holds them whole or as DTensors).
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.parallel.expert_optimizer import ExpertParallelDistributedOptimizer
from mg.core.parallel.pipeline_stage import is_shared_copy
from mg.trainer.arguments import parse_args
from mg.trainer.distributed import read_world_size
from mg.trainer.training import Trainer


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _record(trainer: Trainer, run: dict) -> None:
    # whole on every rank (DTensors gathered) with TP, DP and FSDP; a stage's or an
    # expert-parallel rank's own with PP or EP (compared with one process instead)
    params = [p for p in trainer.model.parameters() if not is_shared_copy(p)]
    norms = [_whole(p.detach()).double().norm() for p in params]
    norm = torch.linalg.vector_norm(torch.stack(norms))
    run["reference_norms"].append(float(norm))
    sharded = (DistributedOptimizer, ExpertParallelDistributedOptimizer)
    if not isinstance(trainer.optimizer, sharded):  # the gradients are whole here
        grads = [_whole(p.grad) for p in params if p.grad is not None]
        run["reference_zeros"].append(sum(int((g == 0).sum()) for g in grads))
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, (trainer.stats.params_norm, trainer.stats.num_zeros))
    run["per_rank"].append(ranks)
    run["params_norms"].append(trainer.stats.params_norm)
    run["num_zeros"].append(trainer.stats.num_zeros)


if __name__ == "__main__":
    out, argvs = sys.argv[1], json.loads(sys.argv[2])
    results = []
    for argv in argvs:
        trainer = Trainer(parse_args(argv, world_size=read_world_size()))
        run = {k: [] for k in ("reference_norms", "reference_zeros", "per_rank")}
        run |= {"params_norms": [], "num_zeros": []}
        result = trainer.train(on_iteration=lambda t, run=run: _record(t, run))
        results.append({**run, "losses": result.losses, "grad_norms": result.grad_norms})
    if trainer.env.rank == 0:
        with open(out, "w") as stream:
            json.dump(results, stream)
    if dist.is_initialized():  # torn down before the interpreter exits (gloo's threads)
        dist.barrier()
        dist.destroy_process_group()
