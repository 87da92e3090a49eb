"""The GPT decoder: GPT-2, Llama 2/3 and Mistral are configurations of this one model.

Read top to bottom: embedding → N × TransformerLayer → final norm → output layer
(the embedding, the output layer and its head, the init order and the forward are the
language-model shell's, `mg.core.models.language_model`, shared with MambaModel).

    TransformerLayer (pre-norm):
        x = x + dropout(linear_proj(core_attention(rope(split(linear_qkv(input_layernorm(x)))))))
    (with qk_layernorm, the split queries and keys are normed per head before RoPE)
        x = x + dropout(linear_fc2(act(linear_fc1(pre_mlp_layernorm(x)))))
    (in an MoE layer, per moe_layer_freq, `mlp` is mg.core.models.moe.MoELayer: a router
    sends each token to its top-k experts, each an MLP like the one above)

Module and parameter names are Megatron-Core's GPTModel names with its *local*
layer spec (`get_gpt_layer_local_spec`): the norms are separate modules
(`decoder.layers.{i}.input_layernorm.weight`), not fused into linear_qkv as
`linear_qkv.layer_norm_weight` the way the Transformer Engine spec names them.
So a state dict of this model is a state dict of Megatron's (minus the
`_extra_state` entries TE/Megatron add), which keeps checkpoint conversion a
matter of layout only. With `transformer_impl="transformer_engine"` the layers
take Megatron's TE-spec names instead (`mg.core.models.te_spec`). Activations
are [batch, seq, hidden] (Megatron uses [seq, batch, hidden] internally; that
never shows in the weights).

Plain PyTorch: no process groups, no parallelism. Tensor/sequence/pipeline
parallelism, recompute and compile are applied to a built model from outside
(`model.decoder.layers` is the nn.ModuleList they work on). The model builds on
the meta device: `with torch.device("meta"): m = GPTModel(cfg)`, then
`m.to_empty(device=...)` and `m.init_weights()`; a rank that holds a part of
it replays `init_units()` to give its shards the whole model's values.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from mg.core.models.activations import ACTIVATION_FUNCTIONS, activate
from mg.core.models.config import ConfigError, TransformerConfig
from mg.core.models.core_attention import build_core_attention
from mg.core.models.kv_cache import KVCache
from mg.core.models.language_model import LanguageModel
from mg.core.models.mla import MLASelfAttention
from mg.core.models.moe import MoELayer
from mg.core.models.mtp import MultiTokenPredictionBlock
from mg.core.models.norms import build_norm_1p
from mg.core.models.recompute_state import DiscardedOutput
from mg.core.models.rope import apply_rotary_pos_emb, layer_rotary
from mg.core.models.te_spec import init_linear, input_linear, uses_te_spec


def build_norm(config: TransformerConfig, size: int | None = None) -> nn.Module:
    """LayerNorm (weight and bias) or RMSNorm (weight only), as Megatron's spec picks,
    over `size` channels (default: the hidden size)."""
    size = size or config.hidden_size
    if config.layernorm_zero_centered_gamma:
        # Gemma's norms (the sandwich-norm models) compute in fp32 whatever the input
        fp32 = config.sandwich_norms
        return build_norm_1p(config.normalization, size, config.layernorm_epsilon, fp32)
    if config.normalization == "RMSNorm":
        return nn.RMSNorm(size, eps=config.layernorm_epsilon)
    return nn.LayerNorm(size, eps=config.layernorm_epsilon)


class SelfAttention(nn.Module):
    """Fused QKV projection → RoPE → core attention → output projection.

    linear_qkv layout (Megatron-Core's): output rows are grouped by query
    group, and each group holds its query heads, then its key head, then its
    value head:

        [ q(g0,h0) .. q(g0,h{n-1}) k(g0) v(g0) | q(g1,h0) .. k(g1) v(g1) | ... ]

    with n = heads / groups and each block kv_channels rows. Tensor parallelism
    splits this tensor along dim 0 into whole groups, which is why Megatron
    interleaves instead of stacking [all q; all k; all v].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        causal: bool = True,
        fused_norm: bool = False,
    ) -> None:
        super().__init__()
        self.layer_number = layer_number
        # a sliding-window layer takes the local RoPE tables where there are two (Gemma 3)
        self.window_layer = config.is_window_layer(layer_number)
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.head_dim = config.kv_channels
        qkv_size = config.query_projection_size + 2 * config.kv_projection_size
        # fused_norm (the TE spec): the layer's input norm lives inside linear_qkv
        self.linear_qkv = input_linear(
            config,
            config.hidden_size,
            qkv_size,
            bias=config.add_bias_linear or config.add_qkv_bias,
            fused_norm=fused_norm,
        )
        self.core_attention = build_core_attention(config, layer_number, causal=causal)
        self.linear_proj = nn.Linear(
            config.query_projection_size, config.hidden_size, bias=config.add_bias_linear
        )
        # --qk-layernorm: per-head norms of queries and keys, before RoPE
        self.q_layernorm = build_norm(config, self.head_dim) if config.qk_layernorm else None
        self.k_layernorm = build_norm(config, self.head_dim) if config.qk_layernorm else None

    def init_weights(self, std: float, output_std: float) -> None:
        init_linear(self.linear_qkv, std)
        if hasattr(self.core_attention, "init_weights"):  # the learnable attention sinks
            self.core_attention.init_weights(std)
        init_linear(self.linear_proj, output_std)
        for norm in (self.q_layernorm, self.k_layernorm):
            if norm is not None:
                norm.reset_parameters()

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, ...] | None,
        attention_mask: Tensor | None,
        inference_cache: KVCache | None = None,
    ) -> Tensor:
        b, s, _ = hidden.shape
        rotary = layer_rotary(rotary, self.window_layer)
        heads_per_group = self.num_heads // self.num_groups
        qkv = self.linear_qkv(hidden).view(
            b, s, self.num_groups, heads_per_group + 2, self.head_dim
        )
        query, key, value = qkv.split([heads_per_group, 1, 1], dim=3)
        query = query.reshape(b, s, self.num_heads, self.head_dim)
        key = key.reshape(b, s, self.num_groups, self.head_dim)
        value = value.reshape(b, s, self.num_groups, self.head_dim)
        if self.q_layernorm is not None:
            query, key = self.q_layernorm(query), self.k_layernorm(key)
        if rotary is not None:
            query = apply_rotary_pos_emb(query, *rotary)
            key = apply_rotary_pos_emb(key, *rotary)
        if inference_cache is not None:  # incremental decoding: the cache stores and attends
            context = inference_cache.attend(self.layer_number - 1, query, key, value)
            return self.linear_proj(context)
        context = self.core_attention(query, key, value, attention_mask=attention_mask)
        return self.linear_proj(context)


class MLP(nn.Module):
    """linear_fc1 → activation → linear_fc2.

    With a gated activation (SwiGLU/GeGLU) linear_fc1 has 2·ffn rows stacked
    as [gate; up] (Megatron's order: `torch.chunk(x, 2)` gives gate first), and
    the MLP computes act(gate) * up (clamped and offset for gpt-oss:
    mg.core.models.activations). HF Llama keeps them as gate_proj / up_proj.
    """

    def __init__(self, config: TransformerConfig, fused_norm: bool = False) -> None:
        super().__init__()
        self.gated = config.gated_linear_unit
        fc1_size = config.ffn_hidden_size * (2 if self.gated else 1)
        self.linear_fc1 = input_linear(
            config, config.hidden_size, fc1_size, config.add_bias_linear, fused_norm
        )
        self.config = config
        self.activation = ACTIVATION_FUNCTIONS[config.activation]
        self.linear_fc2 = nn.Linear(
            config.ffn_hidden_size, config.hidden_size, bias=config.add_bias_linear
        )

    def init_weights(self, std: float, output_std: float) -> None:
        init_linear(self.linear_fc1, std)
        init_linear(self.linear_fc2, output_std)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.linear_fc2(activate(self.linear_fc1(hidden), self.config))


class TransformerLayer(nn.Module):
    """One pre-norm layer; `layer_number` is 1-based as in Megatron.

    causal=False makes it an encoder layer (BERT, the T5 encoder). With
    `sandwich_norms` (Gemma 2/3) each branch is also normed before its residual add:
        x = x + post_self_attn_layernorm(attention(input_layernorm(x)))
        x = x + post_mlp_layernorm(mlp(pre_mlp_layernorm(x)))"""

    recompute_input_layernorm = False
    recompute_pre_mlp_layernorm = False
    """Megatron's `layernorm` recompute of each norm (`mg.core.models.recompute`)."""

    def __init__(self, config: TransformerConfig, layer_number: int, causal: bool = True) -> None:
        super().__init__()
        self.layer_number = layer_number
        # the TE spec fuses each norm into the linear after it (an MoE layer keeps its
        # pre-MLP norm): the norms here are then weightless identities, as in Megatron
        te = uses_te_spec(config)
        # an MTP layer (numbered after the decoder's) is of the last decoder layer's kind
        is_moe = config.moe_layer_pattern[min(layer_number, config.num_layers) - 1]
        # (multi-latent attention's input norm stays a module: its down projections are
        # plain TE Linears, the latents' norms are fused into the up projections)
        fused_input = te and not config.multi_latent_attention
        self.input_layernorm = nn.Identity() if fused_input else build_norm(config)
        self.self_attention = (  # DeepSeek's multi-latent attention (mla.py) or the usual
            MLASelfAttention(config, layer_number, build_norm)
            if config.multi_latent_attention
            else SelfAttention(config, layer_number, causal=causal, fused_norm=te)
        )
        self.pre_mlp_layernorm = nn.Identity() if te and not is_moe else build_norm(config)
        # an MoE layer (router + experts) where moe_layer_freq says so, else the dense MLP
        self.mlp = MoELayer(config, layer_number) if is_moe else MLP(config, fused_norm=te)
        sandwich = config.sandwich_norms
        self.post_self_attn_layernorm = build_norm(config) if sandwich else None
        self.post_mlp_layernorm = build_norm(config) if sandwich else None
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)

    def init_weights(self, std: float, output_std: float) -> None:
        for norm in (
            self.input_layernorm,
            self.pre_mlp_layernorm,
            self.post_self_attn_layernorm,
            self.post_mlp_layernorm,
        ):
            if norm is not None and not isinstance(norm, nn.Identity):
                norm.reset_parameters()
        self.self_attention.init_weights(std, output_std)
        self.mlp.init_weights(std, output_std)

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        inference_cache: KVCache | None = None,
    ) -> Tensor:
        # the cache goes by keyword: parallel styles describe the positional inputs only
        attention = normed_call(
            self.input_layernorm,
            self.recompute_input_layernorm,
            lambda normed: self.self_attention(
                normed, rotary, attention_mask, inference_cache=inference_cache
            ),
            hidden,
        )
        if self.post_self_attn_layernorm is not None:
            attention = self.post_self_attn_layernorm(attention)
        hidden = hidden + self.hidden_dropout(attention)
        mlp = normed_call(
            self.pre_mlp_layernorm, self.recompute_pre_mlp_layernorm, self.mlp, hidden
        )
        if self.post_mlp_layernorm is not None:
            mlp = self.post_mlp_layernorm(mlp)
        return hidden + self.hidden_dropout(mlp)


def normed_call(
    norm: nn.Module, recompute: bool, module: Callable[[Tensor], Tensor], hidden: Tensor
) -> Tensor:
    """module(norm(hidden)). With `recompute` (--recompute-modules layernorm) the norm's
    output is freed once `module` has saved it and recomputed when the backward pass
    reaches `module`; a fused norm's identity has nothing to recompute, as in Megatron."""
    if not recompute or isinstance(norm, nn.Identity):
        return module(norm(hidden))
    region = DiscardedOutput(norm)
    out = module(region.run(hidden))
    region.discard(out)
    return out


class TransformerBlock(nn.Module):
    """The layer stack and the final norm (Megatron's `decoder`, or BERT's `encoder`)."""

    def __init__(self, config: TransformerConfig, causal: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            TransformerLayer(config, layer_number=i + 1, causal=causal)
            for i in range(config.num_layers)
        )
        self.final_layernorm = build_norm(config)

    def forward(
        self,
        hidden: Tensor,
        rotary: tuple[Tensor, Tensor] | None = None,
        attention_mask: Tensor | None = None,
        inference_cache: KVCache | None = None,
    ) -> Tensor:
        for layer in self.layers:
            if inference_cache is None:
                hidden = layer(hidden, rotary, attention_mask)
            else:
                hidden = layer(hidden, rotary, attention_mask, inference_cache)
        return self.final_layernorm(hidden)


class GPTModel(LanguageModel):
    """Decoder-only transformer language model: the shell of `LanguageModel` around a
    `TransformerBlock`.

    With tied embeddings (the default, as in Megatron) there is no
    `output_layer` parameter: the logits use `embedding.word_embeddings.weight`,
    and the state dict has no `output_layer.weight`, as in Megatron's `torch`
    checkpoints with a single pipeline stage.
    """

    decoder_class = TransformerBlock
    final_norm_name = "final_layernorm"
    # Megatron's σ/√(2L): each layer writes into the residual stream twice (attention, MLP)
    residual_branches_per_layer = 2

    def __init__(self, config: TransformerConfig) -> None:
        config.validate()
        if config.transformer_layer_order != "pre_ln":
            raise ConfigError(
                "TransformerConfig.transformer_layer_order: GPTModel is pre-LN only; "
                f"got {config.transformer_layer_order!r} (post_ln is for BertModel)"
            )
        super().__init__(config)

    def build_mtp(self, config: TransformerConfig) -> nn.Module | None:
        """Megatron's `mtp` block after the decoder where `mtp_num_layers` asks for one."""
        if not config.mtp_num_layers:
            return None
        return MultiTokenPredictionBlock(config, TransformerLayer, build_norm)
