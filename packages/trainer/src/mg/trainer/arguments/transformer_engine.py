"""GPU kernel selection: Transformer Engine layers, flash attention (and FP8, with TE).

Megatron spreads these over its "training" and "transformer-engine" groups; they
live together here because they pick kernels, not what the model computes.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class TransformerEngineArgs:
    """Which layer implementation and attention kernels run the model."""

    use_flash_attn: bool = False
    transformer_impl: str = "local"


def add_transformer_engine_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--use-flash-attn", action="store_true", help="flash-attn kernels (GPU, if installed)."
    )
    p.add_argument(
        "--transformer-impl",
        default="local",
        choices=["local", "transformer_engine"],
        help="Layer implementation: plain PyTorch or Transformer Engine (GPU, if installed).",
    )


def check_transformer_engine(args: Args) -> None:
    """Kernels this build cannot run (a dry run plans them without running them)."""
    te = args.transformer_engine
    if not args.training.dry_run and (te.use_flash_attn or te.transformer_impl != "local"):
        fail(
            "--use-flash-attn and --transformer-impl transformer_engine are not supported by "
            "mg-train yet; use the default PyTorch SDPA attention"
        )
    if args.training.deterministic_mode and te.use_flash_attn:
        fail("--deterministic-mode is not compatible with --use-flash-attn")
