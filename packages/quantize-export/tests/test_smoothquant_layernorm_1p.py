"""Zero-centred norms (--apply-layernorm-1p, gamma = 1 + weight) in the exports:
SmoothQuant divides gamma, so the smoothed pair computes what the pair did; GGUF
writes gamma, the scale llama.cpp's norms multiply by."""

import pytest
import torch

from mg.core.models.norms import LayerNorm1P, RMSNorm1P
from mg.quantize_export.smoothquant import fold_into_norm


@pytest.mark.parametrize("norm_class", [LayerNorm1P, RMSNorm1P])
def test_fold_into_a_zero_centred_norm_keeps_the_output(norm_class) -> None:
    torch.manual_seed(0)
    norm, linear = norm_class(16), torch.nn.Linear(16, 8)
    with torch.no_grad():
        norm.weight.normal_(0, 0.3)
        if getattr(norm, "bias", None) is not None:
            norm.bias.normal_(0, 0.3)
    x = torch.randn(4, 16)
    before = linear(norm(x))
    fold_into_norm(norm, linear, torch.rand(16) * 3 + 0.2)
    torch.testing.assert_close(linear(norm(x)), before, rtol=1e-5, atol=1e-5)


def test_gguf_writes_the_zero_centred_norms_gamma() -> None:
    from mg.quantize_export.gguf_export import norm_gamma

    plain, one_p = torch.nn.RMSNorm(8), RMSNorm1P(8)
    with torch.no_grad():
        plain.weight.normal_(1, 0.2)
        one_p.weight.copy_(plain.weight - 1)
    torch.testing.assert_close(norm_gamma(one_p), plain.weight.detach(), rtol=0, atol=1e-7)
    assert torch.equal(norm_gamma(plain), plain.weight.detach())
