"""Quantized linears: quantize → dequantize error bounds, and each module's matmul path
(real CPU kernels) against the dequantized weight in float."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mg.core.quantization import (
    Fp8Linear,
    Int4WeightOnlyLinear,
    Int8DynamicLinear,
    Int8WeightOnlyLinear,
    QuantizationConfig,
    QuantizationError,
    kernel_paths,
    quantize_layout,
)
from mg.core.quantization import primitives as P


def _weight(out: int = 48, inp: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))


def test_int8_per_channel_error_is_at_most_half_a_step() -> None:
    w = _weight()
    q, scale = P.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and scale.shape == (48,)
    assert torch.allclose(scale, w.abs().amax(1) / 127)
    err = (P.dequantize_int8(q, scale) - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-7).all()
    # the extreme of each row is exact (±127 steps)
    assert torch.allclose(P.dequantize_int8(q, scale).abs().amax(1), w.abs().amax(1))


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_grouped_error_is_at_most_half_a_step(group: int, symmetric: bool) -> None:
    w = _weight()
    q, scale, zero = P.quantize_int4(w, group, symmetric)
    assert q.min() >= 0 and q.max() <= 15
    assert scale.shape == (48, 128 // group)
    deq = P.dequantize_int4(q, scale, zero)
    step = scale.repeat_interleave(group, 1)
    if symmetric:
        assert (zero == 8).all()
        # [-8, 7] steps of amax / 7.5: the positive extreme may clip by half a step
        assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    else:
        assert ((deq - w).abs() <= step / 2 + 1e-6).all()
    # grouped beats per-row at the same bit width
    rel = (deq - w).norm() / w.norm()
    assert rel < {32: 0.11, 64: 0.12, 128: 0.13}[group]


def test_int4_hand_worked_group() -> None:
    w = torch.tensor([[-1.5, 0.0, 0.75, 3.0]])
    q, scale, zero = P.quantize_int4(w, 4, symmetric=True)
    assert scale.item() == pytest.approx(3.0 / 7.5)  # 0.4
    # -1.5/0.4 = -3.75 -> -4; 0 -> 0; 0.75/0.4 = 1.875 -> 2; 3/0.4 = 7.5 -> 8 (half-even) -> clamp 7
    assert q.tolist() == [[4, 8, 10, 15]]
    q, scale, zero = P.quantize_int4(w, 4, symmetric=False)
    assert scale.item() == pytest.approx(4.5 / 15)  # 0.3
    assert zero.item() == 5  # round(1.5 / 0.3)
    assert q.tolist() == [[0, 5, 7, 15]]  # -5, 0, 2.5 -> 2 (half-even), 10; plus 5


def test_group_size_must_divide_in_features() -> None:
    with pytest.raises(QuantizationError, match="group size 48 does not divide its 128"):
        P.quantize_int4(_weight(), 48)


def test_pack_unpack_int4_round_trip() -> None:
    q = torch.randint(0, 16, (16, 64), dtype=torch.int8)
    packed = P.pack_int4(q)
    assert packed.shape == (16, 32) and packed.dtype == torch.uint8
    assert packed[0, 0].item() == q[0, 0].item() | (q[0, 1].item() << 4)
    assert torch.equal(P.unpack_int4(packed), q)


@pytest.mark.parametrize("per_channel", [False, True])
def test_fp8_error_is_within_e4m3_precision(per_channel: bool) -> None:
    w = _weight()
    q, scale = P.quantize_fp8(w, per_channel)
    assert q.dtype == torch.float8_e4m3fn
    assert scale.shape == ((48,) if per_channel else ())
    deq = P.dequantize_fp8(q, scale)
    # E4M3 has 3 mantissa bits: relative rounding error <= 2^-4 for normal values
    s = scale[:, None] if per_channel else scale
    normal = (w / s).abs() >= 2**-6
    assert ((deq - w).abs()[normal] <= (w.abs() * 2**-4)[normal] + 1e-7).all()
    assert torch.allclose(
        deq.abs().amax(1 if per_channel else None), w.abs().amax(1 if per_channel else None)
    )


def test_per_token_int8_activation() -> None:
    x = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 0.0]])
    q, s = P.quantize_int8_per_token(x)
    assert s[0].item() == pytest.approx(2 / 127)
    assert q[0].tolist() == [64, -127, 32]  # 63.5 -> 64 (half-even), 31.75 -> 32
    assert q[1].tolist() == [0, 0, 0]


def _linear(out: int = 48, inp: int = 128) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(inp, out)


def test_int8_module_kernel_matches_dequantized_float() -> None:
    lin = _linear()
    module = Int8WeightOnlyLinear.from_linear(lin)
    x = torch.randn(1, 1, 128)  # a decode step: the kernel
    ref = nn.functional.linear(x, module.dequantized_weight(), lin.bias)
    assert torch.allclose(module(x), ref, atol=1e-4)
    assert ("Int8WeightOnlyLinear", "torch._weight_int8pack_mm (torch.float32)") in kernel_paths()
    assert torch.allclose(module(x), lin(x), atol=0.05)


def test_many_rows_take_the_dequantized_gemm(monkeypatch) -> None:
    """Beyond a few rows the CPU weight-only kernels (matrix-vector loops) lose to one
    GEMM on the dequantized weight; both give the dequantized weight's numbers."""
    lin = _linear()
    int8 = Int8WeightOnlyLinear.from_linear(lin)
    int4 = Int4WeightOnlyLinear.from_quantized(lin, *P.quantize_int4(lin.weight.detach(), 32))
    calls = []
    for name in ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu"):
        real = getattr(torch, name)
        monkeypatch.setattr(
            torch, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a)
        )
    for module, rows, kernel_rows in ((int8, 16, 1), (int4, 16, 4)):
        for n in (kernel_rows, kernel_rows + 1, rows):
            calls.clear()
            x = torch.randn(n, 128)
            ref = nn.functional.linear(x, module.dequantized_weight(), lin.bias)
            assert torch.allclose(module(x), ref, atol=1e-4)
            assert bool(calls) == (n <= kernel_rows), (type(module).__name__, n)
    calls.clear()
    int8(torch.randn(32, 128).bfloat16())  # bf16 keeps the kernel for a decode batch
    assert calls == ["_weight_int8pack_mm"]


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_module_kernel_matches_dequantized_float(symmetric: bool) -> None:
    lin = _linear()
    q, scale, zero = P.quantize_int4(lin.weight.detach(), 32, symmetric)
    module = Int4WeightOnlyLinear.from_quantized(lin, q, scale, zero)
    x = torch.randn(3, 128)
    ref = nn.functional.linear(x, module.dequantized_weight(), lin.bias)
    assert torch.allclose(module(x), ref, atol=1e-4)
    assert ("Int4WeightOnlyLinear", "torch._weight_int4pack_mm_for_cpu (torch.float32)") in (
        kernel_paths()
    )
    bf = module.to(torch.bfloat16)(x.bfloat16()).float()
    assert torch.allclose(bf, ref, atol=0.1)


def test_int4_module_falls_back_when_the_kernel_cannot_take_the_shape() -> None:
    lin = _linear(out=40)  # not a multiple of 16
    module = Int4WeightOnlyLinear.from_quantized(lin, *P.quantize_int4(lin.weight.detach(), 64))
    x = torch.randn(3, 128)
    assert torch.allclose(module(x), nn.functional.linear(x, module.dequantized_weight(), lin.bias))
    assert any("dequantize + F.linear" in path for _, path in kernel_paths())


def test_int8_dynamic_module_is_exact_integer_arithmetic() -> None:
    lin = _linear()
    module = Int8DynamicLinear.from_linear(lin)
    x = torch.randn(4, 128)
    xq, xs = P.quantize_int8_per_token(x)
    ref = (xq.double() @ module.qweight.double().t()) * xs.double() * module.weight_scale.double()
    assert torch.allclose(module(x).double(), ref + lin.bias.double(), atol=1e-4)
    assert torch.allclose(module(x), lin(x), atol=0.1)


def test_fp8_module_and_dtype_cast_keeps_weights() -> None:
    lin = _linear()
    x = torch.randn(4, 128)
    module = Fp8Linear.from_linear(lin, input_amax=float(x.abs().max()), per_channel=True)
    assert torch.allclose(module(x), lin(x), atol=0.25)
    module.to(torch.bfloat16)
    assert module.qweight.dtype == torch.uint8 and module.weight_scale.dtype == torch.bfloat16


def test_quantize_layout_builds_loadable_modules_on_meta() -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    source = Int4WeightOnlyLinear.from_quantized(model[0], *P.quantize_int4(model[0].weight, 32))
    state = {f"0.{k}": v for k, v in source.state_dict().items()}
    state.update({f"2.{k}": v for k, v in model[2].state_dict().items()})
    with torch.device("meta"):
        target = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 16))
    config = QuantizationConfig("int4_wo", modules=["0"], group_size=32)
    quantize_layout(target, config)
    target.load_state_dict(state, strict=True, assign=True)
    x = torch.randn(2, 64)
    assert torch.equal(target[0](x), source(x))
    assert QuantizationConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("out", [64, 32, 16, 48])
def test_int4_module_holds_the_weight_once_after_the_kernel_conversion(out: int) -> None:
    lin = _linear(out=out)
    q, scale, zero = P.quantize_int4(lin.weight.detach(), 32, symmetric=False)
    module = Int4WeightOnlyLinear.from_quantized(lin, q, scale, zero)
    saved = {k: v.clone() for k, v in module.state_dict().items()}
    x = torch.randn(2, 128)
    y = module(x)
    # a tile layout we can read back: the checkpoint packing is dropped (48 rows: mixed
    # tiles, not read back, kept)
    assert (module.qweight is None) == (out != 48)
    assert torch.equal(module.q_values(), q)
    state = module.state_dict()
    assert state.keys() == saved.keys()
    assert all(torch.equal(state[k], saved[k]) for k in saved)
    module.to(torch.float64).to(torch.float32)  # moved: the packing comes back first
    assert torch.equal(module.qweight, saved["qweight"])
    assert torch.equal(module(x), y)
    fresh = Int4WeightOnlyLinear(128, out, group_size=32)
    module(x)
    fresh.load_state_dict(module.state_dict())
    assert torch.equal(fresh(x), y)
