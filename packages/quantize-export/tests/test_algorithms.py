"""GPTQ, AWQ and SmoothQuant against hand-worked small cases."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mg.core.quantization.primitives import dequantize_int4, quantize_int4
from mg.quantize_export.awq import apply_awq_clip, search_awq_clip, search_awq_scales
from mg.quantize_export.gptq import HessianAccumulator, gptq_quantize
from mg.quantize_export.smoothquant import fold_into_norm, smoothing_factors


def test_gptq_hand_worked_two_columns() -> None:
    # One row w = [0.3, 0.1], one group of 2, symmetric: scale = 0.3 / 7.5 = 0.04.
    # Column 0: 0.3 / 0.04 = 7.5 -> 8 (half-even) -> clamps to q - 8 = 7 -> 0.28, error 0.02.
    # OBS update of column 1 with H = [[2, 1], [1, 2]]: w1 += 0.02 * H01 / H11 = 0.11
    # -> 0.11 / 0.04 = 2.75 -> 3 -> 0.12 (round-to-nearest gives 2.5 -> 2 -> 0.08).
    w = torch.tensor([[0.3, 0.1]])
    h = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
    q, scale, zero = gptq_quantize(w, h, group_size=2, percdamp=0.0)
    assert scale.item() == pytest.approx(0.04) and zero.item() == 8
    assert q.tolist() == [[15, 11]]
    assert dequantize_int4(q, scale, zero)[0].tolist() == pytest.approx([0.28, 0.12])
    rtn = dequantize_int4(*quantize_int4(w, 2))
    assert rtn[0].tolist() == pytest.approx([0.28, 0.08])

    # the loss (q - w) H (q - w)^T: 0.0008 for GPTQ against 0.0024 for round-to-nearest
    def loss(wq):
        e = wq - w
        return (e @ h @ e.t()).item()

    assert loss(dequantize_int4(q, scale, zero)) == pytest.approx(0.0008, abs=1e-7)
    assert loss(rtn) == pytest.approx(0.0024, abs=1e-7)
    # 1% damping: H11 becomes 2.02, w1 = 0.1 + 0.02 / 2.02 = 0.1099 -> still 3
    q, _, _ = gptq_quantize(w, h, group_size=2, percdamp=0.01)
    assert q.tolist() == [[15, 11]]


def test_gptq_act_order_visits_the_largest_diagonal_first() -> None:
    # H = [[1, .5], [.5, 4]]: column 1 goes first with act-order.
    # In order: col 0 -> 0.28 (error .02), w1 = 0.1 + .02 * .5 / 4 = 0.1025 -> 2.56 -> 3 -> 0.12.
    # Act-order: col 1 -> 2.5 -> 2 -> 0.08 (error .02), w0 = 0.3 + .02 * .5 / 1 = 0.31
    # -> 7.75 -> 8 -> clamps to 7 -> 0.28.
    w = torch.tensor([[0.3, 0.1]])
    h = torch.tensor([[1.0, 0.5], [0.5, 4.0]])
    q, s, z = gptq_quantize(w, h, group_size=2, percdamp=0.0)
    assert dequantize_int4(q, s, z)[0].tolist() == pytest.approx([0.28, 0.12])
    q, s, z = gptq_quantize(w, h, group_size=2, percdamp=0.0, act_order=True)
    assert dequantize_int4(q, s, z)[0].tolist() == pytest.approx([0.28, 0.08])


def test_hessian_accumulator_is_two_x_transpose_x_over_n() -> None:
    x = torch.randn(10, 4, dtype=torch.float64)
    acc = HessianAccumulator(4)
    acc.add(x[:3])
    acc.add(x[3:])
    assert torch.allclose(acc.hessian, 2 * x.t() @ x / 10)


def test_gptq_beats_round_to_nearest_on_correlated_inputs() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g)
    x = torch.randn(512, 64, generator=g) @ torch.randn(64, 64, generator=g)  # correlated
    acc = HessianAccumulator(64)
    acc.add(x)
    rtn = dequantize_int4(*quantize_int4(w, 32))
    gptq = dequantize_int4(*gptq_quantize(w, acc.hessian.float(), 32))
    for_order = dequantize_int4(*gptq_quantize(w, acc.hessian.float(), 32, act_order=True))
    out_err = lambda wq: (x @ (wq - w).t()).pow(2).mean().item()  # noqa: E731
    assert out_err(gptq) < 0.6 * out_err(rtn)
    assert out_err(for_order) < 0.6 * out_err(rtn)


def test_awq_hand_worked_scale_search() -> None:
    # x = [4, 1], w = [0.1, 0.3], one group of 2, grid {0, 0.5}.
    # alpha 0: s = [1, 1]; RTN scale 0.3/7.5 = .04: 0.1 -> 2.5 -> 2 -> .08, 0.3 -> 7 -> .28:
    #   output 4*.08 + .28 = .60 against .70: loss .01.
    # alpha .5: s = [2, 1] / sqrt(2) = [1.4142, .7071]; w*s = [.14142, .21213], scale .028284:
    #   5 -> .14142, 7.5 -> 7 -> .19799; divided back: [.1, .28]: output .68, loss .0004.
    x = torch.tensor([[4.0, 1.0]])
    w = torch.tensor([[0.1, 0.3]])
    scales, alpha = search_awq_scales(w, x, group_size=2, n_grid=2)
    assert alpha == 0.5
    assert scales.tolist() == pytest.approx([2**0.5, 2**-0.5])


def test_awq_duo_scaling_never_loses_to_either_form() -> None:
    # Duo form at alpha 0 on the case above: w / group max = [1/3, 1], s = 1 / w_mean
    # normalised = [1.7319, .5774]; w*s = [.17319, .17322], scale .023096: 7.499 -> 7,
    # 7.5 -> 8 -> 7; back: [.09335, .28]: output .6534, loss .00217 > .0004 of x-only
    # alpha .5, so "both" keeps the x-only scales here.
    x = torch.tensor([[4.0, 1.0]])
    w = torch.tensor([[0.1, 0.3]])
    scales, alpha = search_awq_scales(w, x, group_size=2, n_grid=2, duo_scaling="both")
    assert alpha == 0.5 and scales.tolist() == pytest.approx([2**0.5, 2**-0.5])
    torch.manual_seed(0)
    x, w = torch.randn(64, 128) * torch.rand(128) * 4, torch.randn(32, 128)

    def loss(s: torch.Tensor) -> float:
        from mg.quantize_export.awq import fake_quantize_int4

        return (x @ w.t() - x @ (fake_quantize_int4(w * s, 32, True) / s).t()).pow(2).mean()

    found = {form: search_awq_scales(w, x, 32, duo_scaling=form)[0] for form in (False, True)}
    both = search_awq_scales(w, x, 32, duo_scaling="both")[0]
    assert loss(both) <= min(loss(found[False]), loss(found[True])) + 1e-12


def test_awq_hand_worked_clip_search() -> None:
    # One token x = [0, 1, 1, 1], one group of 4 per row, grid of 20, shrink up to half
    # (max |w| times 1, .95, ..., .55). Symmetric int4: scale = max / 7.5.
    # Row 0, w = [3.75, .3, .3, .3]: unclipped, scale .5 rounds each .3 to .5 (output 1.5
    #   against .9). Clipped to 3.75 * .6 = 2.25, scale .3 holds .3 exactly: error 0 (the
    #   clipped 3.75 meets x = 0). Neighbours: .65 -> scale .325, .55 -> .275, both off.
    # Row 1, w = [.3] * 4: unclipped .3 / .04 = 7.5 rounds to 8, clamps to 7: .28 each
    #   (output .84 against .9); clipping to m gives 7 * m / 7.5 < .28: worse, so no clip.
    x = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    w = torch.tensor([[3.75, 0.3, 0.3, 0.3], [0.3, 0.3, 0.3, 0.3]])
    max_val = search_awq_clip(w, x, group_size=4)
    assert max_val.shape == (2, 1)
    assert max_val[:, 0].tolist() == pytest.approx([2.25, 0.3])
    clipped = w.clone()
    apply_awq_clip(clipped, max_val)
    assert clipped.flatten().tolist() == pytest.approx([2.25, 0.3, 0.3, 0.3] + [0.3] * 4)
    # an output-row batch smaller than the rows gives the same answer
    assert torch.equal(search_awq_clip(w, x, group_size=4, rows_per_batch=1), max_val)


def test_smoothquant_factors_and_fold_preserve_the_function() -> None:
    # s_j = amax_x^a / amax_w^(1-a): channel 0: 16^.5 / 1^.5 = 4, channel 1: 1^.5 / .25^.5 = 2
    act = torch.tensor([16.0, 1.0])
    w = torch.tensor([[1.0, -0.25], [0.5, 0.25]])
    assert smoothing_factors(act, w, 0.5).tolist() == pytest.approx([4.0, 2.0])
    torch.manual_seed(0)
    norm, linear = nn.LayerNorm(8), nn.Linear(8, 4)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    x = torch.randn(3, 8)
    before = linear(norm(x))
    fold_into_norm(norm, linear, torch.rand(8) + 0.5)
    assert torch.allclose(linear(norm(x)), before, atol=1e-5)


def test_awq_folds_the_attention_output_scales_into_the_value_rows() -> None:
    """With one value head per query head, linear_proj's AWQ scales divide the value rows
    of linear_qkv: the float model computes the same function before rounding."""
    from mg.core.models import GPTModel
    from mg.core.models.presets import tiny_llama
    from mg.quantize_export.recipes import RecipeOptions, _apply_awq, _value_rows

    torch.manual_seed(0)
    config = tiny_llama(vocab_size=128, num_attention_heads=4, num_query_groups=4)
    model = GPTModel(config).eval()
    rows = _value_rows(config)
    d = config.kv_channels
    assert rows[:2].tolist() == [2 * d, 2 * d + 1] and rows[d].item() == 5 * d  # head 1's v
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        before = model(ids)
        name = "decoder.layers.0.self_attention.linear_proj"
        inputs = torch.randn(64, config.hidden_size) * torch.rand(config.hidden_size) * 3
        scales = _apply_awq(model, name, inputs, RecipeOptions("int4_awq", group_size=32))
        after = model(ids)
    assert scales is not None and not torch.allclose(scales, torch.ones_like(scales))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-5)
    assert _value_rows(tiny_llama(num_attention_heads=4, num_query_groups=2)) is None
