"""`TransformerConfig`: the shape of a decoder, named as Megatron names it.

Field names follow Megatron-LM's flags (`--num-layers` → `num_layers`, ...), so a
trainer can map flags onto this dataclass one to one and a checkpoint can record
it as plain JSON (`to_dict` / `from_dict`). Optional fields that Megatron derives
(`ffn_hidden_size`, `kv_channels`, `num_query_groups`, `max_position_embeddings`)
are filled in `__post_init__` with Megatron's rules, and the result is validated
right away, so an invalid shape fails where it is written, not deep in a forward.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from mg.core.models.yarn import mla_softmax_scale

PositionEmbeddingType = Literal["learned_absolute", "rope", "none"]
RopeType = Literal["rope", "yarn"]
Normalization = Literal["LayerNorm", "RMSNorm"]
Activation = Literal[
    "gelu", "gelu_tanh", "relu", "squared_relu", "swiglu", "geglu", "geglu_tanh", "quick_geglu"
]
SoftmaxType = Literal["vanilla", "off-by-one", "learnable"]
AttentionBackend = Literal["auto", "flash", "fused", "unfused", "local"]
TransformerImpl = Literal["local", "transformer_engine"]
LayerOrder = Literal["pre_ln", "post_ln"]
MoEScoreFunction = Literal["softmax", "sigmoid"]
MoERouterDtype = Literal["fp32", "fp64"]
MoELoadBalancing = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"]
MoEDropPolicy = Literal["probs", "position"]
MoEDispatcher = Literal["allgather", "alltoall"]

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
ACTIVATIONS = (
    "gelu",
    "gelu_tanh",
    "relu",
    "squared_relu",
    "swiglu",
    "geglu",
    "geglu_tanh",
    "quick_geglu",
)
GATED_ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh", "quick_geglu")
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
TRANSFORMER_IMPLS = ("local", "transformer_engine")
LAYER_ORDERS = ("pre_ln", "post_ln")
MOE_SCORE_FUNCTIONS = ("softmax", "sigmoid")
MOE_ROUTER_DTYPES = ("fp32", "fp64")
MOE_LOAD_BALANCING_TYPES = ("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none")
MOE_DROP_POLICIES = ("probs", "position")
MOE_DISPATCHERS = ("allgather", "alltoall")


class ConfigError(ValueError):
    """An invalid model configuration; the message names the field and the fix."""


@dataclass
class RopeScaling:
    """Llama-3.1 style RoPE frequency scaling (HF `rope_type: "llama3"`).

    Defaults are Llama 3.1's, which are also the values Megatron-Core hard-codes
    behind its `--use-rope-scaling` / `--rope-scaling-factor` flags.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def swiglu_ffn_hidden_size(hidden_size: int) -> int:
    """Megatron-LM's default FFN width with `--swiglu`: 2/3 of 4h, rounded down to 64.

    Two input projections (gate and up) keep the parameter count close to the
    plain 4h MLP; the multiple of 64 keeps tensor-parallel shards aligned.
    (`megatron/training/arguments.py`: `int((4 * h * 2 / 3) / 64) * 64`.)
    """
    return int((4 * hidden_size * 2 / 3) / 64) * 64


def pad_vocab_size(
    vocab_size: int, make_vocab_size_divisible_by: int = 128, tensor_parallel_size: int = 1
) -> int:
    """Megatron's padded vocabulary: round up to a multiple of `divisible_by · TP`."""
    multiple = make_vocab_size_divisible_by * tensor_parallel_size
    return ((vocab_size + multiple - 1) // multiple) * multiple


@dataclass
class TransformerConfig:
    """A GPT-style decoder (GPT-2, Llama 2/3, Mistral are values of this).

    Defaults are Megatron-LM's defaults (biases on, LayerNorm, GELU, learned
    positions, dropout 0.1, init std 0.02), so a config written from
    Megatron flags means what it meant there.

    Derived fields are filled once, at construction: `dataclasses.replace(c,
    hidden_size=...)` keeps the old ffn_hidden_size/kv_channels unless they are
    passed as None too.
    """

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    """Embedding rows: the *padded* vocabulary (see `pad_vocab_size`)."""

    ffn_hidden_size: int | None = None
    """MLP width; default 4h, or `swiglu_ffn_hidden_size(h)` with a gated activation."""
    num_query_groups: int | None = None
    """Key/value heads for grouped-query attention; None means one per head (MHA)."""
    kv_channels: int | None = None
    """Per-head dimension; default hidden_size // num_attention_heads."""

    seq_length: int = 1024
    max_position_embeddings: int | None = None
    """Positions the model supports; default seq_length (as Megatron-LM does)."""
    position_embedding_type: PositionEmbeddingType = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates (the first ones)."""
    rope_scaling: RopeScaling | None = None
    rope_type: RopeType = "rope"
    """Megatron's `--rope-type`: "yarn" stretches RoPE with YaRN (`mg.core.models.yarn`) by
    the fields below, Megatron-Core's MLA/YaRN names (HF rope_type "yarn")."""
    rotary_scaling_factor: float = 1.0
    """YaRN's context stretch s (HF `factor`)."""
    original_max_position_embeddings: int = 4096
    """The context the model was trained with before YaRN stretched it."""
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    yarn_correction_range_round_to_int: bool = True
    """Round YaRN's ramp band to whole channels (HF `truncate`; gpt-oss has it False)."""

    multi_latent_attention: bool = False
    """DeepSeek-V2/V3's multi-latent attention (`mg.core.models.mla`) in place of
    SelfAttention: keys and values from a shared kv_lora_rank latent, RoPE on a separate
    qk_pos_emb_head_dim part of each head. kv_channels and num_query_groups are unused."""
    q_lora_rank: int | None = None
    """The queries' low-rank latent; None projects the queries directly (linear_q_proj)."""
    kv_lora_rank: int = 32
    qk_head_dim: int = 128
    """Each head's query/key channels without RoPE; a head's query is qk_head_dim +
    qk_pos_emb_head_dim wide."""
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128

    normalization: Normalization = "LayerNorm"
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    """Megatron's `--apply-layernorm-1p`: the norms compute with 1 + weight and their
    weights start at 0 (`mg.core.models.norms`). GPTModel only."""
    activation: Activation = "gelu"
    """MLP activation. "gelu" is the exact (erf) GELU, Megatron's `F.gelu`;
    "gelu_tanh" is the tanh approximation GPT-2 was trained with (HF "gelu_new")
    and also what Megatron's fused bias-GELU kernel computes. "swiglu"/"geglu" are
    gated: linear_fc1 produces [gate; up] and the MLP computes act(gate) * up;
    "geglu_tanh" is GeGLU with the tanh GELU (Gemma's `gelu_pytorch_tanh`)."""
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    """Bias on linear_qkv only (Qwen-style), with add_bias_linear False."""
    qk_layernorm: bool = False
    """A norm (`normalization`, over each head's channels) on the queries and keys
    before RoPE: Megatron's `--qk-layernorm`, Qwen3's q_norm/k_norm."""
    untie_embeddings_and_output_weights: bool = False

    decoder_seq_length: int | None = None
    """T5 only (`--decoder-seq-length`); seq_length is then the encoder's
    (`--encoder-seq-length`). Both must fit in max_position_embeddings."""
    transformer_layer_order: LayerOrder = "pre_ln"
    """"pre_ln" (Megatron-Core, every model) or "post_ln" (original BERT, HF
    BertModel: norm after each residual add, a norm on the embeddings, no final
    norm). Only BertModel supports "post_ln"."""

    window_size: tuple[int, int] | None = None
    """Sliding-window attention as (left, right), flash-attn's convention: query i
    sees keys i-left .. i+right. A decoder needs right == 0. HF Mistral's
    `sliding_window = W` is (W - 1, 0)."""
    window_attn_skip_freq: int | list[int] | None = None
    """Megatron's `--window-attn-skip-freq`: which layers keep full attention when
    window_size is set. N: every N-th layer (layers N, 2N, ... counted from 1) is
    global, the others slide (Gemma 3's sliding_window_pattern=6 is 6); a list: one
    0/1 per layer, 1 = sliding window (Megatron's convention). None: all layers slide."""
    rotary_base_local: float | None = None
    """RoPE base of the sliding-window layers (Gemma 3's `rope_local_base_freq`); the
    global layers keep rotary_base with rope_scaling / rotary_seq_len_interpolation_factor.
    None: every layer uses the one RoPE."""
    rotary_seq_len_interpolation_factor: float | None = None
    """Megatron's `--rotary-seq-len-interpolation-factor`: linear RoPE scaling, the
    inverse frequencies divided by it (HF `rope_type: "linear"`, `factor`)."""
    softmax_scale: float | None = None
    """Megatron's `softmax_scale`: the attention logits' scale; None is 1/√kv_channels.
    Gemma's `query_pre_attn_scalar` q is q**-0.5."""
    sandwich_norms: bool = False
    """A norm also after attention and after the MLP, on each branch before its residual
    add (Gemma 2/3): `post_self_attn_layernorm` and `post_mlp_layernorm` (HF's
    post_attention_layernorm / post_feedforward_layernorm). GPTModel only."""
    attn_logit_softcapping: float | None = None
    """Gemma 2's cap c on the attention logits: c·tanh(logits / c) before the mask and the
    softmax. It needs the explicit-math attention (`--attention-backend auto`, `unfused`
    or `local`); the fused kernels and the paged KV cache refuse it by name."""
    softmax_type: SoftmaxType = "vanilla"
    """Megatron's `--softmax-type`: "vanilla"; "off-by-one" adds a logit 0 to every softmax
    row (exp(x_i) / (1 + Σ_j exp(x_j))); "learnable" adds one learned logit per head, the
    attention sink (`core_attention.softmax_offset`, gpt-oss's `sinks`). The sink takes
    probability mass and gives back no value."""
    glu_linear_offset: float = 0.0
    """Megatron's `--glu-linear-offset` c: a gated MLP computes act(gate) · (up + c)
    (gpt-oss: 1)."""
    activation_func_clamp_value: float | None = None
    """Megatron's `--activation-func-clamp-value` L: a gated MLP clamps gate ≤ L and
    up to [-L, L] before the activation (gpt-oss: 7)."""
    scale_embeddings_by_sqrt_hidden: bool = False
    """Multiply the word embeddings by √hidden_size, rounded to the embedding's dtype
    first, as Gemma does (`normalizer = hidden**0.5`)."""
    attention_backend: AttentionBackend = "auto"
    """Megatron's `--attention-backend` (its AttnBackend names): which attention kernel
    runs; see `mg.core.models.attention_backend`. It does not change the weights."""
    transformer_impl: TransformerImpl = "local"
    """Megatron's `--transformer-impl`, i.e. which layer spec names the weights: "local"
    keeps the norms as modules (`input_layernorm.weight`), "transformer_engine" fuses
    them into the next linear (`linear_qkv.layer_norm_weight`), as TE's
    LayerNormLinear does; see `mg.core.models.te_spec`. GPTModel only."""

    init_method_std: float = 0.02
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1

    # Mixture of Experts (Megatron-Core's field names; see mg.core.models.moe).
    num_moe_experts: int | None = None
    """Routed experts per MoE layer; None means a dense model."""
    moe_ffn_hidden_size: int | None = None
    """Each routed expert's MLP width; default ffn_hidden_size."""
    moe_layer_freq: int | list[int] = 1
    """Which layers are MoE: every N-th layer (from layer 1), or a 0/1 list per layer
    (e.g. [0] + [1] * (L - 1) for a first dense layer, as DeepSeek-V3 does)."""
    moe_router_topk: int = 2
    moe_router_score_function: MoEScoreFunction = "softmax"
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (Mixtral's order) instead of over the
    k selected logits; required with topk 1."""
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_dtype: MoERouterDtype | None = None
    """Router logits and probabilities in fp32/fp64 instead of the activations' dtype."""
    moe_router_load_balancing_type: MoELoadBalancing = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_force_load_balancing: bool = False
    """Benchmarking (Megatron's flag): the router's logits replaced by standard-normal noise,
    gradients passed straight through, so every expert gets about the same tokens."""
    moe_expert_capacity_factor: float | None = None
    """None: dropless. Otherwise each expert takes at most ceil(tokens·k/E · factor)."""
    moe_token_drop_policy: MoEDropPolicy = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    """A sigmoid gate on the shared experts' output (Qwen2-MoE)."""
    moe_token_dispatcher_type: MoEDispatcher = "allgather"

    # Multi-token prediction (DeepSeek-V3's MTP; see mg.core.models.mtp).
    mtp_num_layers: int | None = None
    """MTP depths after the decoder (Megatron's `--mtp-num-layers`); None: none."""
    mtp_loss_scaling_factor: float = 0.1
    """The MTP losses' weight: their mean over the depths is added to the main loss
    times this (Megatron's `--mtp-loss-scaling-factor`, default 0.1)."""

    extra: dict[str, Any] = field(default_factory=dict)
    """Free-form notes carried along with the config (e.g. the HF architecture)."""

    def __post_init__(self) -> None:
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if (
            self.kv_channels is None
            and self.num_attention_heads
            and self.hidden_size % self.num_attention_heads == 0
        ):
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = (
                swiglu_ffn_hidden_size(self.hidden_size)
                if self.activation in GATED_ACTIVATIONS
                else 4 * self.hidden_size
            )
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_moe_experts is not None and self.moe_ffn_hidden_size is None:
            self.moe_ffn_hidden_size = self.ffn_hidden_size
        if isinstance(self.rope_scaling, dict):
            self.rope_scaling = RopeScaling(**self.rope_scaling)
        if self.window_size is not None:
            self.window_size = tuple(self.window_size)  # JSON gives a list
        # configs recorded before Megatron's names: "sdpa" was auto, "te" the TE spec
        if self.attention_backend == "sdpa":
            self.attention_backend = "auto"
        elif self.attention_backend == "te":
            self.attention_backend, self.transformer_impl = "auto", "transformer_engine"
        self.validate()

    # Derived quantities, named as Megatron's code names them.

    @property
    def gated_linear_unit(self) -> bool:
        """True for SwiGLU/GeGLU: linear_fc1 is twice as wide ([gate; up])."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def swiglu(self) -> bool:
        """Megatron-LM's `--swiglu` flag."""
        return self.activation == "swiglu"

    @property
    def query_projection_size(self) -> int:
        return self.kv_channels * self.num_attention_heads

    @property
    def kv_projection_size(self) -> int:
        return self.kv_channels * self.num_query_groups

    @property
    def rotary_dim(self) -> int:
        """Channels per head that RoPE rotates (Megatron: int(kv_channels · percent));
        multi-latent attention rotates its qk_pos_emb_head_dim part."""
        if self.multi_latent_attention:
            return self.qk_pos_emb_head_dim
        return int(self.kv_channels * self.rotary_percent)

    def validate(self) -> None:
        """Raise `ConfigError` with a Megatron-like message for an invalid shape."""

        def fail(name: str, message: str) -> None:
            raise ConfigError(f"TransformerConfig.{name}: {message}")

        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                fail(name, f"must be a positive integer, got {value!r}")
        if self.kv_channels is None:
            fail(
                "hidden_size",
                f"hidden size ({self.hidden_size}) is not divisible by the number of "
                f"attention heads ({self.num_attention_heads}); change one of them or "
                "set kv_channels explicitly",
            )
        for name in ("num_query_groups", "kv_channels", "ffn_hidden_size", "seq_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                fail(name, f"must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_query_groups != 0:
            fail(
                "num_query_groups",
                f"number of attention heads ({self.num_attention_heads}) must be a multiple "
                f"of the number of query groups ({self.num_query_groups})",
            )
        if self.multi_latent_attention:  # before RoPE's checks: it sets the rotated part
            self._validate_mla(fail)
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            fail(
                "position_embedding_type",
                f"{self.position_embedding_type!r} is not one of {POSITION_EMBEDDING_TYPES}",
            )
        if self.max_position_embeddings < self.seq_length:
            fail(
                "max_position_embeddings",
                f"sequence length ({self.seq_length}) is longer than the maximum number of "
                f"position embeddings ({self.max_position_embeddings}); raise "
                "max_position_embeddings or shorten seq_length",
            )
        if self.decoder_seq_length is not None and not (
            0 < self.decoder_seq_length <= self.max_position_embeddings
        ):
            fail(
                "decoder_seq_length",
                f"decoder sequence length ({self.decoder_seq_length}) must be positive and "
                f"at most max_position_embeddings ({self.max_position_embeddings})",
            )
        if self.transformer_layer_order not in LAYER_ORDERS:
            fail(
                "transformer_layer_order",
                f"{self.transformer_layer_order!r} is not one of {LAYER_ORDERS}",
            )
        if not 0.0 < self.rotary_percent <= 1.0:
            fail("rotary_percent", f"must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding_type == "rope":
            if self.rotary_dim < 2 or self.rotary_dim % 2:
                fail(
                    "rotary_percent",
                    f"RoPE rotates int(kv_channels · rotary_percent) = {self.rotary_dim} "
                    "channels per head, which must be even and at least 2",
                )
            if self.rotary_base <= 0:
                fail("rotary_base", f"must be positive, got {self.rotary_base}")
        if self.rope_scaling is not None:
            if self.position_embedding_type != "rope":
                fail("rope_scaling", "only applies with position_embedding_type='rope'")
            s = self.rope_scaling
            if s.factor <= 0 or s.high_freq_factor <= s.low_freq_factor:
                fail(
                    "rope_scaling",
                    "needs factor > 0 and high_freq_factor > low_freq_factor, got "
                    f"{dataclasses.asdict(s)}",
                )
        if self.normalization not in NORMALIZATIONS:
            fail("normalization", f"{self.normalization!r} is not one of {NORMALIZATIONS}")
        if self.layernorm_epsilon <= 0:
            fail("layernorm_epsilon", f"must be positive, got {self.layernorm_epsilon}")
        if self.activation not in ACTIVATIONS:
            fail("activation", f"{self.activation!r} is not one of {ACTIVATIONS}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            fail(
                "attention_backend",
                f"{self.attention_backend!r} is not one of {ATTENTION_BACKENDS}",
            )
        if self.transformer_impl not in TRANSFORMER_IMPLS:
            fail(
                "transformer_impl",
                f"{self.transformer_impl!r} is not one of {TRANSFORMER_IMPLS}",
            )
        if self.window_size is not None:
            if len(self.window_size) != 2:
                fail("window_size", f"must be a pair (left, right), got {self.window_size!r}")
            left, right = self.window_size
            if right != 0 or left < 0:
                fail(
                    "window_size",
                    f"a causal decoder needs (left >= 0, right == 0), got {self.window_size}; "
                    "HF Mistral's sliding_window=W is window_size=(W - 1, 0)",
                )
        self._validate_layer_variants(fail)
        self._validate_yarn(fail)
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                fail(name, f"must be in [0, 1), got {value}")
        if self.init_method_std <= 0:
            fail("init_method_std", f"must be positive, got {self.init_method_std}")
        if self.num_moe_experts is not None:
            self._validate_moe(fail)
        mtp = self.mtp_num_layers
        if mtp is not None and (not isinstance(mtp, int) or mtp <= 0):
            fail("mtp_num_layers", f"must be a positive integer or None, got {mtp!r}")
        if mtp and isinstance(self.window_attn_skip_freq, list):
            fail("mtp_num_layers", "MTP layers have no entry in a window_attn_skip_freq list")

    def _validate_layer_variants(self, fail: Callable[[str, str], None]) -> None:
        """The local/global attention pattern, the second RoPE base, the scales and the
        sandwich norms (Gemma 3's pieces)."""
        freq = self.window_attn_skip_freq
        if freq is not None:
            if self.window_size is None:
                fail("window_attn_skip_freq", "needs window_size (there is no window to skip)")
            if isinstance(freq, int):
                if freq <= 0:
                    fail("window_attn_skip_freq", f"must be a positive integer, got {freq}")
            elif len(freq) != self.num_layers or any(x not in (0, 1) for x in freq):
                fail(
                    "window_attn_skip_freq",
                    f"a pattern needs one 1 (sliding window) or 0 (global) per layer "
                    f"({self.num_layers}), got {list(freq)}",
                )
        if self.rotary_base_local is not None:
            if self.position_embedding_type != "rope" or self.window_size is None:
                fail("rotary_base_local", "applies to the sliding-window layers of a RoPE model")
            if self.rotary_base_local <= 0:
                fail("rotary_base_local", f"must be positive, got {self.rotary_base_local}")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and (factor <= 0 or self.position_embedding_type != "rope"):
            fail("rotary_seq_len_interpolation_factor", "must be positive, with RoPE")
        if factor is not None and self.rope_scaling is not None:
            fail("rotary_seq_len_interpolation_factor", "choose it or rope_scaling, not both")
        for name in ("softmax_scale", "attn_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                fail(name, f"must be positive, got {value}")
        if self.softmax_type not in SOFTMAX_TYPES:
            fail("softmax_type", f"{self.softmax_type!r} is not one of {SOFTMAX_TYPES}")
        if self.softmax_type != "vanilla" and self.attn_logit_softcapping is not None:
            fail("softmax_type", "attention sinks with attn_logit_softcapping: pick one")
        clamp = self.activation_func_clamp_value
        if clamp is not None and clamp <= 0:
            fail("activation_func_clamp_value", f"must be positive, got {clamp}")
        if (clamp is not None or self.glu_linear_offset) and not self.gated_linear_unit:
            fail(
                "glu_linear_offset" if clamp is None else "activation_func_clamp_value",
                f"applies to a gated MLP (swiglu, geglu, quick_geglu), not {self.activation!r}",
            )
        if self.sandwich_norms and self.transformer_impl == "transformer_engine":
            fail(
                "sandwich_norms",
                "not with transformer_impl='transformer_engine' yet (the TE spec fuses the "
                "pre-norms only); use --transformer-impl local",
            )

    def _validate_yarn(self, fail: Callable[[str, str], None]) -> None:
        """YaRN's fields (`mg.core.models.yarn`)."""
        if self.rope_type not in ("rope", "yarn"):
            fail("rope_type", f"{self.rope_type!r} is not one of ('rope', 'yarn')")
        if self.rope_type != "yarn":
            return
        if self.position_embedding_type != "rope":
            fail("rope_type", "YaRN scales RoPE: it needs position_embedding_type='rope'")
        if self.rope_scaling is not None or self.rotary_seq_len_interpolation_factor is not None:
            fail("rope_type", "YaRN replaces rope_scaling / linear interpolation; choose one")
        if self.rotary_scaling_factor <= 0:
            fail("rotary_scaling_factor", f"must be positive, got {self.rotary_scaling_factor}")
        if self.original_max_position_embeddings <= 0:
            fail(
                "original_max_position_embeddings",
                f"must be positive, got {self.original_max_position_embeddings}",
            )
        if self.beta_fast <= 0 or self.beta_slow <= 0:
            fail(
                "beta_fast",
                f"beta_fast and beta_slow must be positive ({self.beta_fast}, {self.beta_slow})",
            )

    def _validate_mla(self, fail: Callable[[str, str], None]) -> None:
        """Multi-latent attention's shapes (Megatron's MLATransformerConfig)."""
        for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                fail(name, f"must be a positive integer, got {value!r}")
        if self.q_lora_rank is not None and (
            not isinstance(self.q_lora_rank, int) or self.q_lora_rank <= 0
        ):
            fail("q_lora_rank", f"must be a positive integer or None, got {self.q_lora_rank!r}")
        if self.qk_pos_emb_head_dim % 2:
            fail("qk_pos_emb_head_dim", f"RoPE needs an even size, got {self.qk_pos_emb_head_dim}")
        if self.position_embedding_type != "rope":
            fail(
                "multi_latent_attention",
                "its decoupled RoPE needs position_embedding_type='rope' (--rope-type picks "
                "rope or yarn)",
            )
        if self.num_query_groups != self.num_attention_heads:
            fail(
                "num_query_groups",
                "multi-latent attention has one key/value per head; leave num_query_groups "
                "unset (Megatron: group query attention excludes MLA)",
            )
        for name in ("window_size", "attn_logit_softcapping", "rotary_base_local"):
            if getattr(self, name) is not None:
                fail(name, "not with multi_latent_attention")

    def is_window_layer(self, layer_number: int) -> bool:
        """Whether layer `layer_number` (1-based) attends through the sliding window:
        Megatron's `is_layer_window_attention` rule."""
        if self.window_size is None:
            return False
        freq = self.window_attn_skip_freq
        if freq is None:
            return True
        if isinstance(freq, int):
            return layer_number % freq != 0
        return bool(freq[layer_number - 1])

    def layer_window_size(self, layer_number: int) -> tuple[int, int] | None:
        """The sliding window of layer `layer_number` (1-based); None: global attention."""
        return self.window_size if self.is_window_layer(layer_number) else None

    @property
    def attention_softmax_scale(self) -> float:
        """The scale of q·kᵀ: softmax_scale, or Megatron's default 1/√kv_channels."""
        if self.softmax_scale is not None:
            return self.softmax_scale
        if self.multi_latent_attention:  # with YaRN's mscale(s, mscale_all_dim)²
            return mla_softmax_scale(self, self.qk_head_dim + self.qk_pos_emb_head_dim)
        return 1.0 / math.sqrt(self.kv_channels)

    @property
    def moe_layer_pattern(self) -> list[bool]:
        """Per layer (0-based), whether it is an MoE layer (Megatron's `moe_layer_freq` rule)."""
        if self.num_moe_experts is None:
            return [False] * self.num_layers
        if isinstance(self.moe_layer_freq, int):
            return [i % self.moe_layer_freq == 0 for i in range(self.num_layers)]
        return [bool(x) for x in self.moe_layer_freq]

    def _validate_moe(self, fail: Callable[[str, str], None]) -> None:
        """Megatron-Core's MoE checks (`transformer_config.py`), one message per field."""
        e = self.num_moe_experts
        if not isinstance(e, int) or e <= 0:
            fail("num_moe_experts", f"must be a positive integer, got {e!r}")
        if not isinstance(self.moe_ffn_hidden_size, int) or self.moe_ffn_hidden_size <= 0:
            fail(
                "moe_ffn_hidden_size",
                f"must be a positive integer, got {self.moe_ffn_hidden_size!r}",
            )
        freq = self.moe_layer_freq
        if isinstance(freq, int):
            if freq <= 0:
                fail("moe_layer_freq", f"must be a positive integer or a 0/1 list, got {freq}")
        elif len(freq) != self.num_layers or any(x not in (0, 1) for x in freq):
            fail(
                "moe_layer_freq",
                f"a pattern needs one 0 (dense) or 1 (MoE) per layer ({self.num_layers}), "
                f"got {list(freq)}",
            )
        if not 0 < self.moe_router_topk <= e:
            fail(
                "moe_router_topk",
                f"top-k ({self.moe_router_topk}) must be between 1 and num_moe_experts ({e})",
            )
        choices = {
            "moe_router_score_function": MOE_SCORE_FUNCTIONS,
            "moe_router_load_balancing_type": MOE_LOAD_BALANCING_TYPES,
            "moe_token_drop_policy": MOE_DROP_POLICIES,
            "moe_token_dispatcher_type": MOE_DISPATCHERS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                fail(name, f"{getattr(self, name)!r} is not one of {allowed}")
        if self.moe_router_dtype not in (None, *MOE_ROUTER_DTYPES):
            fail("moe_router_dtype", f"{self.moe_router_dtype!r} is not one of {MOE_ROUTER_DTYPES}")
        if (
            self.moe_router_topk == 1
            and self.moe_router_score_function == "softmax"
            and not self.moe_router_pre_softmax
            and self.moe_router_load_balancing_type != "sinkhorn"
        ):
            fail(
                "moe_router_pre_softmax",
                "top-1 softmax routing needs moe_router_pre_softmax (a softmax over the one "
                "selected logit is constant 1 and has no gradient)",
            )
        if self.moe_router_group_topk:
            groups = self.moe_router_num_groups
            if not groups:
                fail(
                    "moe_router_num_groups",
                    "group-limited routing (moe_router_group_topk) needs it",
                )
            if e % groups:
                fail("moe_router_num_groups", f"num_moe_experts ({e}) is not divisible by {groups}")
            if not 0 < self.moe_router_group_topk <= groups:
                fail(
                    "moe_router_group_topk",
                    f"must be between 1 and moe_router_num_groups ({groups}), "
                    f"got {self.moe_router_group_topk}",
                )
            if self.moe_router_topk % self.moe_router_group_topk:
                fail(
                    "moe_router_group_topk",
                    f"moe_router_topk ({self.moe_router_topk}) must be a multiple of it "
                    f"({self.moe_router_group_topk})",
                )
        if self.moe_router_enable_expert_bias and self.moe_router_score_function != "sigmoid":
            fail(
                "moe_router_enable_expert_bias",
                "aux-loss-free balancing needs moe_router_score_function='sigmoid'",
            )
        if self.moe_router_load_balancing_type == "sinkhorn" and self.moe_aux_loss_coeff:
            fail("moe_aux_loss_coeff", "sinkhorn routing takes no aux loss; set it to 0")
        if self.moe_expert_capacity_factor is not None:
            if self.moe_expert_capacity_factor <= 0:
                fail(
                    "moe_expert_capacity_factor",
                    f"must be positive, got {self.moe_expert_capacity_factor}",
                )
            if self.moe_router_load_balancing_type == "sinkhorn":
                fail(
                    "moe_expert_capacity_factor",
                    "capacity works with aux_loss, seq_aux_loss, global_aux_loss or none "
                    "load balancing, not sinkhorn",
                )
        if self.moe_pad_expert_input_to_capacity and self.moe_expert_capacity_factor is None:
            fail(
                "moe_pad_expert_input_to_capacity",
                "needs moe_expert_capacity_factor (there is no capacity to pad to when dropless)",
            )
        shared = self.moe_shared_expert_intermediate_size
        if shared is not None and (not isinstance(shared, int) or shared <= 0):
            fail(
                "moe_shared_expert_intermediate_size", f"must be a positive integer, got {shared!r}"
            )
        if self.moe_shared_expert_gate and shared is None:
            fail("moe_shared_expert_gate", "needs moe_shared_expert_intermediate_size")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able dict (nested RopeScaling as a dict, window_size as a list)."""
        out = dataclasses.asdict(self)
        if self.window_size is not None:
            out["window_size"] = list(self.window_size)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Inverse of `to_dict`; unknown keys are an error that names them."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"TransformerConfig: unknown fields {unknown}")
        return cls(**data)
