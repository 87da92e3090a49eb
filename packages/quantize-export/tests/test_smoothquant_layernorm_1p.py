"""SmoothQuant's fold into a zero-centred norm (--apply-layernorm-1p): gamma = 1 + weight
is what gets divided, so the smoothed pair computes what the pair did."""

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
