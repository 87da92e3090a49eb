"""Megatron's network-size, regularisation and recompute flags: the model's shape.

The fields map one to one onto core's `TransformerConfig` (see `families.py`);
`check_model` refuses shapes that cannot be built before anything is allocated.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class ModelArgs:
    """The network's shape (`--num-layers` ...), mapped one to one onto TransformerConfig."""

    num_layers: int | None = None
    encoder_num_layers: int | None = None
    decoder_num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    group_query_attention: bool = False
    num_query_groups: int = 1
    kv_channels: int | None = None
    seq_length: int | None = None
    encoder_seq_length: int | None = None
    decoder_seq_length: int | None = None
    bert_binary_head: bool = True
    max_position_embeddings: int | None = None
    position_embedding_type: str = "learned_absolute"
    add_position_embedding: bool = True
    masked_softmax_fusion: bool = True
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    use_rotary_position_embeddings: bool = False
    use_rope_scaling: bool = False
    rope_scaling_factor: float = 8.0
    use_legacy_models: bool = False
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    apply_layernorm_1p: bool = False
    swiglu: bool = False
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    make_vocab_size_divisible_by: int = 128
    mask_padded_vocab: bool = False
    recompute_activations: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    recompute_modules: list[str] | None = None


RECOMPUTE_MODULES = {
    "core_attn": "the attention core, as --recompute-activations",
    "moe_act": "the routed experts' activation (with --moe-grouped-gemm)",
    "layernorm": "the input and pre-MLP norms that are modules of their own",
    "mla_up_proj": "multi-latent attention's up projections and RoPE",
    "mlp": "each dense MLP",
    "moe": "each MoE layer, as --moe-layer-recompute",
    "shared_experts": "each MoE layer's shared experts",
}
"""megatron-core's `recompute_modules` choices (all recomputed here) and what each is;
the same names as `mg.core.models.recompute.RECOMPUTE_MODULES`, which this module does not
import (`--help` stays free of torch; a test keeps the two equal)."""


def add_model_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--num-layers", type=int, help="Number of transformer layers.")
    p.add_argument(
        "--encoder-num-layers", type=int, help="Megatron's name of --num-layers for encoders (T5)."
    )
    p.add_argument(
        "--decoder-num-layers",
        type=int,
        help="T5 decoder layers; mg's T5 has as many as the encoder (the default).",
    )
    p.add_argument("--hidden-size", type=int, help="Transformer hidden size.")
    p.add_argument(
        "--ffn-hidden-size", type=int, help="MLP width; default 4*hidden (SwiGLU: Megatron's 8/3)."
    )
    p.add_argument("--num-attention-heads", type=int, help="Number of attention heads.")
    p.add_argument(
        "--group-query-attention", action="store_true", help="Use --num-query-groups K/V heads."
    )
    p.add_argument(
        "--num-query-groups", type=int, default=1, help="K/V heads with --group-query-attention."
    )
    p.add_argument("--kv-channels", type=int, help="Channels per head; default hidden/heads.")
    p.add_argument("--seq-length", type=int, help="Tokens per sample.")
    p.add_argument(
        "--encoder-seq-length", type=int, help="T5/BERT encoder tokens; sets --seq-length."
    )
    p.add_argument("--decoder-seq-length", type=int, help="T5 decoder tokens per sample.")
    p.add_argument(
        "--bert-no-binary-head",
        dest="bert_binary_head",
        action="store_false",
        help="BERT without the sentence-order (binary) head and its loss.",
    )
    p.add_argument(
        "--max-position-embeddings", type=int, help="Longest supported sequence; default seq."
    )
    p.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope", "none"],
        help="Learned absolute positions (GPT-2) or rotary (Llama).",
    )
    p.add_argument(
        "--no-position-embedding",
        dest="add_position_embedding",
        action="store_false",
        help="Megatron's: no learned absolute positions (position type none unless rope).",
    )
    p.add_argument(
        "--no-masked-softmax-fusion",
        dest="masked_softmax_fusion",
        action="store_false",
        help="No-op (Megatron's CUDA kernel choice): mg's attention is SDPA, whose masked "
        "softmax matches the unfused path Megatron falls back to.",
    )
    p.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base (theta).")
    p.add_argument(
        "--rotary-percent", type=float, default=1.0, help="Fraction of head channels rotated."
    )
    p.add_argument(
        "--use-rotary-position-embeddings",
        action="store_true",
        help="Megatron's older spelling of --position-embedding-type rope.",
    )
    p.add_argument(
        "--use-rope-scaling",
        action="store_true",
        help="Llama 3.1's RoPE frequency scaling (low/high frequency factors 1 and 4, "
        "original context 8192, as Megatron hard-codes them).",
    )
    p.add_argument(
        "--rope-scaling-factor", type=float, default=8.0, help="Factor of --use-rope-scaling."
    )
    p.add_argument(
        "--use-legacy-models",
        action="store_true",
        help="Refused: mg builds Megatron-Core models only (Megatron's legacy classes are gone).",
    )
    p.add_argument(
        "--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"], help="Norm."
    )
    p.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norms.")
    p.add_argument(
        "--apply-layernorm-1p",
        action="store_true",
        help="Zero-centred norm weights: the norms compute with 1 + weight, weights start at "
        "0 (Megatron's layernorm_zero_centered_gamma; gpt).",
    )
    p.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (Llama) instead of GeLU.")
    p.add_argument("--disable-bias-linear", action="store_true", help="No biases in linear layers.")
    p.add_argument("--add-qkv-bias", action="store_true", help="Bias on QKV only (Qwen).")
    p.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="Norm each head's queries and keys before RoPE (Qwen3, OLMo 2).",
    )
    p.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output layer instead of reusing the word embeddings.",
    )
    p.add_argument("--init-method-std", type=float, default=0.02, help="Init std (Megatron).")
    p.add_argument("--attention-dropout", type=float, default=0.1, help="Attention dropout.")
    p.add_argument("--hidden-dropout", type=float, default=0.1, help="Hidden dropout.")
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the embedding table to a multiple of this (times TP).",
    )
    p.add_argument(
        "--mask-padded-vocab",
        action="store_true",
        help="The output layer's padding rows (beyond the tokenizer's vocabulary) take no "
        "probability in the training loss, as they take none in mg-eval and mg-serve. Off by "
        "default: Megatron's loss keeps them in the softmax (gpt, mamba).",
    )
    p.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Selective recompute of the attention core (saves its activations).",
    )
    p.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        help="Recompute whole layers (full) or only the attention core (selective).",
    )
    p.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        help="With full recompute: checkpoint chunks of N layers (uniform) or the first N (block).",
    )
    p.add_argument("--recompute-num-layers", type=int, help="N for --recompute-method.")
    p.add_argument(
        "--recompute-modules",
        nargs="+",
        metavar="MODULE",
        help="With --recompute-granularity selective, what to recompute (Megatron's names): "
        "core_attn (the default), moe_act, layernorm, mla_up_proj, mlp, moe, shared_experts.",
    )


REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "seq_length")


def finalize_model(args: Args) -> None:
    """Megatron's derived values: seq from the encoder's, max positions, recompute shortcut."""
    m = args.model
    if m.num_layers is None:
        m.num_layers = m.encoder_num_layers
    if args.family == "t5" and m.decoder_num_layers is None:
        m.decoder_num_layers = m.num_layers
    if m.seq_length is None:
        m.seq_length = m.encoder_seq_length
    if m.recompute_activations:
        m.recompute_granularity = "selective"
    if m.use_rotary_position_embeddings:
        m.position_embedding_type = "rope"  # Megatron's validate_args does the same
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if not m.add_position_embedding and m.position_embedding_type == "learned_absolute":
        m.position_embedding_type = "none"  # Megatron: --no-position-embedding without rope


def selective_recompute_modules(m: ModelArgs) -> tuple[str, ...]:
    """What selective recompute recomputes: --recompute-modules, Megatron's default
    core_attn without it; nothing unless --recompute-granularity is selective (Megatron
    reads the list only then)."""
    if m.recompute_granularity != "selective":
        return ()
    return tuple(m.recompute_modules if m.recompute_modules is not None else ["core_attn"])


def check_recompute_modules(args: Args) -> None:
    """Megatron's module names and its rules for them (TransformerConfig.__post_init__)."""
    modules = args.model.recompute_modules or ()
    for name in modules:
        if name not in RECOMPUTE_MODULES:
            fail(
                f"--recompute-modules {name}: not a module Megatron recomputes (choose from "
                f"{', '.join(RECOMPUTE_MODULES)})"
            )
    gpt_only = [n for n in modules if n not in ("core_attn", "moe")]
    if gpt_only and args.family not in ("gpt", "retro"):
        fail(f"--recompute-modules {gpt_only[0]} is supported for gpt and retro, not {args.family}")
    if "moe_act" in modules and not args.moe.moe_grouped_gemm:
        fail("--recompute-modules moe_act: only with --moe-grouped-gemm (Megatron's rule)")
    if "mla_up_proj" in modules and not args.mla.multi_latent_attention:
        fail(
            "--recompute-modules mla_up_proj: only with --multi-latent-attention (Megatron's rule)"
        )
    te_linears = [n for n in ("mlp", "mla_up_proj") if n in modules]
    if te_linears and args.transformer_engine.fp8 is not None:
        fail(
            f"--recompute-modules {te_linears[0]} with --fp8-format: its Transformer Engine "
            "linears would be recomputed outside FP8 (Megatron recomputes them through TE's "
            f"own checkpoint); drop {te_linears[0]} or --fp8-format"
        )


def check_model(args: Args) -> None:
    """Head, query-group, position and recompute rules (Megatron's validate_args)."""
    m = args.model
    if m.use_legacy_models:
        fail("--use-legacy-models: mg builds Megatron-Core models only; drop the flag")
    if m.use_rope_scaling and args.family != "gpt":
        fail(f"--use-rope-scaling is supported for gpt, not {args.family}")
    if m.decoder_num_layers is not None and args.family != "t5":
        fail(f"--decoder-num-layers is a T5 flag (mg-train t5), not {args.family}")
    if m.decoder_num_layers is not None and m.decoder_num_layers != m.num_layers:
        fail(
            f"--decoder-num-layers {m.decoder_num_layers}: mg's T5 has as many decoder layers as "
            f"encoder layers ({m.num_layers}); drop the flag or make them equal"
        )
    if m.apply_layernorm_1p and args.family not in ("gpt", "vlm"):  # vlm: its language model
        fail(f"--apply-layernorm-1p is supported for gpt and vlm, not {args.family}")
    if m.mask_padded_vocab and args.family not in ("gpt", "mamba"):
        fail(f"--mask-padded-vocab is supported for gpt and mamba, not {args.family}")
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads != 0:
        fail(
            f"hidden size ({m.hidden_size}) is not divisible by the number of attention heads "
            f"({m.num_attention_heads}); change one of them or set --kv-channels"
        )
    if m.group_query_attention and m.num_attention_heads % m.num_query_groups != 0:
        fail(
            f"number of attention heads ({m.num_attention_heads}) must be a multiple of "
            f"--num-query-groups ({m.num_query_groups})"
        )
    if m.seq_length > m.max_position_embeddings:
        fail(
            f"sequence length ({m.seq_length}) is longer than --max-position-embeddings "
            f"({m.max_position_embeddings})"
        )
    check_recompute_modules(args)
