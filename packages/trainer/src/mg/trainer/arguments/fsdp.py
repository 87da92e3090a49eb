"""Megatron's fully sharded data-parallel flags: which FSDP, what it shards, in what dtypes.

`--use-megatron-fsdp` and `--use-torch-fsdp2` are two names for one implementation
here, PyTorch's FSDP2 (`mg.core.parallel.fully_sharded`); each keeps the rules
Megatron gives its flag (combinations.py). `--data-parallel-sharding-strategy`
says what is sharded over the data-parallel ranks, with Megatron's names:

| strategy | sharded |
| --- | --- |
| `no_shard` | nothing (every rank holds everything, as DDP) |
| `optim` | the optimizer state |
| `optim_grads` | the optimizer state and the gradients |
| `optim_grads_params` | the optimizer state, the gradients and the parameters (ZeRO-3) |

As in Megatron, `optim_grads` turns on `--overlap-grad-reduce` and
`optim_grads_params` also `--overlap-param-gather`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
DTYPES = ("fp32", "bf16", "fp16", "auto")


@dataclass
class FullyShardedArgs:
    """Fully sharded data parallelism (FSDP) and its precision."""

    use_megatron_fsdp: bool = False
    use_torch_fsdp2: bool = False
    data_parallel_sharding_strategy: str | None = None
    """None until `finalize_fsdp`: optim_grads_params under --use-torch-fsdp2, else no_shard."""
    num_distributed_optimizer_instances: int = 1
    outer_dp_sharding_strategy: str = "no_shard"
    megatron_fsdp_main_params_dtype: str = "fp32"
    megatron_fsdp_main_grads_dtype: str = "auto"
    megatron_fsdp_grad_comm_dtype: str = "auto"
    fsdp_double_buffer: bool = False
    use_nccl_ub: bool = False
    fsdp_manual_registration: bool = False

    @property
    def enabled(self) -> bool:
        return self.use_megatron_fsdp or self.use_torch_fsdp2


def add_fsdp_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--use-megatron-fsdp",
        action="store_true",
        help="Fully sharded data parallelism (PyTorch FSDP2 underneath): one unit per "
        "transformer layer plus the embedding and the output layer; what is sharded is "
        "--data-parallel-sharding-strategy. Needs --ckpt-format fsdp_dtensor.",
    )
    p.add_argument(
        "--use-torch-fsdp2",
        action="store_true",
        help="PyTorch's FSDP2 (the same implementation as --use-megatron-fsdp, with "
        "Megatron's rules for this flag: untied embeddings, no pipeline or expert "
        "parallelism, no --use-distributed-optimizer, no --fp16).",
    )
    p.add_argument(
        "--data-parallel-sharding-strategy",
        choices=STRATEGIES,
        help="With FSDP, what is sharded over data-parallel ranks: nothing, the optimizer "
        "state, also the gradients, also the parameters. Default: no_shard, and "
        "optim_grads_params under --use-torch-fsdp2 (Megatron's torch FSDP2 shards all).",
    )
    p.add_argument(
        "--num-distributed-optimizer-instances",
        type=int,
        default=1,
        help="With FSDP: shard within groups of DP / this many ranks and replicate across "
        "the groups (hybrid sharding, HSDP).",
    )
    p.add_argument(
        "--outer-dp-sharding-strategy",
        default="no_shard",
        choices=["no_shard", "optim"],
        help="With --num-distributed-optimizer-instances > 1: what is sharded across the "
        "instances (no_shard: they are replicas).",
    )
    p.add_argument(
        "--megatron-fsdp-main-params-dtype",
        default="fp32",
        choices=DTYPES,
        help="The dtype of the sharded parameters the optimizer updates.",
    )
    p.add_argument(
        "--megatron-fsdp-main-grads-dtype",
        default="auto",
        choices=DTYPES,
        help="The dtype gradients are accumulated in over micro-batches (auto: fp32, or the "
        "parameters' compute dtype with --grad-reduce-in-bf16).",
    )
    p.add_argument(
        "--megatron-fsdp-grad-comm-dtype",
        default="auto",
        choices=DTYPES,
        help="The dtype gradients are reduce-scattered in (auto: as the main grads).",
    )

    p.add_argument(
        "--fsdp-double-buffer",
        action="store_true",
        help="Accepted for Megatron FSDP's recipes: FSDP2 allocates each unit's all-gather "
        "and reduce-scatter buffers itself, two units' at a time when prefetching.",
    )
    p.add_argument(
        "--use-nccl-ub",
        action="store_true",
        help="Accepted for Megatron FSDP's recipes: FSDP2's collectives use PyTorch's own "
        "NCCL buffers (no user-buffer registration).",
    )
    p.add_argument(
        "--fsdp-manual-registration",
        action="store_true",
        help="Accepted with --use-nccl-ub (see there).",
    )


def finalize_fsdp(args: Args) -> None:
    """Megatron's: sharding the gradients overlaps their reduction with backward, sharding
    the parameters also their gathering with forward."""
    f, d = args.fsdp, args.distributed
    if f.data_parallel_sharding_strategy is None:
        f.data_parallel_sharding_strategy = (
            "optim_grads_params" if f.use_torch_fsdp2 else "no_shard"
        )
    if not f.enabled:
        return
    if f.data_parallel_sharding_strategy in ("optim_grads", "optim_grads_params"):
        d.overlap_grad_reduce = True
    if f.data_parallel_sharding_strategy == "optim_grads_params":
        d.overlap_param_gather = True


def check_fsdp(args: Args) -> None:
    """One flag's values; pairs of flags are combinations.py's rows."""
    f = args.fsdp
    instances = f.num_distributed_optimizer_instances
    if instances < 1:
        fail(f"--num-distributed-optimizer-instances must be >= 1, got {instances}")
    if not f.enabled:
        return
    if f.megatron_fsdp_main_params_dtype != "fp32":
        fail(
            f"--megatron-fsdp-main-params-dtype {f.megatron_fsdp_main_params_dtype}: mg-train "
            "keeps the sharded main parameters in fp32; give fp32 or drop the flag"
        )
    if f.outer_dp_sharding_strategy != "no_shard":
        fail(
            f"--outer-dp-sharding-strategy {f.outer_dp_sharding_strategy}: mg-train replicates "
            "across --num-distributed-optimizer-instances (no_shard); give no_shard or drop it"
        )
    dp = args.data_parallel_size * args.distributed.context_parallel_size
    if not args.training.dry_run and dp % instances:
        fail(
            f"--num-distributed-optimizer-instances ({instances}) must divide the data-parallel "
            f"(x context-parallel) size ({dp})"
        )
    grads = f.megatron_fsdp_main_grads_dtype
    comm = f.megatron_fsdp_grad_comm_dtype
    if grads in ("bf16", "fp16") and comm not in ("auto", grads):
        fail(
            f"--megatron-fsdp-grad-comm-dtype {comm} with --megatron-fsdp-main-grads-dtype "
            f"{grads}: FSDP2 reduces in the dtype it accumulates in; give the same dtype or auto"
        )


def fsdp_dtypes(args: Args) -> tuple[str | None, str | None]:
    """(compute, reduce) dtype names for FSDP's mixed precision: parameters are gathered
    and computed in --bf16 / --fp16's dtype; gradients are reduce-scattered (and summed
    over micro-batches) in fp32, or in bf16 under --grad-reduce-in-bf16 or the
    --megatron-fsdp-*-dtype flags. None: the parameters' own dtype (fp32)."""
    f, t = args.fsdp, args.training
    compute = "bf16" if t.bf16 else "fp16" if t.fp16 else None
    grads = f.megatron_fsdp_main_grads_dtype
    reduce = f.megatron_fsdp_grad_comm_dtype
    if reduce == "auto":
        reduce = grads
    if reduce == "auto":
        reduce = "bf16" if args.distributed.grad_reduce_in_bf16 else "fp32"
    if compute is None and reduce == "fp32":
        reduce = None
    return compute, reduce
