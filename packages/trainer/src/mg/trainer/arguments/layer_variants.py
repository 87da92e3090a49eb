"""Layer variants of the GPT decoder: sliding-window and local/global attention, a
second RoPE base, the attention scale, sandwich norms, scaled embeddings, GeGLU.

Together they make Gemma 3 (text); each also stands alone. Megatron's names where
Megatron has the flag (`--window-size`, `--window-attn-skip-freq`,
`--rotary-seq-len-interpolation-factor`, `--openai-gelu`), mg's otherwise. Each maps
onto the `TransformerConfig` field of the same name (see mg.core.models.config).
A Gemma 3 run, e.g.:

    mg-train gpt ... --position-embedding-type rope --normalization RMSNorm \\
        --apply-layernorm-1p --qk-layernorm --disable-bias-linear --geglu --openai-gelu \\
        --sandwich-norms --scale-embeddings-by-sqrt-hidden --softmax-scale 0.0625 \\
        --window-size 511,0 --window-attn-skip-freq 6 \\
        --rotary-base 1000000 --rotary-base-local 10000
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from mg.trainer.arguments.errors import fail
from mg.trainer.arguments.moe import parse_moe_layer_freq

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class LayerVariantArgs:
    """Sliding-window / local-global attention and Gemma's layer pieces."""

    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | list[int] | None = None
    rotary_base_local: float | None = None
    rotary_seq_len_interpolation_factor: float | None = None
    softmax_scale: float | None = None
    attn_logit_softcapping: float | None = None
    sandwich_norms: bool = False
    scale_embeddings_by_sqrt_hidden: bool = False
    geglu: bool = False
    openai_gelu: bool = False


def parse_window_size(text: str) -> tuple[int, int]:
    """ "511,0" or "(511, 0)" → (511, 0): Megatron's tuple form."""
    try:
        left, right = (int(part) for part in text.strip().strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give LEFT,RIGHT, e.g. 4095,0 (query i sees keys i-LEFT .. i+RIGHT)"
        ) from None
    return left, right


def parse_skip_freq(text: str) -> int | list[int]:
    """An int N (every N-th layer global) or Megatron's 0/1 list ("([1]*5+[0])*2")."""
    try:
        return parse_moe_layer_freq(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give an int (every N-th layer attends globally) or a 0/1 list "
            "such as '([1]*5+[0])*2' (1 = sliding window)"
        ) from None


def add_layer_variant_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--window-size",
        type=parse_window_size,
        help="Sliding-window attention LEFT,RIGHT (RIGHT 0 for a decoder; HF's "
        "sliding_window W is W-1,0).",
    )
    p.add_argument(
        "--window-attn-skip-freq",
        type=parse_skip_freq,
        help="With --window-size: every N-th layer attends globally (Gemma 3: 6), or a "
        "0/1 list per layer, 1 = sliding.",
    )
    p.add_argument(
        "--rotary-base-local",
        type=float,
        help="RoPE base of the sliding-window layers (Gemma 3's rope_local_base_freq); "
        "default: --rotary-base.",
    )
    p.add_argument(
        "--rotary-seq-len-interpolation-factor",
        type=float,
        help="Linear RoPE scaling: positions / factor (HF rope_type 'linear').",
    )
    p.add_argument(
        "--softmax-scale",
        type=float,
        help="Scale of the attention logits; default 1/sqrt(kv-channels) "
        "(Gemma: query_pre_attn_scalar**-0.5).",
    )
    p.add_argument(
        "--attn-logit-softcapping",
        type=float,
        help="Cap c on the attention logits, c*tanh(logits/c) (Gemma 2); explicit-math "
        "attention only (--attention-backend auto, unfused or local).",
    )
    p.add_argument(
        "--sandwich-norms",
        action="store_true",
        help="Also norm the attention and MLP outputs before each residual add (Gemma 2/3).",
    )
    p.add_argument(
        "--scale-embeddings-by-sqrt-hidden",
        action="store_true",
        help="Multiply the word embeddings by sqrt(hidden size), as Gemma does.",
    )
    p.add_argument("--geglu", action="store_true", help="Gated GELU MLP: gelu(gate) * up (Gemma).")
    p.add_argument(
        "--openai-gelu",
        action="store_true",
        help="GELU's tanh approximation (GPT-2's, Gemma's gelu_pytorch_tanh).",
    )


def activation_of(swiglu: bool, variants: LayerVariantArgs) -> str:
    """The `TransformerConfig.activation` of --swiglu / --geglu / --openai-gelu."""
    if swiglu:
        return "swiglu"
    if variants.geglu:
        return "geglu_tanh" if variants.openai_gelu else "geglu"
    return "gelu_tanh" if variants.openai_gelu else "gelu"


_NOT_CONFIG = {"geglu", "openai_gelu"}


def layer_variant_config_fields(variants: LayerVariantArgs) -> dict[str, Any]:
    """The `TransformerConfig` fields these flags set (the activation aside)."""
    return {
        f.name: getattr(variants, f.name) for f in fields(variants) if f.name not in _NOT_CONFIG
    }


def check_layer_variant_flags(args: Args) -> str | None:
    """The message for a flag of this group that cannot apply, or None."""
    v, m = args.layer_variants, args.model
    defaults = LayerVariantArgs()
    given = [f.name for f in fields(v) if getattr(v, f.name) != getattr(defaults, f.name)]
    flag = {name: "--" + name.replace("_", "-") for name in given}
    if given and args.family != "gpt":
        return f"{flag[given[0]]} is supported for gpt, not {args.family}"
    rope = m.position_embedding_type == "rope"
    if v.window_size is not None and (v.window_size[1] != 0 or v.window_size[0] < 0):
        return (
            f"--window-size {v.window_size[0]},{v.window_size[1]}: a decoder needs LEFT >= 0 "
            "and RIGHT 0"
        )
    if v.window_attn_skip_freq is not None:
        if v.window_size is None:
            return "--window-attn-skip-freq needs --window-size (there is no window to skip)"
        freq = v.window_attn_skip_freq
        if isinstance(freq, int) and freq <= 0:
            return f"--window-attn-skip-freq {freq}: must be positive"
        if isinstance(freq, list) and (
            len(freq) != m.num_layers or any(x not in (0, 1) for x in freq)
        ):
            return (
                f"--window-attn-skip-freq: a pattern needs one 0 or 1 per layer "
                f"(--num-layers {m.num_layers}), got {len(freq)} values {freq}"
            )
    if v.rotary_base_local is not None and (v.window_size is None or not rope):
        return "--rotary-base-local needs --window-size and --position-embedding-type rope"
    if v.rotary_seq_len_interpolation_factor is not None:
        if not rope or v.rotary_seq_len_interpolation_factor <= 0:
            return "--rotary-seq-len-interpolation-factor needs rope and a positive factor"
        if m.use_rope_scaling:
            return "--rotary-seq-len-interpolation-factor and --use-rope-scaling: pick one"
    for name in ("rotary_base_local", "softmax_scale", "attn_logit_softcapping"):
        value = getattr(v, name)
        if value is not None and value <= 0:
            return f"{'--' + name.replace('_', '-')} {value}: must be positive"
    if v.geglu and m.swiglu:
        return "--geglu and --swiglu: pick one gated activation"
    if v.sandwich_norms and args.transformer_engine.transformer_impl == "transformer_engine":
        return "--sandwich-norms needs --transformer-impl local (the TE spec fuses pre-norms only)"
    te = args.transformer_engine
    if v.attn_logit_softcapping is not None:
        if te.transformer_impl == "transformer_engine":
            return "--attn-logit-softcapping needs --transformer-impl local"
        if te.attention_backend in ("flash", "fused"):
            return (
                f"--attn-logit-softcapping with --attention-backend {te.attention_backend}: "
                "no fused kernel caps the logits; use --attention-backend auto, unfused or local"
            )
    cp = args.distributed.context_parallel_size
    if cp > 1 and v.attn_logit_softcapping is not None:
        return (
            f"--attn-logit-softcapping with --context-parallel-size {cp}: the ring attention "
            "has no logit cap; drop one of them"
        )
    if cp > 1 and v.window_size is not None and te.transformer_impl == "transformer_engine":
        return (
            f"--window-size with --context-parallel-size {cp} and --transformer-impl "
            "transformer_engine: TE's p2p ring has no sliding window; use --transformer-impl local"
        )
    if v.sandwich_norms and args.distributed.sequence_parallel:
        return (
            "--sandwich-norms with --sequence-parallel: the post-norms' weight gradients are "
            "not reduced over the sequence shards yet; drop --sequence-parallel"
        )
    return None


def check_layer_variants(args: Args) -> None:
    error = check_layer_variant_flags(args)
    if error:
        fail(error)
