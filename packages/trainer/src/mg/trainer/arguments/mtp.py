"""Megatron-LM's multi-token prediction flags (DeepSeek-V3's MTP), their group and checks.

`--mtp-num-layers D` adds D MTP depths after the decoder (`mg.core.models.mtp`), on the
last pipeline stage; `--mtp-loss-scaling-factor` weighs their losses: the mean over the
depths of each depth's masked mean loss, times the factor, is added to the main loss,
and each depth's loss is logged beside `lm loss` as Megatron logs it (`mtp_1 loss`, …).
Both map onto the `TransformerConfig` fields of the same name. DeepSeek-V3's run:

    mg-train gpt ... --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class MTPArgs:
    """Multi-token prediction depths and their loss weight."""

    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float = 0.1


def add_mtp_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--mtp-num-layers",
        type=int,
        help="Multi-token prediction depths after the decoder (DeepSeek-V3: 1); each "
        "predicts one more future token, on the last pipeline stage.",
    )
    p.add_argument(
        "--mtp-loss-scaling-factor",
        type=float,
        default=0.1,
        help="Weight of the MTP losses: their mean over the depths times this is added "
        "to the main loss.",
    )


def mtp_config_fields(mtp: MTPArgs) -> dict[str, Any]:
    """The `TransformerConfig` fields these flags set (same names)."""
    return asdict(mtp)


def mtp_loss_names(mtp: MTPArgs) -> tuple[str, ...]:
    """The names the MTP losses are logged under, Megatron's: `mtp_1 loss`, …"""
    return tuple(f"mtp_{k + 1} loss" for k in range(mtp.mtp_num_layers or 0))


def check_mtp_flags(args: Args) -> str | None:
    """The one-line message for MTP flags that cannot apply, or None."""
    mtp, d = args.mtp, args.distributed
    if mtp.mtp_num_layers is None:
        if mtp.mtp_loss_scaling_factor != MTPArgs().mtp_loss_scaling_factor:
            return "--mtp-loss-scaling-factor needs --mtp-num-layers (MTP is off without it)"
        return None
    if args.family != "gpt":
        return f"--mtp-num-layers: mg-train has multi-token prediction for gpt, not {args.family}"
    if mtp.mtp_num_layers <= 0:
        return f"--mtp-num-layers must be a positive integer, got {mtp.mtp_num_layers}"
    if mtp.mtp_loss_scaling_factor < 0:
        return f"--mtp-loss-scaling-factor must be >= 0, got {mtp.mtp_loss_scaling_factor}"
    if args.model.position_embedding_type not in ("rope", "none"):
        return (
            f"--mtp-num-layers with --position-embedding-type "
            f"{args.model.position_embedding_type}: Megatron's MTP takes rope or none"
        )
    if args.training.dry_run:
        return None
    if d.context_parallel_size > 1:
        return (
            f"--mtp-num-layers with --context-parallel-size {d.context_parallel_size}: the MTP "
            "roll across context-parallel ranks is not implemented; use one or the other"
        )
    return None


def check_mtp(args: Args) -> None:
    """`check_mtp_flags` on a parsed run."""
    error = check_mtp_flags(args)
    if error:
        fail(error)
