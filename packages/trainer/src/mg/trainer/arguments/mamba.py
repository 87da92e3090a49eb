"""Megatron-LM's Mamba / hybrid flags (`pretrain_mamba.py`), their group and checks.

`mg-train mamba` trains megatron-core's `MambaModel`: a pure Mamba-2 stack, or a
hybrid one whose layers `--hybrid-override-pattern` (or the two ratios) picks.
The attention and MLP layers take the usual model flags (`--num-attention-heads`,
`--ffn-hidden-size`, `--swiglu`, ...). Megatron's `--spec`, `--use-mcore-models`
and `--no-create-attention-mask-in-dataloader` from `examples/mamba/train.sh`
are accepted: mg always builds Megatron-Core-style models, from its own plain
PyTorch layers (the spec names the Transformer Engine layers they stand for),
and builds an attention mask only for `--reset-attention-mask`.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args

MAMBA_SPECS = (
    ("megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"),
    ("megatron.core.models.mamba.mamba_layer_specs", "mamba_inference_stack_spec"),
)


@dataclass
class MambaArgs:
    """The Mamba-2 mixer's shape and the hybrid layer pattern."""

    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None
    mamba_chunk_size: int = 128
    mamba_ssm_kernels: bool = False
    hybrid_attention_ratio: float = 0.0
    hybrid_mlp_ratio: float = 0.0
    hybrid_override_pattern: str | None = None
    spec: list[str] | None = None
    use_mcore_models: bool = False
    create_attention_mask_in_dataloader: bool = True


def add_mamba_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--mamba-state-dim", type=int, default=128, help="SSM state size N.")
    p.add_argument("--mamba-head-dim", type=int, default=64, help="Channels per Mamba head.")
    p.add_argument(
        "--mamba-num-groups", type=int, default=8, help="Groups sharing B and C (Mamba-2)."
    )
    p.add_argument(
        "--mamba-num-heads", type=int, help="Mamba heads; default 2 * hidden / --mamba-head-dim."
    )
    p.add_argument(
        "--mamba-chunk-size",
        type=int,
        default=128,
        help="Chunk length of the SSD scan (speed only, not the result; mg's flag).",
    )
    p.add_argument(
        "--mamba-ssm-kernels",
        action="store_true",
        help="Scan with mamba_ssm's Triton kernel (CUDA; pip install mamba-ssm; mg's flag).",
    )
    p.add_argument(
        "--hybrid-attention-ratio", type=float, default=0.0, help="Share of attention layers."
    )
    p.add_argument("--hybrid-mlp-ratio", type=float, default=0.0, help="Share of MLP layers.")
    p.add_argument(
        "--hybrid-override-pattern",
        help="One letter per layer: M Mamba, * attention, - MLP (E, MoE: not yet).",
    )
    p.add_argument(
        "--spec",
        nargs="+",
        help="Megatron's layer spec (module, name); mamba accepts mamba_stack_spec.",
    )
    p.add_argument(
        "--use-mcore-models",
        action="store_true",
        help="Accepted for Megatron scripts; mg always builds Megatron-Core models.",
    )
    p.add_argument(
        "--no-create-attention-mask-in-dataloader",
        dest="create_attention_mask_in_dataloader",
        action="store_false",
        help="Accepted for Megatron scripts; masks are built only for --reset-attention-mask.",
    )


_GENERAL = {"use_mcore_models", "create_attention_mask_in_dataloader"}


def check_mamba_flags(family: str, mamba: MambaArgs) -> str | None:
    """The message for a Mamba flag that cannot apply, or None."""
    defaults = MambaArgs()
    if family != "mamba":
        for f in fields(MambaArgs):
            if f.name not in _GENERAL and getattr(mamba, f.name) != getattr(defaults, f.name):
                flag = "--" + f.name.replace("_", "-")
                return f"{flag} is a Mamba / hybrid flag: use `mg-train mamba`, not {family}"
        return None
    if mamba.mamba_ssm_kernels:
        import torch  # lazy: --help stays instant (no torch before argparse answers)

        if importlib.util.find_spec("mamba_ssm") is None:
            return (
                "--mamba-ssm-kernels: the mamba_ssm package is not installed "
                "(pip install mamba-ssm); drop the flag to use the PyTorch scan"
            )
        if not torch.cuda.is_available():
            return "--mamba-ssm-kernels: mamba_ssm's Triton kernels need a CUDA GPU"
    if mamba.spec is not None and tuple(mamba.spec) not in MAMBA_SPECS:
        return (
            f"--spec {' '.join(mamba.spec)}: mg-train mamba builds megatron-core's "
            "mamba_stack_spec from its own PyTorch layers; give "
            "`--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec` or drop it"
        )
    return None


def check_mamba(args: Args) -> None:
    error = check_mamba_flags(args.family, args.mamba)
    if error:
        fail(error)
