"""Parameter count and FLOPs from a config, checked against real models and by hand."""

import pytest
import torch

from mg.core.models import GPTModel, num_floating_point_operations, num_parameters, presets


@pytest.mark.parametrize("name", sorted(presets.PRESETS))
def test_num_parameters_matches_the_built_model(name):
    config = presets.PRESETS[name]()
    with torch.device("meta"):  # full-size models cost nothing on meta
        model = GPTModel(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())
    embeddings = model.embedding.word_embeddings.weight.numel()
    if model.embedding.position_embeddings is not None:
        embeddings += model.embedding.position_embeddings.weight.numel()
    if model.output_layer is not None:
        embeddings += model.output_layer.weight.numel()
    assert num_parameters(config, include_embeddings=False) == num_parameters(config) - embeddings


def test_published_parameter_counts():
    assert num_parameters(presets.llama2_7b()) == 6_738_415_616
    assert num_parameters(presets.llama3_8b()) == 8_030_261_248
    assert num_parameters(presets.mistral_7b()) == 7_241_732_096
    # GPT-2 small is 124,439,808 with its 50257 tokens; Megatron pads to 50304.
    assert num_parameters(presets.gpt2_124m(vocab_size=50257)) == 124_439_808


def _matmul_flops(config, batch, seq):
    """Independent count: 2 FLOPs per multiply-add of every forward matmul, x3 for
    forward + backward; causal attention counts half of the s x s scores."""
    c, tokens = config, batch * seq
    h, qh, kvh, f = c.hidden_size, c.query_projection_size, c.kv_projection_size, c.ffn_hidden_size
    per_token_layer = (
        2 * h * (qh + 2 * kvh)  # linear_qkv
        + 2 * qh * h  # linear_proj
        + 2 * 2 * (seq / 2) * qh  # q·kᵀ and probs·v over half the keys on average
        + 2 * h * f * (2 if c.gated_linear_unit else 1)  # linear_fc1
        + 2 * f * h  # linear_fc2
    )
    per_token = c.num_layers * per_token_layer + 2 * h * c.vocab_size  # + logits
    return 3 * tokens * per_token


@pytest.mark.parametrize("name", ["gpt2-124m", "llama3-8b", "mistral-7b", "tiny-llama"])
def test_flops_formula_equals_matmul_count(name):
    config = presets.PRESETS[name]()
    flops = num_floating_point_operations(config, batch_size=8)
    assert flops == pytest.approx(_matmul_flops(config, 8, config.seq_length), rel=1e-12)


def test_flops_reference_formula_by_hand():
    # GPT-2 124M, B=8, s=1024: 12·B·s·L·h²·[(1 + 1 + s/2h)·1 + 4] + 6·B·s·h·V
    B, s, L, h, V = 8, 1024, 12, 768, 50304
    expected = 12 * B * s * L * h * h * ((2 + s / (2 * h)) + 4) + 6 * B * s * h * V
    assert num_floating_point_operations(presets.gpt2_124m(), B) == pytest.approx(expected)
