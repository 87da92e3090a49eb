"""Multi-latent attention and YaRN RoPE: Megatron's "mla" flag group and its RoPE kind.

Megatron's names, each onto the `TransformerConfig` field of the same name
(mg.core.models.mla, mg.core.models.yarn): `--multi-latent-attention`,
`--q-lora-rank` (unset: the queries are projected directly), `--kv-lora-rank`,
`--qk-head-dim`, `--qk-pos-emb-head-dim`, `--v-head-dim`; `--rope-type` (rope or yarn;
as in Megatron, MLA takes yarn when it is not given), `--rotary-scaling-factor`,
`--mscale`, `--mscale-all-dim`, and Megatron's `--yarn-original-max-position-embeddings`,
`--yarn-beta-fast`, `--yarn-beta-slow`, `--[no-]yarn-correction-range-round-to-int`
(defaults 4096, 32, 1, rounded: Megatron's MLATransformerConfig values). A
DeepSeek-V3-shaped run, e.g.:

    mg-train gpt ... --position-embedding-type rope --normalization RMSNorm --swiglu \\
        --multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 \\
        --qk-pos-emb-head-dim 64 --v-head-dim 128 --qk-layernorm \\
        --rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class MLAArgs:
    """Multi-latent attention's shape and the YaRN RoPE scaling."""

    multi_latent_attention: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    rope_type: str | None = None
    rotary_scaling_factor: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_original_max_position_embeddings: int | None = None
    yarn_beta_fast: float | None = None
    yarn_beta_slow: float | None = None
    yarn_correction_range_round_to_int: bool | None = None
    mla_down_proj_fusion: bool = False
    cache_mla_latents: bool = False


_SHAPE = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
_YARN = (
    "rotary_scaling_factor",
    "mscale",
    "mscale_all_dim",
    "yarn_original_max_position_embeddings",
    "yarn_beta_fast",
    "yarn_beta_slow",
    "yarn_correction_range_round_to_int",
)


def add_mla_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--multi-latent-attention",
        action="store_true",
        help="DeepSeek-V2/V3's multi-latent attention: keys and values from a shared latent.",
    )
    p.add_argument(
        "--q-lora-rank", type=int, help="Rank of the queries' latent; unset: no query latent."
    )
    p.add_argument("--kv-lora-rank", type=int, default=32, help="Rank of the key/value latent.")
    p.add_argument(
        "--qk-head-dim",
        type=int,
        default=128,
        help="Query/key channels per head without RoPE (a head is this + --qk-pos-emb-head-dim).",
    )
    p.add_argument(
        "--qk-pos-emb-head-dim",
        type=int,
        default=64,
        help="Query/key channels per head that RoPE rotates (the key part shared by all heads).",
    )
    p.add_argument("--v-head-dim", type=int, default=128, help="Value channels per head.")
    if "--rope-type" not in p._option_string_actions:
        p.add_argument(
            "--rope-type",
            choices=["rope", "yarn"],
            help="RoPE kind: rope, or yarn (YaRN scaling); default yarn with "
            "--multi-latent-attention, rope otherwise (Megatron's).",
        )
    p.add_argument(
        "--rotary-scaling-factor",
        type=float,
        default=1.0,
        help="YaRN's context stretch (HF rope_scaling factor).",
    )
    p.add_argument(
        "--mscale", type=float, default=1.0, help="YaRN's mscale (the cos/sin concentration)."
    )
    p.add_argument(
        "--mscale-all-dim",
        type=float,
        default=0.0,
        help="YaRN's mscale_all_dim (MLA also scales its softmax by its square).",
    )
    p.add_argument(
        "--yarn-original-max-position-embeddings",
        type=int,
        help="The context before YaRN stretched it (default 4096, Megatron's MLA value).",
    )
    p.add_argument(
        "--yarn-beta-fast", type=float, help="YaRN's ramp: channels kept above it (default 32)."
    )
    p.add_argument(
        "--yarn-beta-slow", type=float, help="YaRN's ramp: channels stretched below it (default 1)."
    )
    p.add_argument(
        "--yarn-correction-range-round-to-int",
        action="store_true",
        default=None,
        help="Round YaRN's ramp band to whole channels (the default).",
    )
    p.add_argument(
        "--no-yarn-correction-range-round-to-int",
        action="store_false",
        dest="yarn_correction_range_round_to_int",
        help="Keep YaRN's ramp band unrounded (HF truncate=False, gpt-oss).",
    )
    add_mla_kernel_flags(p)


def add_mla_kernel_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--mla-down-proj-fusion",
        action="store_true",
        help="Megatron's fused q/kv down projection where its backend has one; mg computes "
        "the unfused projections, Megatron's fallback (the same numbers).",
    )
    p.add_argument(
        "--cache-mla-latents",
        action="store_true",
        help="Megatron's inference option (cache the latents); not for training: mg-serve "
        "always caches MLA's latent.",
    )


def resolved_rope_type(a: MLAArgs) -> str:
    """--rope-type, or Megatron's default: yarn for MLA, rope otherwise."""
    return a.rope_type or ("yarn" if a.multi_latent_attention else "rope")


def mla_config_fields(a: MLAArgs) -> dict[str, Any]:
    """The `TransformerConfig` fields these flags set."""
    fields: dict[str, Any] = {"rope_type": resolved_rope_type(a)}
    if a.multi_latent_attention:
        fields["multi_latent_attention"] = True
        fields.update({name: getattr(a, name) for name in _SHAPE})
    if fields["rope_type"] == "yarn":
        fields.update(
            rotary_scaling_factor=a.rotary_scaling_factor,
            mscale=a.mscale,
            mscale_all_dim=a.mscale_all_dim,
            original_max_position_embeddings=a.yarn_original_max_position_embeddings or 4096,
            beta_fast=a.yarn_beta_fast if a.yarn_beta_fast is not None else 32.0,
            beta_slow=a.yarn_beta_slow if a.yarn_beta_slow is not None else 1.0,
            yarn_correction_range_round_to_int=a.yarn_correction_range_round_to_int is not False,
        )
    return fields


def check_mla(args: Args) -> None:
    """Refuse, in one line naming the flag, what these flags cannot do."""
    a, defaults = args.mla, MLAArgs()
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    given = [
        name
        for name in ("multi_latent_attention", "rope_type", *_SHAPE, *_YARN)
        if getattr(a, name) != getattr(defaults, name)
    ]
    if given and args.family != "gpt":
        fail(f"{flag(given[0])} is supported for gpt, not {args.family}")
    if not a.multi_latent_attention:
        shape = [name for name in _SHAPE if name in given]
        if shape:
            fail(f"{flag(shape[0])} shapes multi-latent attention; add --multi-latent-attention")
    if resolved_rope_type(a) != "yarn":
        yarn = [name for name in _YARN if name in given]
        if yarn:
            fail(f"{flag(yarn[0])} applies to YaRN; add --rope-type yarn")
    if given and args.model.position_embedding_type != "rope":
        fail(
            f"{flag(given[0])} needs --position-embedding-type rope "
            f"(got {args.model.position_embedding_type})"
        )
    if a.mla_down_proj_fusion and not a.multi_latent_attention:
        fail("--mla-down-proj-fusion requires --multi-latent-attention (Megatron's check)")
    if a.cache_mla_latents:
        fail(
            "--cache-mla-latents is an inference option (Megatron: it conflicts with "
            "training); mg-serve caches MLA's latent always, drop it here"
        )
    if a.multi_latent_attention and args.model.group_query_attention:
        fail("--multi-latent-attention and --group-query-attention exclude each other (Megatron)")
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "q_lora_rank"):
        value = getattr(a, name)
        if value is not None and value <= 0:
            fail(f"{flag(name)} {value}: must be positive")
    if a.qk_pos_emb_head_dim % 2 and a.multi_latent_attention:
        fail(f"--qk-pos-emb-head-dim {a.qk_pos_emb_head_dim}: RoPE needs an even size")
    if a.rotary_scaling_factor <= 0:
        fail(f"--rotary-scaling-factor {a.rotary_scaling_factor}: must be positive")
    if resolved_rope_type(a) == "yarn" and (
        args.model.use_rope_scaling
        or args.layer_variants.rotary_seq_len_interpolation_factor is not None
    ):
        fail("--rope-type yarn replaces --use-rope-scaling / --rotary-seq-len-interpolation-factor")
