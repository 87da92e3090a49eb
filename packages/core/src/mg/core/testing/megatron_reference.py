"""megatron-core's GPTModel on CPU, as the reference our models and converters are checked against.

megatron-core (a test-only dependency) assumes CUDA in three places on its
forward path: the global memory buffer, the default causal mask and the RNG
tracker. `megatron_cpu_patches` patches exactly those (multi-rank workers use it
directly); `megatron_on_cpu` applies them for a test session and sets up a 1-rank
gloo group with TP = PP = 1; `megatron_gpt_model`
builds the Megatron-Core `GPTModel` (local layer spec) matching one of our
`TransformerConfig`s, MoE ones included (its MoE layers from
`get_gpt_decoder_block_spec`, which follows `moe_layer_freq`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from mg.core.models import TransformerConfig


class _NoRngTracker:
    def fork(self, name: str | None = None) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()


def megatron_cpu_patches() -> Any:
    """The patches (a pytest.MonkeyPatch, undo() when done) that let megatron-core's forward
    run on CPU: device queries, the global memory buffer, the causal mask, the RNG tracker,
    and Tensor.cuda (a tied model's last pipeline stage calls it to sync its embedding)."""
    # lazy: megatron-core and pytest are test-only dependencies
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.utils as mcore_utils
    import pytest

    patches = pytest.MonkeyPatch()
    # a megatron-core model writes its attention backend into these variables at
    # construction (and asserts on them at the next): undo() gives back the caller's,
    # so that a later model, or a subprocess this process starts, sees none of them
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        patches.setenv(name, "")  # records the caller's value (or its absence) for undo()
        patches.delenv(name)
    patches.setattr(torch.cuda, "current_device", lambda: "cpu")
    patches.setattr(
        mcore_utils.GlobalMemoryBuffer,
        "get_tensor",
        lambda self, shape, dtype, name, mem_alloc_context=None: torch.empty(shape, dtype=dtype),
    )
    patches.setattr(
        fused_softmax,
        "get_default_causal_mask",
        lambda sq: torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1),
    )
    patches.setattr(tensor_parallel, "get_cuda_rng_tracker", lambda *a, **k: _NoRngTracker())
    patches.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    try:  # 0.16.1's MoE utilities read this name unguarded when Transformer Engine is absent
        import megatron.core.transformer.moe.moe_utils as moe_utils  # lazy: test-only
    except ImportError:
        pass
    else:
        patches.setattr(moe_utils, "te_general_gemm", None, raising=False)
    # 0.16.1's MLA takes its TE stubs (None classes) for Transformer Engine and fails an
    # isinstance check on them; without TE that branch is off
    import megatron.core.transformer.multi_latent_attention as mla_module  # lazy: test-only

    patches.setattr(mla_module, "HAVE_TE", False)
    return patches


# Tiny shapes that exercise Megatron's naming and layout differences: GPT-2 (tied,
# biases, LayerNorm) and a Llama/Qwen3 shape (untied, GQA, SwiGLU, RMSNorm, QK norms).
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "gpt2": dict(normalization="LayerNorm"),
    "llama": dict(
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        position_embedding_type="rope",
        untie_embeddings_and_output_weights=True,
        num_query_groups=2,
        qk_layernorm=True,
    ),
}


def tiny_config(shape: str, num_layers: int = 2) -> TransformerConfig:
    """One of `TINY_SHAPES` as a 64-wide, 128-token-vocabulary config."""
    return TransformerConfig(
        num_layers=num_layers,
        hidden_size=64,
        num_attention_heads=4,
        ffn_hidden_size=96,
        vocab_size=128,
        max_position_embeddings=32,
        seq_length=16,
        **TINY_SHAPES[shape],
    )


def megatron_optimizer_cpu_patches(patches: Any) -> None:
    """Add to `patches` what megatron-core's DDP and DistributedOptimizer need on CPU:
    tensors it creates on "cuda" go to the CPU, and CPU tensors report CUDA type names
    (it checks `param.type()` against "torch.cuda.FloatTensor")."""

    def on_cpu(factory: Any) -> Any:
        @functools.wraps(factory)
        def make(*args: Any, **kwargs: Any) -> Any:
            if str(kwargs.get("device", "")).startswith("cuda"):
                kwargs["device"] = "cpu"
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "zeros", "empty", "ones", "full"):
        patches.setattr(torch, name, on_cpu(getattr(torch, name)))
    type_name = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            return type_name(self, *args, **kwargs)
        return type_name(self).replace("torch.", "torch.cuda.", 1)

    patches.setattr(torch.Tensor, "type", cuda_type)


@contextlib.contextmanager
def megatron_on_cpu(scratch: Path) -> Iterator[None]:
    """megatron.core initialised for TP = PP = 1 on CPU; `scratch` holds the gloo file store."""
    # lazy: megatron-core is a test-only dependency
    from megatron.core import parallel_state

    patches = megatron_cpu_patches()
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{scratch / 'store'}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        patches.undo()


def megatron_gpt_model(ours: TransformerConfig, **parallel: Any) -> Any:
    """Megatron-Core's GPTModel (local spec, no dropout, eval mode) with our config's shapes.

    ``parallel``: more Megatron TransformerConfig fields (``expert_model_parallel_size``,
    ``sequence_parallel``…) for a rank of a parallel layout."""
    # lazy: megatron-core is a test-only dependency
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel as MegatronGPTModel
    from megatron.core.transformer.transformer_config import (
        TransformerConfig as MegatronTransformerConfig,
    )

    gated = ours.gated_linear_unit
    moe: dict[str, Any] = {}
    if ours.num_moe_experts:  # the MoE fields have Megatron-Core's names
        moe = {
            f.name: getattr(ours, f.name)
            for f in dataclasses.fields(ours)
            if f.name.startswith("moe_")
        }
        moe["num_moe_experts"] = ours.num_moe_experts
    config = MegatronTransformerConfig(
        num_layers=ours.num_layers,
        hidden_size=ours.hidden_size,
        num_attention_heads=ours.num_attention_heads,
        num_query_groups=ours.num_query_groups,
        ffn_hidden_size=ours.ffn_hidden_size,
        kv_channels=ours.kv_channels,
        normalization=ours.normalization,
        layernorm_epsilon=ours.layernorm_epsilon,
        gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
        add_bias_linear=ours.add_bias_linear,
        add_qkv_bias=ours.add_qkv_bias,
        qk_layernorm=ours.qk_layernorm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=ours.init_method_std,
        use_cpu_initialization=True,
        transformer_impl="local",
        **moe,
        **parallel,
    )
    if ours.num_moe_experts:
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization=ours.normalization
        )
    else:
        spec = get_gpt_layer_local_spec(
            normalization=ours.normalization, qk_layernorm=ours.qk_layernorm
        )
    return MegatronGPTModel(
        config,
        spec,
        vocab_size=ours.vocab_size,
        max_sequence_length=ours.max_position_embeddings,
        position_embedding_type=ours.position_embedding_type,
        share_embeddings_and_output_weights=not ours.untie_embeddings_and_output_weights,
        rotary_percent=ours.rotary_percent,
        rotary_base=int(ours.rotary_base),
        rope_scaling=ours.rope_scaling is not None,
        rope_scaling_factor=ours.rope_scaling.factor if ours.rope_scaling else 8.0,
    ).eval()


def _mla_dot_product_attention() -> Any:
    # lazy: megatron-core is a test-only dependency
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    class MLADotProductAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs) -> None:
            super().__init__(*args, **kwargs)

    return MLADotProductAttention


def megatron_mla_gpt_model(ours: TransformerConfig) -> Any:
    """Megatron-Core's GPTModel with MLASelfAttention (local spec, SwiGLU, untied) of our
    config's shape. 0.16.1's local DotProductAttention does not take the k_channels /
    v_channels MLA passes it: the spec gets a subclass that drops them (kv_channels =
    v_head_dim gives its output width)."""
    # lazy: megatron-core is a test-only dependency
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel as MegatronGPTModel
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = MLATransformerConfig(
        num_layers=ours.num_layers,
        hidden_size=ours.hidden_size,
        num_attention_heads=ours.num_attention_heads,
        ffn_hidden_size=ours.ffn_hidden_size,
        normalization=ours.normalization,
        layernorm_epsilon=ours.layernorm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        qk_layernorm=ours.qk_layernorm,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        transformer_impl="local",
        kv_channels=ours.v_head_dim,  # the local attention's output width per head
        multi_latent_attention=True,
        q_lora_rank=ours.q_lora_rank,
        kv_lora_rank=ours.kv_lora_rank,
        qk_head_dim=ours.qk_head_dim,
        qk_pos_emb_head_dim=ours.qk_pos_emb_head_dim,
        v_head_dim=ours.v_head_dim,
        rope_type=ours.rope_type,
        rotary_base=ours.rotary_base,
        rotary_scaling_factor=ours.rotary_scaling_factor,
        original_max_position_embeddings=ours.original_max_position_embeddings,
        beta_fast=ours.beta_fast,
        beta_slow=ours.beta_slow,
        mscale=ours.mscale,
        mscale_all_dim=ours.mscale_all_dim,
        apply_rope_fusion=False,
    )
    spec = get_gpt_layer_local_spec(
        normalization=ours.normalization,
        qk_layernorm=ours.qk_layernorm,
        multi_latent_attention=True,
    )
    spec.submodules.self_attention.submodules.core_attention = _mla_dot_product_attention()
    return MegatronGPTModel(
        config,
        spec,
        vocab_size=ours.vocab_size,
        max_sequence_length=ours.max_position_embeddings,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
        rotary_base=int(ours.rotary_base),
    ).eval()
