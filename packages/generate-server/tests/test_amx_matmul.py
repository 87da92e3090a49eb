"""The AMX kernel's bf16 products equal fp32 matmuls to bf16 rounding, for any number of
rows (a decode step's few, zero-padded to the 16-row tiles, or a prompt chunk's many,
looped within each panel), with and without a bias, on one thread and two."""

from __future__ import annotations

import pytest
import torch

from mg.generate_server.amx_matmul import AMXLinear, amx_matmul, fits, pack_weight

KERNEL, WHY = amx_matmul()
needs_amx = pytest.mark.skipif(KERNEL is None, reason=WHY)


def test_packing_lays_out_tiles_of_input_pairs_by_columns() -> None:
    """Panel 0's first tile: row r (input pair r) holds columns 0-15, each its pair of
    inputs (2r, 2r + 1); the panel's second tile holds columns 16-31."""
    weight = torch.arange(64 * 64, dtype=torch.float32).view(64, 64)
    packed = pack_weight(weight).view(2, 2, 2, 16, 16, 2)  # panels, k-steps, tiles, ...
    assert packed[0, 0, 0, 3, 5].tolist() == [weight[5, 6].item(), weight[5, 7].item()]
    assert packed[0, 0, 1, 3, 5].tolist() == [weight[21, 6].item(), weight[21, 7].item()]
    assert packed[1, 1, 0, 0, 0].tolist() == [weight[32, 32].item(), weight[32, 33].item()]
    assert fits(weight.bfloat16()) and not fits(weight[:, :48].bfloat16())
    assert not fits(weight)  # float32


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 45, 100])
def test_products_equal_fp32_matmuls(rows: int, threads: int) -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(rows)
        for out_features, in_features in ((96, 64), (64, 160), (32, 32)):
            weight = torch.randn(out_features, in_features, generator=g).bfloat16()
            bias = torch.randn(out_features, generator=g).bfloat16()
            x = torch.randn(2, rows, in_features, generator=g).bfloat16()
            for b in (None, bias):
                got = AMXLinear(KERNEL, weight, b)(x)
                want = x.float() @ weight.float().T + (0 if b is None else b.float())
                assert got.shape == (2, rows, out_features) and got.dtype == torch.bfloat16
                # fp32 sums rounded once to bf16: within half a bf16 step (2^-9 relative)
                torch.testing.assert_close(got.float(), want, rtol=2**-8, atol=1e-3)
    finally:
        torch.set_num_threads(previous)


@needs_amx
def test_no_rows_and_strided_inputs() -> None:
    weight = torch.randn(64, 64).bfloat16()
    linear = AMXLinear(KERNEL, weight, None)
    assert linear(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 64)
    wide = torch.randn(3, 128).bfloat16()
    view = wide[:, ::2]  # not contiguous
    torch.testing.assert_close(
        linear(view).float(), view.float() @ weight.float().T, rtol=2**-8, atol=1e-3
    )
    with pytest.raises(ValueError, match="32 inputs for a \\[64, 64\\] weight"):
        linear(torch.randn(2, 32).bfloat16())
    with pytest.raises(TypeError, match="bf16 inputs only"):
        linear(torch.randn(2, 64))
