"""Against megatron-core 0.16.1 itself: same state-dict names and shapes, same logits.

Megatron-Core's GPTModel with the local layer spec is built on CPU (gloo, one
process). Its forward assumes CUDA in three places (a global memory buffer,
the default causal mask, the CUDA RNG tracker around dropout); those are
patched to CPU equivalents for the test only. Its weights are then loaded into
our GPTModel with `strict=True`, which proves the names and shapes match, and
the logits and per-token losses are compared.
"""

import pytest
import torch

pytest.importorskip("megatron.core")

from mg.core.models import GPTModel, RopeScaling, TransformerConfig  # noqa: E402
from mg.core.testing.megatron_reference import (  # noqa: E402
    megatron_gpt_model,
    megatron_on_cpu,
)

pytestmark = pytest.mark.compat


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    """megatron.core, initialised for TP = PP = 1 on CPU."""
    with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
        yield


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
    # Qwen-style QKV bias, per-head QK norms (--qk-layernorm), SwiGLU, RMSNorm,
    # untied output.
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
        qk_layernorm=True,
        untie_embeddings_and_output_weights=True,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_against_megatron_core(megatron, name):
    config = CONFIGS[name]
    torch.manual_seed(0)
    reference = megatron_gpt_model(config)
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
