"""Megatron's --apply-layernorm-1p: zero-centred norm weights, the same function at init."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.norms import LayerNorm1P, RMSNorm1P


def _config(norm: str, zero_centered: bool, **llama: object) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        vocab_size=64,
        seq_length=16,
        normalization=norm,
        layernorm_zero_centered_gamma=zero_centered,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        **llama,
    )


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_1p_norm_scales_by_one_plus_weight(norm: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8)
    w, b = torch.randn(8), torch.randn(8)
    if norm == "LayerNorm":
        layer = LayerNorm1P(8, eps=1e-5)
        layer.weight.data.copy_(w)
        layer.bias.data.copy_(b)
        expected = F.layer_norm(x, (8,), w + 1, b, 1e-5)
    else:
        layer = RMSNorm1P(8, eps=1e-5)
        layer.weight.data.copy_(w)
        # RMSNorm by its definition: x / sqrt(mean(x^2) + eps) * gamma, gamma = 1 + w
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * (w + 1)
    torch.testing.assert_close(layer(x), expected, rtol=1e-6, atol=1e-6)
    layer.reset_parameters()
    assert float(layer.weight.abs().max()) == 0.0  # zero-centred: gamma - 1 starts at 0


@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_1p_model_starts_as_the_plain_model(norm: str) -> None:
    """Same seed: every norm weight is 0 instead of 1, every other tensor equal, the
    logits equal; the zero-centred weights' gradients are the plain ones'."""
    tokens = torch.randint(0, 64, (2, 16))
    models = {}
    for zero_centered in (False, True):
        torch.manual_seed(1234)
        models[zero_centered] = GPTModel(_config(norm, zero_centered))
    plain, one_p = dict(models[False].named_parameters()), dict(models[True].named_parameters())
    assert plain.keys() == one_p.keys()  # Megatron's names, unchanged
    norm_weights = [n for n in plain if "layernorm.weight" in n]
    assert norm_weights
    for name in plain:
        if name in norm_weights:
            assert torch.equal(one_p[name], plain[name] - 1)
        else:
            assert torch.equal(one_p[name], plain[name])
    out_plain, out_1p = models[False](tokens), models[True](tokens)
    torch.testing.assert_close(out_1p, out_plain, rtol=0, atol=0)
    out_plain.float().square().mean().backward()
    out_1p.float().square().mean().backward()
    for name in plain:
        torch.testing.assert_close(one_p[name].grad, plain[name].grad, rtol=1e-6, atol=1e-7)


def test_hf_export_of_a_1p_model_is_the_plain_models() -> None:
    """HF norms scale by their weight: a zero-centred model exports gamma = 1 + weight,
    the same HF tensors as the plain model it equals."""
    from mg.core.models.hf_mapping import megatron_to_hf

    llama = {
        "position_embedding_type": "rope",
        "activation": "swiglu",
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": True,
    }
    torch.manual_seed(3)
    plain = GPTModel(_config("RMSNorm", False, **llama))
    for p in plain.parameters():  # norms away from 1, so a missing +1 shows
        p.data.add_(torch.randn_like(p) * 0.1)
    one_p_state = {
        n: t - 1 if n.endswith("layernorm.weight") else t for n, t in plain.state_dict().items()
    }
    ours = megatron_to_hf(one_p_state, _config("RMSNorm", True, **llama), "llama")
    expected = megatron_to_hf(plain.state_dict(), _config("RMSNorm", False, **llama), "llama")
    assert ours.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-7)
