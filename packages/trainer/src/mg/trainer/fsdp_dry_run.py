"""The FSDP lines of `mg-train gpt --dry-run`: what each rank holds at each sharding strategy.

Per GPU, for P parameters on the rank before data parallelism (its tensor-parallel
share) and S ranks a shard spans (DP × CP / --num-distributed-optimizer-instances;
1 at `no_shard`), c the bytes of the compute dtype (2 under --bf16, else 4):

| part | no_shard | optim, optim_grads | optim_grads_params |
| --- | --- | --- | --- |
| weights (fp32 shards) | 4P | 4P/S | 4P/S |
| gradients (fp32 shards) | 4P | 4P/S | 4P/S |
| optimizer state (Adam: 2 × fp32) | 8P | 8P/S | 8P/S |
| all-gather buffer | c·P | c·P | c·(root + k · largest unit) |

The all-gather buffer is what is gathered at the peak, between forward and backward
(`mg.core.parallel.fully_sharded`): every unit at `no_shard`, `optim` and
`optim_grads` (each is kept from its forward to its backward), the root unit and
the largest other unit (the untied embedding, or a layer; two of them when prefetching
the next one, k = 2) at `optim_grads_params`: an upper bound (a large layer's linear
layers are units inside its unit, gathered one at a time).
"""

from __future__ import annotations

import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.core.parallel.fully_sharded import STRATEGIES, units
from mg.trainer.arguments import Args

_MIB = 2**20


def unit_sizes(config: TransformerConfig) -> tuple[int, int, int]:
    """(all, root, largest other unit) parameter counts of the model's FSDP units, from
    the model built on the meta device."""
    with torch.device("meta"):
        model = GPTModel(config)
    total = sum(p.numel() for p in model.parameters())
    sizes = [sum(p.numel() for p in unit.parameters()) for unit in units(model)]
    return total, total - sum(sizes), max(sizes, default=0)


def per_rank_bytes(
    strategy: str,
    parameters: float,
    shard: int,
    compute_bytes: int,
    root: float,
    largest: float,
    *,
    prefetch: bool,
    optimizer_bytes: int = 8,
) -> dict[str, float]:
    """Weights, gradients, optimizer state and the all-gather buffer of one rank."""
    s = 1 if strategy == "no_shard" else shard
    if strategy == "optim_grads_params":
        gathered = root + (2 if prefetch else 1) * largest
    else:
        gathered = parameters
    return {
        "weights": 4 * parameters / s,
        "gradients": 4 * parameters / s,
        "optimizer state": optimizer_bytes * parameters / s,
        "all-gather buffer": compute_bytes * gathered,
    }


def fsdp_lines(args: Args, config: TransformerConfig, rank_parameters: int) -> list[str]:
    """The report's FSDP section (nothing without --use-megatron-fsdp/--use-torch-fsdp2)."""
    f, d, t = args.fsdp, args.distributed, args.training
    if not f.enabled:
        return []
    total, root, largest = unit_sizes(config)
    scale = rank_parameters / total  # this rank's tensor-parallel share of each unit
    data_ranks = args.data_parallel_size * d.context_parallel_size
    shard = max(data_ranks // f.num_distributed_optimizer_instances, 1)
    compute = 2 if (t.bf16 or t.fp16) else 4
    optimizer_bytes = 8 if args.optimizer.optimizer == "adam" else 4
    flag = "--use-torch-fsdp2" if f.use_torch_fsdp2 else "--use-megatron-fsdp"
    lines = [
        "",
        f"fully sharded data parallel ({flag}, {f.data_parallel_sharding_strategy}): "
        f"shards over {shard} ranks, {f.num_distributed_optimizer_instances} replica(s); "
        f"{config.num_layers} layer units + the root; gathered in "
        f"{'bf16' if t.bf16 else 'fp16' if t.fp16 else 'fp32'}"
        f"{', next layer prefetched' if d.overlap_param_gather else ''}",
        f"  {'strategy (MiB per GPU)':<24}{'weights':>10}{'grads':>10}{'optimizer':>10}"
        f"{'all-gather':>12}{'total':>10}",
    ]
    for strategy in STRATEGIES:
        parts = per_rank_bytes(
            strategy,
            rank_parameters,
            shard,
            compute,
            root * scale,
            largest * scale,
            prefetch=d.overlap_param_gather,
            optimizer_bytes=optimizer_bytes,
        )
        mark = " <" if strategy == f.data_parallel_sharding_strategy else ""
        lines.append(
            f"  {strategy:<24}"
            + "".join(
                f"{parts[k] / _MIB:>{12 if k == 'all-gather buffer' else 10}.1f}" for k in parts
            )
            + f"{sum(parts.values()) / _MIB:>10.1f}{mark}"
        )
    return lines
