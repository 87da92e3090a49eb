"""Megatron's distributed flags: the parallel layout (TP, PP, VPP, CP, DP) and its rules.

Checked before any process group exists, from the world size torchrun gives.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class DistributedArgs:
    """The parallel layout and how gradients and parameters travel between ranks."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    context_parallel_size: int = 1
    distributed_timeout_minutes: float = 10.0
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    distributed_backend: str | None = None
    ddp_bucket_size: int | None = None
    grad_reduce_in_bf16: bool = False
    cp_comm_type: list[str] = field(default_factory=lambda: ["p2p"])
    tp_comm_overlap: bool = False
    # Filled from the torchrun environment, not from flags.
    world_size: int = 1


NOT_FLAGS = {"world_size"}


def add_parallel_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Split attention heads, MLP and vocabulary over this many ranks.",
    )
    p.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline stages (Megatron's 1F1B schedule); layers are split evenly.",
    )
    p.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        help="Layers per model chunk: interleaved 1F1B with several chunks per pipeline rank.",
    )
    p.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Split each sequence over this many ranks (causal ring attention).",
    )
    p.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="A distributed operation that does not complete in this time ends the job.",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Shard norm and dropout activations along the sequence over the TP ranks.",
    )
    p.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard optimizer state over data-parallel ranks (reduce-scatter grads, "
        "all-gather params).",
    )
    p.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="With --use-distributed-optimizer: all-gather updated parameters in buckets, "
        "overlapped with the next forward.",
    )
    p.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="All-reduce gradients in buckets during backward (torch DDP) "
        "instead of once after it.",
    )
    p.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        help="Default: nccl on GPU, gloo on CPU.",
    )
    p.add_argument("--ddp-bucket-size", type=int, help="Elements per DDP bucket (with overlap).")
    p.add_argument(
        "--cp-comm-type",
        nargs="+",
        default=["p2p"],
        help="Context-parallel communication: p2p (ring attention, what mg-train runs).",
    )
    p.add_argument(
        "--tp-comm-overlap",
        action="store_true",
        help="Refused: Transformer Engine's userbuffer overlap of TP communication with GEMMs "
        "is not available in mg-train.",
    )
    p.add_argument(
        "--grad-reduce-in-bf16",
        action="store_true",
        help="All-reduce (with --use-distributed-optimizer: reduce-scatter) gradients over "
        "data-parallel ranks in bf16, half the bytes; accumulation over micro-batches "
        "stays fp32.",
    )


def finalize_parallel(args: Args) -> None:
    """Megatron's: sequence parallelism without tensor parallelism is switched off (it would
    only change numerics), with a warning."""
    d = args.distributed
    if d.sequence_parallel and d.tensor_model_parallel_size == 1:
        d.sequence_parallel = False
        if os.environ.get("RANK", "0") == "0":
            print(
                " WARNING: Disabling sequence parallelism because tensor model parallelism is "
                "disabled (--sequence-parallel with --tensor-model-parallel-size 1)",
                file=sys.stderr,
            )


def check_dry_run_layout(args: Args) -> None:
    """A dry run plans layouts mg-train may not run yet; only the shape must split."""
    d = args.distributed
    if args.family not in ("gpt", "mamba", "bert", "t5", "vlm"):
        fail(f"--dry-run supports gpt, bert, t5, mamba and vlm, not {args.family}")
    model_parallel = (
        d.tensor_model_parallel_size * d.pipeline_model_parallel_size * d.context_parallel_size
    )
    if model_parallel < 1 or d.world_size % model_parallel:
        fail(
            f"world size ({d.world_size}, from WORLD_SIZE) is not divisible by tensor x pipeline "
            f"x context parallel sizes ({model_parallel}); set WORLD_SIZE to the planned GPU count"
        )


def check_tensor_parallel(args: Args) -> None:
    """TP/SP rules, checked before any process group exists."""
    d, m = args.distributed, args.model
    tp = d.tensor_model_parallel_size
    if tp < 1:
        fail(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if tp == 1:
        return
    if args.family not in ("gpt", "bert", "t5", "mamba", "vlm", "retro"):
        fail(
            "--tensor-model-parallel-size > 1 is supported for gpt, bert, t5, mamba, vlm and "
            f"retro, not {args.family}"
        )
    heads = m.num_attention_heads
    groups = m.num_query_groups if m.group_query_attention else heads
    for flag, value in (("--num-attention-heads", heads), ("--num-query-groups", groups)):
        if value and value % tp:
            fail(f"{flag} ({value}) is not divisible by --tensor-model-parallel-size ({tp})")
    if m.ffn_hidden_size and m.ffn_hidden_size % tp:
        fail(
            f"--ffn-hidden-size ({m.ffn_hidden_size}) is not divisible by "
            f"--tensor-model-parallel-size ({tp})"
        )
    if args.family == "mamba":  # Megatron's MambaMixer splits whole heads and groups
        mb = args.mamba
        mamba_heads = mb.mamba_num_heads or 2 * m.hidden_size // max(mb.mamba_head_dim, 1)
        for flag, value in (
            ("--mamba-num-heads", mamba_heads),
            ("--mamba-num-groups", mb.mamba_num_groups),
        ):
            if value and value % tp:
                fail(f"{flag} ({value}) is not divisible by --tensor-model-parallel-size ({tp})")


def check_pipeline_and_context(args: Args) -> None:
    """PP/CP layout rules (Megatron's), checked before any process group exists."""
    d, m, t = args.distributed, args.model, args.training
    pp, cp = d.pipeline_model_parallel_size, d.context_parallel_size
    for flag, value in (("--pipeline-model-parallel-size", pp), ("--context-parallel-size", cp)):
        if value < 1:
            fail(f"{flag} must be >= 1, got {value}")
    if d.distributed_timeout_minutes <= 0:
        fail(f"--distributed-timeout-minutes must be > 0, got {d.distributed_timeout_minutes}")
    model_parallel = pp * cp * d.tensor_model_parallel_size
    if d.world_size % model_parallel:
        fail(
            f"world size ({d.world_size}) is not divisible by tensor "
            f"({d.tensor_model_parallel_size}) x pipeline ({pp}) x context ({cp}) parallel "
            f"sizes; launch a multiple of {model_parallel} processes"
        )
    if pp > 1 and args.family not in ("gpt", "bert", "mamba", "vlm"):
        fail(
            "--pipeline-model-parallel-size > 1 is supported for gpt, bert, mamba and vlm, not "
            f"{args.family}"
        )
    if cp > 1 and args.family != "gpt":
        fail(f"--context-parallel-size > 1 is supported for gpt, not {args.family}")
    if pp > 1 or d.num_layers_per_virtual_pipeline_stage is not None:
        # lazy: --help stays instant (mg.core.parallel imports torch)
        from mg.core.parallel.pipeline import PipelineConfigError, virtual_size_from_layers

        try:
            virtual = virtual_size_from_layers(
                m.num_layers, pp, d.num_layers_per_virtual_pipeline_stage
            )
        except PipelineConfigError as err:
            fail(str(err))
        if m.num_layers % pp:
            fail(
                f"number of layers ({m.num_layers}) should be divisible by the pipeline parallel "
                f"size ({pp}); change --num-layers or --pipeline-model-parallel-size"
            )
        micro = t.global_batch_size // (t.micro_batch_size * args.data_parallel_size)
        if virtual > 1 and micro % pp:
            fail(
                f"number of microbatches ({micro}) is not divisible by pipeline-model-parallel-"
                f"size ({pp}) when using interleaved schedule; change --global-batch-size"
            )
        if virtual > 1 and t.rampup_batch_size is not None:
            fail("--rampup-batch-size with the interleaved schedule is not supported")
    if cp > 1 and m.seq_length % (2 * cp):
        fail(
            f"--seq-length ({m.seq_length}) must be divisible by 2 x --context-parallel-size "
            f"({2 * cp}): each rank holds two of 2·CP chunks"
        )


def check_distributed_optimizer(args: Args) -> None:
    d = args.distributed
    if any(kind != "p2p" for kind in d.cp_comm_type):
        fail(
            f"--cp-comm-type {' '.join(d.cp_comm_type)}: mg-train's context parallelism is "
            "p2p (ring attention); give p2p or drop the flag"
        )
    if d.tp_comm_overlap:
        fail(
            "--tp-comm-overlap (Transformer Engine's userbuffer overlap of TP communication "
            "with GEMMs) is not available in mg-train; drop the flag"
        )
