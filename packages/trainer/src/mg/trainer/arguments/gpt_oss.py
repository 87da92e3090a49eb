"""gpt-oss's pieces: attention sinks, the clamped SwiGLU with its linear offset, and
`--enable-gpt-oss`; with them the kernel and precision flags of Megatron-LM's
`examples/gptoss/02_train.sh` (core_v0.19.0) that no other group has.

Megatron's names. `--softmax-type`, `--glu-linear-offset` and
`--activation-func-clamp-value` are the `TransformerConfig` fields of those names;
`--quick-geglu` is the activation "quick_geglu" (x·sigmoid(1.702x) on the gate half);
`--enable-gpt-oss` sets what Megatron's post-training model builder sets: YaRN RoPE with
factor 32, original max positions 131072, beta fast 32 / slow 1, mscale 1,
mscale_all_dim 0, the correction range not rounded. Sliding windows come from
`--window-size` / `--window-attn-skip-freq` (layer_variants), biases from the default
`--add-bias-linear` (the experts' and the router's too). A gpt-oss-shaped run, e.g.:

    mg-train gpt ... --normalization RMSNorm --position-embedding-type rope \\
        --untie-embeddings-and-output-weights --quick-geglu --glu-linear-offset 1.0 \\
        --activation-func-clamp-value 7.0 --softmax-type learnable \\
        --window-size 127,0 --window-attn-skip-freq 2 --num-experts 32 --enable-gpt-oss
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.core.models import TransformerConfig
    from mg.trainer.arguments.args import Args


@dataclass
class GptOssArgs:
    """Attention sinks, the clamped SwiGLU, gpt-oss's YaRN, and 02_train.sh's kernel flags."""

    softmax_type: str = "vanilla"
    quick_geglu: bool = False
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None
    enable_gpt_oss: bool = False
    export_force_local_attention: bool = False
    rope_fusion: bool = True
    bias_gelu_fusion: bool = True
    bias_dropout_fusion: bool = True
    accumulate_allreduce_grads_in_fp32: bool = False
    disable_bf16_reduced_precision_matmul: bool = False
    moe_permute_fusion: bool = False


def add_gpt_oss_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--softmax-type",
        choices=["vanilla", "off-by-one", "learnable"],
        default="vanilla",
        help="Attention softmax: vanilla; off-by-one (an extra logit 0 per row); learnable "
        "(a learned sink logit per head, gpt-oss's sinks: core_attention.softmax_offset).",
    )
    p.add_argument(
        "--quick-geglu",
        action="store_true",
        help="Gated MLP with quick GELU, x*sigmoid(1.702x), on the gate half (gpt-oss).",
    )
    p.add_argument(
        "--glu-linear-offset",
        type=float,
        default=0.0,
        help="Gated MLP computes act(gate) * (up + offset) (gpt-oss: 1.0).",
    )
    p.add_argument(
        "--activation-func-clamp-value",
        type=float,
        help="Gated MLP clamps gate <= L and up to [-L, L] before the activation (gpt-oss: 7).",
    )
    p.add_argument(
        "--enable-gpt-oss",
        action="store_true",
        help="Megatron's gpt-oss defaults: YaRN RoPE, factor 32, original max positions "
        "131072, beta fast 32 / slow 1, mscale 1, mscale-all-dim 0, unrounded ramp.",
    )
    p.add_argument(
        "--export-force-local-attention",
        action="store_true",
        help="With --transformer-impl transformer_engine: keep the local (SDPA) core "
        "attention, which has the attention sinks TE's is not given here.",
    )
    for flag, dest, what in (
        ("--no-rope-fusion", "rope_fusion", "RoPE"),
        ("--no-bias-gelu-fusion", "bias_gelu_fusion", "bias + GELU"),
        ("--no-bias-dropout-fusion", "bias_dropout_fusion", "bias + dropout + add"),
    ):
        p.add_argument(
            flag,
            dest=dest,
            action="store_false",
            help=f"Megatron's choice of a fused {what} CUDA kernel; mg computes the unfused "
            "math either way, so the results are those of Megatron's unfused path.",
        )
    p.add_argument(
        "--accumulate-allreduce-grads-in-fp32",
        action="store_true",
        help="Gradients accumulate and reduce in fp32: what mg always does (fp32 weights "
        "under --bf16/--fp16 autocast), and Megatron's default with --bf16.",
    )
    _add_unless_known(
        p,
        "--moe-permute-fusion",
        action="store_true",
        help="Megatron's fused token permutation kernel; mg's dispatcher permutes the same "
        "rows in the same order either way.",
    )
    p.add_argument(
        "--disable-bf16-reduced-precision-matmul",
        action="store_true",
        help="CUDA bf16 matmuls reduce in fp32 (torch.backends.cuda.matmul."
        "allow_bf16_reduced_precision_reduction = False), as Megatron sets it.",
    )


def _add_unless_known(p: argparse._ArgumentGroup, flag: str, **kwargs: Any) -> None:
    """Add `flag` unless another group (the YaRN/MLA or MoE flags) already has it."""
    if flag not in p._option_string_actions:
        p.add_argument(flag, **kwargs)


def check_gpt_oss(args: Args) -> None:
    """Refuse what cannot apply, in one line naming the flag; apply the matmul setting."""
    g = args.gpt_oss
    given = [
        name
        for name, on in (
            ("--softmax-type", g.softmax_type != "vanilla"),
            ("--quick-geglu", g.quick_geglu),
            ("--glu-linear-offset", g.glu_linear_offset != 0.0),
            ("--activation-func-clamp-value", g.activation_func_clamp_value is not None),
            ("--enable-gpt-oss", g.enable_gpt_oss),
        )
        if on
    ]
    if given and args.family != "gpt":
        fail(f"{given[0]} is supported for gpt, not {args.family}")
    gated = g.quick_geglu or args.model.swiglu or args.layer_variants.geglu
    if g.quick_geglu and (args.model.swiglu or args.layer_variants.geglu):
        fail("--quick-geglu with --swiglu or --geglu: pick one gated activation")
    for flag, on in (
        ("--glu-linear-offset", g.glu_linear_offset != 0.0),
        ("--activation-func-clamp-value", g.activation_func_clamp_value is not None),
    ):
        if on and not gated:
            fail(f"{flag} applies to a gated MLP; add --quick-geglu, --swiglu or --geglu")
    clamp = g.activation_func_clamp_value
    if clamp is not None and clamp <= 0:
        fail(f"--activation-func-clamp-value {clamp}: must be positive")
    te = args.transformer_engine
    if g.softmax_type != "vanilla":
        if te.transformer_impl == "transformer_engine" and not g.export_force_local_attention:
            fail(
                f"--softmax-type {g.softmax_type} with --transformer-impl transformer_engine: "
                "TE's attention is not given the sinks here; add --export-force-local-attention "
                "(keeps the local core attention) or use --transformer-impl local"
            )
        if te.attention_backend == "flash" and te.transformer_impl == "local":
            fail(
                f"--softmax-type {g.softmax_type} with --attention-backend flash: flash "
                "kernels take no sink logit; use auto, fused, unfused or local"
            )
    if g.disable_bf16_reduced_precision_matmul:
        # lazy: the argument modules stay light for `mg-train --help`
        import torch

        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


def gpt_oss_config(config: TransformerConfig, g: GptOssArgs) -> TransformerConfig:
    """`config` with these flags' fields (`--enable-gpt-oss`: Megatron's YaRN values)."""
    fields: dict[str, Any] = {
        "softmax_type": g.softmax_type,
        "glu_linear_offset": g.glu_linear_offset,
        "activation_func_clamp_value": g.activation_func_clamp_value,
    }
    if g.quick_geglu:
        fields["activation"] = "quick_geglu"
    if g.export_force_local_attention:
        # Megatron's local DotProductAttention: the unfused math, whatever TE would pick
        fields["extra"] = {**config.extra, "export_force_local_attention": True}
        fields["attention_backend"] = "unfused"
    if g.enable_gpt_oss:
        # lazy: the argument modules stay light for `mg-train --help` (core imports torch)
        from mg.core.models.gpt_oss_hf import MEGATRON_GPT_OSS_YARN

        fields |= MEGATRON_GPT_OSS_YARN
    return dataclasses.replace(config, **fields)
