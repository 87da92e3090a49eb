"""Against megatron-core 0.16.1 itself: same state-dict names and shapes, same logits.

Megatron-Core's GPTModel with the local layer spec is built on CPU (gloo, one
process). Its forward assumes CUDA in three places (a global memory buffer,
the default causal mask, the CUDA RNG tracker around dropout); those are
patched to CPU equivalents for the test only. Its weights are then loaded into
our GPTModel with `strict=True`, which proves the names and shapes match, and
the logits and per-token losses are compared.
"""

import contextlib

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("megatron.core")

from mg.core.models import GPTModel, RopeScaling, TransformerConfig  # noqa: E402

pytestmark = pytest.mark.compat


class _NoRngTracker:
    def fork(self, name=None):
        return contextlib.nullcontext()


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """megatron.core, initialised for TP = PP = 1 on CPU."""
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.tensor_parallel as tensor_parallel
    import megatron.core.utils as mcore_utils
    from megatron.core import parallel_state

    patches = pytest.MonkeyPatch()
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
    store = tmp_path_factory.mktemp("pg") / "store"
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        patches.undo()


def _megatron_model(ours: TransformerConfig):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel as MegatronGPTModel
    from megatron.core.transformer.transformer_config import (
        TransformerConfig as MegatronTransformerConfig,
    )

    gated = ours.gated_linear_unit
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
        attention_dropout=0.0,
        hidden_dropout=0.0,
        init_method_std=ours.init_method_std,
        use_cpu_initialization=True,
        transformer_impl="local",
    )
    rope = ours.position_embedding_type == "rope"
    return MegatronGPTModel(
        config,
        get_gpt_layer_local_spec(normalization=ours.normalization),
        vocab_size=ours.vocab_size,
        max_sequence_length=ours.max_position_embeddings,
        position_embedding_type=ours.position_embedding_type,
        share_embeddings_and_output_weights=not ours.untie_embeddings_and_output_weights,
        rotary_percent=ours.rotary_percent,
        rotary_base=int(ours.rotary_base),
        rope_scaling=ours.rope_scaling is not None,
        rope_scaling_factor=ours.rope_scaling.factor if rope and ours.rope_scaling else 8.0,
    ).eval()


CONFIGS = {
    # GPT-2 style: LayerNorm with biases, learned positions, erf GELU, tied output.
    "gpt2-like": TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        seq_length=16,
        activation="gelu",
    ),
    # Llama 3.1 style plus the less common switches: GQA, RoPE on half the
    # channels with llama3 scaling (Megatron's fixed 1/4/8192 factors), a
    # Qwen-style QKV bias, SwiGLU, RMSNorm, untied output.
    "llama-like": TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        vocab_size=128,
        seq_length=16,
        position_embedding_type="rope",
        rotary_base=500000.0,
        rotary_percent=0.5,
        rope_scaling=RopeScaling(),
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        add_qkv_bias=True,
        untie_embeddings_and_output_weights=True,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_against_megatron_core(megatron, name):
    config = CONFIGS[name]
    torch.manual_seed(0)
    reference = _megatron_model(config)
    with torch.no_grad():  # random norms and biases too, so their names are checked
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    weights = {k: v for k, v in reference.state_dict().items() if not k.endswith("_extra_state")}

    ours = GPTModel(config).eval()
    ours.load_state_dict(weights, strict=True)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in weights.items()
    }

    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.roll(ids, -1, dims=1)
    positions = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        expected_logits = reference(ids, positions, None)
        expected_loss = reference(ids, positions, None, labels=labels)
        logits, loss = ours(ids), ours(ids, labels=labels)
    diff = (logits - expected_logits).abs().max().item()
    print(f"{name}: max |logits diff| vs megatron-core = {diff:.3g}")
    assert diff <= 1e-4
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=1e-4)


def test_rope_frequencies_match_megatron(megatron):
    """Llama-3.1 scaling at Llama's real head size, where all three frequency bands occur."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from mg.core.models.rope import rope_inv_freq

    for scaling in (None, RopeScaling(factor=8.0)):
        config = TransformerConfig(
            num_layers=1,
            hidden_size=4096,
            num_attention_heads=32,
            vocab_size=8,
            position_embedding_type="rope",
            rotary_base=500000.0,
            rope_scaling=scaling,
        )
        reference = RotaryEmbedding(
            kv_channels=128,
            rotary_percent=1.0,
            rotary_base=500000,
            rope_scaling=scaling is not None,
            rope_scaling_factor=8.0,
            use_cpu_initialization=True,
        )
        torch.testing.assert_close(rope_inv_freq(config), reference.inv_freq, rtol=1e-6, atol=0)
