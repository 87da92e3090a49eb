"""A gpt-oss-shaped GPTModel against megatron-core 0.16.1's (local spec, CPU) on the same
weights: learnable attention sinks (`softmax_offset`), alternating sliding-window / full
layers, the clamped quick-GeGLU with its linear offset in biased experts, a biased router."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.core.testing.megatron_reference import megatron_on_cpu

pytestmark = [pytest.mark.compat, pytest.mark.slow]  # megatron-core's import: ~1 min

CONFIG = TransformerConfig(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=128,
    seq_length=16,
    position_embedding_type="rope",
    normalization="RMSNorm",
    untie_embeddings_and_output_weights=True,
    activation="quick_geglu",
    glu_linear_offset=1.0,
    activation_func_clamp_value=7.0,
    softmax_type="learnable",
    window_size=(4, 0),
    window_attn_skip_freq=2,
    num_moe_experts=4,
    moe_ffn_hidden_size=48,
    moe_router_topk=2,
    attention_dropout=0.0,
    hidden_dropout=0.0,
)


def _megatron_model(ours: TransformerConfig):
    """megatron-core's GPTModel with gpt-oss's settings (Megatron's field names)."""
    # lazy: megatron-core is a test-only dependency
    from megatron.core.fusions.fused_bias_geglu import quick_gelu
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.models.gpt.gpt_model import GPTModel as MegatronGPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig as Config

    config = Config(
        num_layers=ours.num_layers,
        hidden_size=ours.hidden_size,
        num_attention_heads=ours.num_attention_heads,
        num_query_groups=ours.num_query_groups,
        ffn_hidden_size=ours.ffn_hidden_size,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=quick_gelu,
        bias_activation_fusion=False,
        glu_linear_offset=ours.glu_linear_offset,
        activation_func_clamp_value=ours.activation_func_clamp_value,
        softmax_type="learnable",
        window_size=ours.window_size,
        window_attn_skip_freq=ours.window_attn_skip_freq,
        add_bias_linear=True,
        num_moe_experts=ours.num_moe_experts,
        moe_ffn_hidden_size=ours.moe_ffn_hidden_size,
        moe_router_topk=ours.moe_router_topk,
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        transformer_impl="local",
    )
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    return MegatronGPTModel(
        config,
        spec,
        vocab_size=ours.vocab_size,
        max_sequence_length=ours.max_position_embeddings,
        position_embedding_type="rope",
        share_embeddings_and_output_weights=False,
    ).eval()


def test_gpt_oss_shape_against_megatron_core(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")  # here, not at import: a slow test's import cost
    import megatron.core.fusions.fused_softmax as fused_softmax

    def sliding_window_mask(sq: int, skv: int, window: tuple[int, int]) -> torch.Tensor:
        """Megatron's get_sliding_window_causal_mask, on the CPU (its own asks for CUDA)."""
        m = torch.ones(sq, skv, dtype=torch.bool)
        return ~torch.tril(
            torch.triu(m, diagonal=skv - sq - window[0]), diagonal=skv - sq + window[1]
        )

    monkeypatch.setattr(fused_softmax, "get_sliding_window_causal_mask", sliding_window_mask)
    with megatron_on_cpu(tmp_path):
        torch.manual_seed(0)
        reference = _megatron_model(CONFIG)
        with torch.no_grad():  # random biases, norms and sinks too, so every name is checked
            for name, p in reference.named_parameters():
                p.add_(torch.randn_like(p) * (1.0 if "softmax_offset" in name else 0.3))
        weights = {k: v for k, v in reference.state_dict().items() if "_extra_state" not in k}
        ours = GPTModel(CONFIG).eval()
        ours.load_state_dict(weights, strict=True)
        ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
        positions = torch.arange(16).expand(2, 16)
        with torch.no_grad():
            expected = reference(ids, positions, None)
            logits = ours(ids)
            no_sinks = {
                k: (torch.full_like(v, -1e4) if "softmax_offset" in k else v)
                for k, v in weights.items()
            }
            ours.load_state_dict(no_sinks)
            without = ours(ids)
    diff = (logits - expected).abs().max().item()
    print(f"gpt-oss shape: max |logits diff| vs megatron-core = {diff:.3g}")
    assert diff <= 1e-4, diff
    assert (without - expected).abs().max().item() > 1e-2  # the sinks matter here
