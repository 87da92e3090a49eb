"""`MambaConfig`: a `TransformerConfig` with the Mamba-2 mixer and the hybrid layer pattern.

A hybrid model is still a decoder with attention and MLP layers (their shapes
are the TransformerConfig fields), so this extends that config rather than
standing beside it; a checkpoint records it as plain JSON the same way. Field
names are Megatron-LM's flags: `--mamba-state-dim`, `--mamba-head-dim`,
`--mamba-num-groups`, `--mamba-num-heads`, `--hybrid-attention-ratio`,
`--hybrid-mlp-ratio`, `--hybrid-override-pattern`. Defaults are megatron-core
0.16.1's (`TransformerConfig.mamba_*`, `MambaMixer`'s d_conv = 4, chunk_size =
128, expand = 2; `MambaModel`'s position_embedding_type = "none").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mg.core.models.config import ConfigError, PositionEmbeddingType, TransformerConfig
from mg.core.models.mamba.pattern import allocate_layers

MAMBA_EXPAND = 2
"""d_inner = 2 · hidden_size unless mamba_num_heads is given (MambaMixer's `expand`)."""


@dataclass
class MambaConfig(TransformerConfig):
    """A Mamba-2 or hybrid (Mamba-2 + attention + MLP) language model.

    With no pattern and both ratios 0 every layer is a Mamba layer (a pure
    Mamba-2 model, HF `Mamba2ForCausalLM`); num_attention_heads is then unused
    but still required, as it is by Megatron."""

    position_embedding_type: PositionEmbeddingType = "none"

    mamba_state_dim: int = 128
    """N: state entries per channel (`--mamba-state-dim`)."""
    mamba_head_dim: int = 64
    """P: channels per Mamba head (`--mamba-head-dim`)."""
    mamba_num_groups: int = 8
    """Groups sharing B and C (`--mamba-num-groups`); TP splits whole groups."""
    mamba_num_heads: int | None = None
    """Mamba heads (`--mamba-num-heads`); default 2 · hidden_size // mamba_head_dim."""
    mamba_conv_kernel: int = 4
    """Width of the depthwise causal convolution (MambaMixer's d_conv; no Megatron flag)."""
    mamba_chunk_size: int = 128
    """Chunk length of the SSD scan; changes speed, not the result."""
    mamba_dt_clamp_min: float = 0.0
    """Lower bound on each step size dt = softplus(dt_proj + dt_bias), mamba_ssm's
    `dt_limit[0]`. 0 is no clamp, as megatron-core's MambaMixer; transformers'
    NemotronH clamps at its `time_step_min` (mg.core.models.mamba.hf)."""

    hybrid_attention_ratio: float = 0.0
    hybrid_mlp_ratio: float = 0.0
    hybrid_override_pattern: str | None = None
    """One letter per layer: M Mamba, * attention, - MLP (E MoE: not yet)."""

    def __post_init__(self) -> None:
        if self.mamba_num_heads is None and self.mamba_head_dim:
            self.mamba_num_heads = MAMBA_EXPAND * self.hidden_size // self.mamba_head_dim
        super().__post_init__()

    @property
    def mamba_d_inner(self) -> int:
        """Channels of the SSM: heads · head_dim."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def layer_pattern(self) -> str:
        """The layer types in order, one letter each (Megatron's `allocate_layers`)."""
        return "".join(
            allocate_layers(
                self.num_layers,
                self.hybrid_attention_ratio,
                self.hybrid_mlp_ratio,
                self.hybrid_override_pattern,
            )
        )

    def validate(self) -> None:
        super().validate()

        def fail(name: str, message: str) -> None:
            raise ConfigError(f"MambaConfig.{name}: {message}")

        for name in (
            "mamba_state_dim",
            "mamba_head_dim",
            "mamba_num_groups",
            "mamba_num_heads",
            "mamba_conv_kernel",
            "mamba_chunk_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                fail(name, f"must be a positive integer, got {value!r}")
        if not self.mamba_dt_clamp_min >= 0.0:
            fail("mamba_dt_clamp_min", f"must be >= 0, got {self.mamba_dt_clamp_min!r}")
        if self.mamba_num_heads % self.mamba_num_groups:
            fail(
                "mamba_num_heads",
                f"{self.mamba_num_heads} Mamba heads do not divide into "
                f"{self.mamba_num_groups} groups (--mamba-num-groups); each group needs "
                "the same number of heads",
            )
        try:
            self.layer_pattern  # noqa: B018 - validates the pattern and the ratios
        except ValueError as err:
            raise ConfigError(f"MambaConfig: {err}") from None


def tiny_hybrid(**overrides: Any) -> MambaConfig:
    """A three-layer hybrid (Mamba, attention, MLP: "M*-") with the GPT-2 vocabulary padded
    to 50304, no dropout and decisive logits (init std 0.3): the model the serving, eval and
    conversion tests share."""
    defaults: dict[str, Any] = dict(
        num_layers=3,
        hidden_size=32,
        num_attention_heads=2,
        vocab_size=50304,
        seq_length=64,
        max_position_embeddings=64,
        mamba_head_dim=16,
        mamba_num_groups=1,
        mamba_state_dim=8,
        mamba_chunk_size=8,
        hybrid_override_pattern="M*-",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.3,
    )
    return MambaConfig(**{**defaults, **overrides})


def decoder_config_from_dict(data: dict[str, Any]) -> TransformerConfig:
    """A recorded decoder config (a checkpoint's `model_config`) as the class it was:
    a `MambaConfig` when it has the Mamba fields, else a `TransformerConfig`."""
    if "mamba_state_dim" in data:
        return MambaConfig.from_dict(data)
    return TransformerConfig.from_dict(data)
