"""The Mamba-2 / hybrid language model: megatron-core's `MambaModel`.

Read top to bottom: embedding → one layer per letter of the pattern → final
norm → output layer. Each layer is pre-norm with one residual branch:

    M  MambaLayer:     x = x + dropout(mixer(norm(x)))                  mixer.py
    *  AttentionLayer: x = x + dropout(self_attention(input_layernorm(x)))
    -  MLPLayer:       x = x + dropout(mlp(pre_mlp_layernorm(x)))

The attention and MLP branches are the GPT model's own `SelfAttention` and
`MLP` modules (gpt.py), so whatever applies to them (tensor parallelism, the
attention backends, the KV cache) applies here too.

Names are megatron-core 0.16.1's `MambaModel`/`MambaStack` with the norms as
their own modules (the `norm` slot of `MambaLayerSubmodules`, and
`input_layernorm` / `pre_mlp_layernorm` of `TransformerLayerSubmodules`),
the way our GPTModel follows the local layer spec: `embedding.word_embeddings`,
`decoder.layers.{i}.{norm,mixer.*}`, `decoder.layers.{i}.{input_layernorm,
self_attention.*}`, `decoder.layers.{i}.{pre_mlp_layernorm,mlp.*}`,
`decoder.final_norm`, `output_layer`. Megatron's only Mamba spec is the
Transformer Engine one, which fuses each of those norms into the next linear
(`mixer.in_proj.layer_norm_weight`, `self_attention.linear_qkv.layer_norm_weight`,
`mlp.linear_fc1.layer_norm_weight`); `megatron_te_names` renames between the two.

Plain PyTorch, no process groups; builds on the meta device like GPTModel.
"""

from __future__ import annotations

from torch import Tensor, nn

from mg.core.models.config import ConfigError, TransformerConfig
from mg.core.models.gpt import MLP, GPTModel, SelfAttention, build_norm
from mg.core.models.language_model import LanguageModel
from mg.core.models.mamba.config import MambaConfig
from mg.core.models.mamba.mixer import MambaMixer
from mg.core.models.mamba.pattern import ATTENTION, MAMBA
from mg.core.models.mamba.pattern import MLP as MLP_SYMBOL
from mg.core.models.te_spec import TE_FUSED_NORMS


class MambaLayer(nn.Module):
    """norm → Mamba-2 mixer, added to the residual stream."""

    def __init__(self, config: MambaConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.norm = build_norm(config)
        self.mixer = MambaMixer(config, layer_number)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def init_weights(self, std: float, output_std: float) -> None:
        self.norm.reset_parameters()
        self.mixer.init_weights(std, output_std)

    def forward(self, hidden, rotary=None, attention_mask=None, inference_cache=None) -> Tensor:
        normed = self.norm(hidden)
        packed = getattr(inference_cache, "mix", None)  # a serving engine's packed step
        if packed is not None:
            mixed = packed(self.mixer, normed)
        else:
            mixed = self.mixer(normed, inference_cache=inference_cache)
        return hidden + self.hidden_dropout(mixed)


class AttentionLayer(nn.Module):
    """input_layernorm → GPT self-attention, added to the residual stream (no MLP)."""

    def __init__(self, config: MambaConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.input_layernorm = build_norm(config)
        self.self_attention = SelfAttention(config, layer_number)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def init_weights(self, std: float, output_std: float) -> None:
        self.input_layernorm.reset_parameters()
        self.self_attention.init_weights(std, output_std)

    def forward(self, hidden, rotary=None, attention_mask=None, inference_cache=None) -> Tensor:
        attention = self.self_attention(
            self.input_layernorm(hidden), rotary, attention_mask, inference_cache=inference_cache
        )
        return hidden + self.hidden_dropout(attention)


class MLPLayer(nn.Module):
    """pre_mlp_layernorm → GPT MLP, added to the residual stream (no attention)."""

    def __init__(self, config: MambaConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.pre_mlp_layernorm = build_norm(config)
        self.mlp = MLP(config)
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def init_weights(self, std: float, output_std: float) -> None:
        self.pre_mlp_layernorm.reset_parameters()
        self.mlp.init_weights(std, output_std)

    def forward(self, hidden, rotary=None, attention_mask=None, inference_cache=None) -> Tensor:
        return hidden + self.hidden_dropout(self.mlp(self.pre_mlp_layernorm(hidden)))


LAYER_TYPES: dict[str, type[nn.Module]] = {
    MAMBA: MambaLayer,
    ATTENTION: AttentionLayer,
    MLP_SYMBOL: MLPLayer,
}


class MambaStack(nn.Module):
    """The layers of the pattern and the final norm (Megatron's `decoder`)."""

    def __init__(self, config: MambaConfig) -> None:
        super().__init__()
        self.layer_pattern = config.layer_pattern
        self.layers = nn.ModuleList(
            LAYER_TYPES[letter](config, layer_number=i + 1)
            for i, letter in enumerate(self.layer_pattern)
        )
        self.final_norm = build_norm(config)

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        inference_cache=None,
    ) -> Tensor:
        for layer in self.layers:
            if inference_cache is None:
                hidden = layer(hidden, rotary, attention_mask)
            else:
                hidden = layer(hidden, rotary, attention_mask, inference_cache)
        return self.final_norm(hidden)


class MambaModel(LanguageModel):
    """Mamba-2 or hybrid decoder-only language model: the shell of `LanguageModel`
    around a `MambaStack`, with GPTModel's forward contract.

    attention_mask (True = may not attend) reaches the attention layers only: Mamba
    layers read every earlier token, so rows must be right-padded, never left-padded.
    An inference cache is a bound `HybridCache`: Mamba layers continue from each row's
    recurrent state, attention layers from its cached keys and values.

    Output projections that write into the residual stream (out_proj,
    linear_proj, linear_fc2) start at N(0, σ/√L): every layer of a hybrid stack
    has one residual branch, which is megatron-core's `is_hybrid_model` rule
    (multiplier 1 instead of the transformer's 2 in σ/√(multiplier·L))."""

    decoder_class = MambaStack
    final_norm_name = "final_norm"
    residual_branches_per_layer = 1

    def __init__(self, config: MambaConfig) -> None:
        if not isinstance(config, MambaConfig):
            raise ConfigError(
                f"MambaModel needs a MambaConfig, got {type(config).__name__}; "
                "build one with the mamba_* and hybrid_* fields"
            )
        config.validate()
        super().__init__(config)


def decoder_model(config: TransformerConfig) -> nn.Module:
    """The decoder a config describes: `MambaModel` for a `MambaConfig`, else `GPTModel`
    (built on the current default device, as their constructors are)."""
    if isinstance(config, MambaConfig):
        return MambaModel(config)
    return GPTModel(config)


# the TE spec fuses a Mamba layer's norm into the mixer's in_proj, as it fuses attention's
# and the MLP's into the linear after them (te_spec.TE_FUSED_NORMS), as ".{prefix}" keys
_FUSED_NORMS = (
    (".norm.", ".mixer.in_proj.layer_norm_"),
    *((f".{ours}", f".{theirs}") for ours, theirs in TE_FUSED_NORMS),
)


def megatron_te_names(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our keys → megatron-core MambaModel's keys with its (Transformer Engine) spec:
    each layer's norm becomes the `layer_norm_weight`/`layer_norm_bias` of the
    linear after it. `decoder.final_norm` and the mixer's own gated `norm` keep
    their names."""
    out = {}
    for key, value in state_dict.items():
        if key.startswith("decoder.layers."):
            for ours, theirs in _FUSED_NORMS:
                if ours in key and not key.split(ours)[0].endswith(".mixer"):
                    key = key.replace(ours, theirs, 1)
                    break
        out[key] = value
    return out


def from_megatron_te_names(state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
    """Inverse of `megatron_te_names`."""
    out = {}
    for key, value in state_dict.items():
        for ours, theirs in _FUSED_NORMS:
            if theirs in key:
                key = key.replace(theirs, ours, 1)
                break
        out[key] = value
    return out
