"""Quantized drop-in replacements for ``nn.Linear``.

Each module holds its quantized weight and scales as buffers (so they are in
the state dict and move with ``.to(device)``), keeps the bias in float, and
picks its matmul at call time:

- ``Int8WeightOnlyLinear`` (W8A16): ``torch._weight_int8pack_mm`` on CPU;
- ``Int4WeightOnlyLinear`` (W4A16, grouped): ``torch._weight_int4pack_mm_for_cpu``
  on CPU when the shapes allow it (out_features % 16 == 0), the weight converted
  once into the kernel's tiled layout (``_convert_weight_to_int4pack_for_cpu``);
- ``Int8DynamicLinear`` (W8A8, SmoothQuant): per-token int8 activations and
  ``torch._int_mm`` (int8 × int8 → int32);
- ``Fp8Linear`` (E4M3 weights and static per-tensor activations):
  ``torch._scaled_mm`` on GPUs with FP8 (compute capability ≥ 8.9).

Anywhere else they dequantize the weight and call ``F.linear`` (same numbers,
no speed-up). The CPU weight-only kernels are matrix-vector loops whose time grows
with every input row, so beyond a few rows (a prompt, an evaluation window) the
dequantized weight and one GEMM are faster (`_KERNEL_MAX_ROWS`): decode takes the
kernels, prefill the GEMM. The path taken is logged once per module type and path, so a
run says whether it got real low-bit kernels.

Weights are stored in integer dtypes (fp8 as its uint8 bit pattern), so
``model.to(torch.bfloat16)`` casts scales and biases but never the weights.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.quantization import primitives as P

log = logging.getLogger("mg.core.quantization")
_LOGGED: set[tuple[str, str]] = set()
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Rows up to which a CPU weight-only kernel beats dequantize + F.linear, measured on a
# 2-core AVX-512/AMX machine for [rows, 768] x [768, 2048] (torch 2.15): int8 in fp32
# 0.44 vs 0.52 ms at one row, 0.89 vs 0.54 at two; in bf16 0.61 vs 0.76 ms at 32 rows,
# 1.19 vs 0.81 at 64. int4 (whose dequantize unpacks nibbles) 1.17 vs 6.0 ms at one
# fp32 row, 9.9 vs 7.0 at eight; bf16 2.2 vs 6.2 at 128 rows, 5.2 vs 7.5 at 256.
_KERNEL_MAX_ROWS = {
    "int8": {torch.float32: 1, torch.bfloat16: 32, torch.float16: 32},
    "int4": {torch.float32: 4, torch.bfloat16: 256, torch.float16: 256},
}


def _cpu_kernel_fits(x: Tensor, kind: str) -> bool:
    """Whether the CPU weight-only kernel of `kind` ("int8", "int4") should take `x`."""
    return (
        x.device.type == "cpu"
        and x.dtype in _KERNEL_DTYPES
        and x.shape[0] <= _KERNEL_MAX_ROWS[kind][x.dtype]
    )


def _note_path(module: nn.Module, path: str) -> None:
    key = (type(module).__name__, path)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("%s: %s", type(module).__name__, path)


def kernel_paths() -> list[tuple[str, str]]:
    """(module type, matmul path) pairs used so far in this process."""
    return sorted(_LOGGED)


# torch._convert_weight_to_int4pack_for_cpu's tiles (torch 2.6-2.15): blocks of N output
# channels, each input column's N nibbles in N/2 bytes; byte b holds channels (b, b + N/2)
# for N = 64, (2b, 2b + 1) for N = 32 and 16. Used only after checking it on the weight.
_CPU_INT4_LAYOUTS = ((64, True), (32, False), (16, False))


def _unpack_cpu_int4pack(packed: Tensor, n: int, k: int, block: int, halves: bool) -> Tensor:
    tiles = packed.reshape(n // block, k, block // 2)
    low, high = tiles & 0x0F, tiles >> 4
    if halves:
        full = torch.cat([low, high], dim=-1)
    else:
        full = torch.stack([low, high], dim=-1).reshape(n // block, k, block)
    return full.transpose(1, 2).reshape(n, k).to(torch.int8)


class QuantizedLinear(nn.Module):
    """Common part: shapes, the float bias, and the 2-D reshape around the matmul."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype = torch.float32
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def dequantized_weight(self) -> Tensor:
        """The [out, in] float32 weight this module computes with."""
        raise NotImplementedError

    def matmul(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        y = self.matmul(x.reshape(-1, shape[-1]))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def _fallback(self, x: Tensor) -> Tensor:
        _note_path(self, f"dequantize + F.linear on {x.device.type} ({x.dtype})")
        return F.linear(x, self.dequantized_weight().to(x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Int8WeightOnlyLinear(QuantizedLinear):
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias)
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.int8))
        self.register_buffer("weight_scale", torch.empty(out_features))

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight: Tensor | None = None) -> Int8WeightOnlyLinear:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None)
        module.qweight, module.weight_scale = P.quantize_int8_per_channel(
            linear.weight if weight is None else weight
        )
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone())
        return module

    def dequantized_weight(self) -> Tensor:
        return P.dequantize_int8(self.qweight, self.weight_scale)

    def matmul(self, x: Tensor) -> Tensor:
        if _cpu_kernel_fits(x, "int8"):
            _note_path(self, f"torch._weight_int8pack_mm ({x.dtype})")
            return torch._weight_int8pack_mm(x, self.qweight, self.weight_scale.to(x.dtype))
        return self._fallback(x)


class Int4WeightOnlyLinear(QuantizedLinear):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, group_size: int = 128
    ) -> None:
        super().__init__(in_features, out_features, bias)
        P.check_group_size(in_features, group_size)
        self.group_size = group_size
        groups = in_features // group_size
        self.register_buffer(
            "qweight", torch.empty(out_features, in_features // 2, dtype=torch.uint8)
        )
        self.register_buffer("weight_scale", torch.empty(out_features, groups))
        self.register_buffer(
            "weight_zero_point", torch.empty(out_features, groups, dtype=torch.int8)
        )
        self._packed: Tensor | None = None  # the kernel's tiled layout, built on first use
        self._layout: tuple[int, bool] | None = None
        self._scales_and_zeros: dict[torch.dtype, Tensor] = {}

    @classmethod
    def from_quantized(
        cls, linear: nn.Linear, q: Tensor, scale: Tensor, zero: Tensor
    ) -> Int4WeightOnlyLinear:
        """From q (0..15, [out, in]), scales and zero points [out, in / group]."""
        group_size = linear.in_features // scale.shape[1]
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, group_size)
        module.qweight = P.pack_int4(q)
        module.weight_scale = scale.float().contiguous()
        module.weight_zero_point = zero.to(torch.int8).contiguous()
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone())
        return module

    def q_values(self) -> Tensor:
        """The [out, in] int4 values 0..15 (from the kernel's layout when only it is held)."""
        if self.qweight is None:
            n, k = self.out_features, self.in_features
            return _unpack_cpu_int4pack(self._packed, n, k, *self._layout)
        return P.unpack_int4(self.qweight)

    def dequantized_weight(self) -> Tensor:
        return P.dequantize_int4(self.q_values(), self.weight_scale, self.weight_zero_point)

    def _hold_portable_form(self) -> None:
        """Make ``qweight`` (the checkpoint's packing) again and forget the kernel's layout."""
        if self.qweight is None:
            self.qweight = P.pack_int4(self.q_values())
        self._packed, self._layout, self._scales_and_zeros = None, None, {}

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.qweight is None:
            destination[prefix + "qweight"] = P.pack_int4(self.q_values())

    def _load_from_state_dict(self, *args, **kwargs) -> None:  # new weights: new kernel form
        if self.qweight is None:
            shape = (self.out_features, self.in_features // 2)
            self.qweight = torch.empty(shape, dtype=torch.uint8, device=self.weight_scale.device)
        self._packed, self._layout, self._scales_and_zeros = None, None, {}
        super()._load_from_state_dict(*args, **kwargs)

    def _apply(self, fn, recurse: bool = True):  # moved or cast: new kernel form
        self._hold_portable_form()
        return super()._apply(fn, recurse)

    def _kernel_ok(self, x: Tensor) -> bool:
        return (
            _cpu_kernel_fits(x, "int4")
            and self.out_features % 16 == 0
            and self.group_size in (32, 64, 128, 256)
        )

    def _kernel_weights(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        if self._packed is None:
            q = self.q_values()
            self._packed = torch._convert_weight_to_int4pack_for_cpu(q.int(), 1)
            # Hold the int4 weight once: when the kernel's tiled layout is one we can read
            # back (checked on this very weight), drop the checkpoint's packing; state_dict
            # and dequantized_weight rebuild it from the tiles.
            n, k = q.shape
            self._layout = next(
                (
                    layout
                    for layout in _CPU_INT4_LAYOUTS
                    if n % layout[0] == 0
                    and torch.equal(_unpack_cpu_int4pack(self._packed, n, k, *layout), q)
                ),
                None,
            )
            if self._layout is not None:
                self.qweight = None
        if dtype not in self._scales_and_zeros:
            # the kernel computes (q - 8) * scale + zero: our (q - z) * s has zero = (8 - z) * s
            scale = self.weight_scale.float()
            offset = (8 - self.weight_zero_point.float()) * scale
            both = torch.stack([scale.t(), offset.t()], dim=-1).contiguous()
            self._scales_and_zeros[dtype] = both.to(dtype)
        return self._packed, self._scales_and_zeros[dtype]

    def matmul(self, x: Tensor) -> Tensor:
        if self._kernel_ok(x):
            _note_path(self, f"torch._weight_int4pack_mm_for_cpu ({x.dtype})")
            packed, scales_and_zeros = self._kernel_weights(x.dtype)
            return torch._weight_int4pack_mm_for_cpu(
                x.contiguous(), packed, self.group_size, scales_and_zeros
            )
        return self._fallback(x)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"


class Int8DynamicLinear(Int8WeightOnlyLinear):
    """W8A8: int8 per-channel weights (stored as int8_wo's), int8 per-token activations
    quantized on the fly."""

    def matmul(self, x: Tensor) -> Tensor:
        xq, xs = P.quantize_int8_per_token(x)
        if x.device.type == "cpu" or (
            x.shape[0] > 16 and self.in_features % 8 == 0 and self.out_features % 8 == 0
        ):
            _note_path(self, f"torch._int_mm int8 x int8 on {x.device.type}")
            acc = torch._int_mm(xq, self.qweight.t()).float()
        else:
            _note_path(self, f"int8 values in float matmul on {x.device.type}")
            acc = xq.float() @ self.qweight.float().t()
        return (acc * xs * self.weight_scale.float()).to(x.dtype)


class Fp8Linear(QuantizedLinear):
    """E4M3 weights (per-tensor or per-channel scale), E4M3 activations (static, per tensor)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, per_channel: bool = False
    ) -> None:
        super().__init__(in_features, out_features, bias)
        self.per_channel = per_channel
        self.register_buffer("qweight", torch.empty(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("weight_scale", torch.empty(out_features if per_channel else ()))
        self.register_buffer("input_scale", torch.empty(()))

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, input_amax: float, per_channel: bool, weight: Tensor | None = None
    ) -> Fp8Linear:
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, per_channel)
        q, module.weight_scale = P.quantize_fp8(
            linear.weight if weight is None else weight, per_channel
        )
        module.qweight = q.view(torch.uint8)
        module.input_scale = torch.tensor(max(float(input_amax), 1e-12) / P.FP8_MAX)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone())
        return module

    def fp8_weight(self) -> Tensor:
        return self.qweight.view(torch.float8_e4m3fn)

    def dequantized_weight(self) -> Tensor:
        return P.dequantize_fp8(self.fp8_weight(), self.weight_scale)

    def matmul(self, x: Tensor) -> Tensor:
        if (
            x.device.type == "cuda"
            and torch.cuda.get_device_capability(x.device) >= (8, 9)
            and not self.per_channel
            and x.shape[0] % 16 == 0
        ):
            _note_path(self, "torch._scaled_mm (fp8 e4m3) on cuda")
            s_in = self.input_scale.float()
            xq = (x.float() / s_in).clamp(-P.FP8_MAX, P.FP8_MAX).to(torch.float8_e4m3fn)
            return torch._scaled_mm(
                xq,
                self.fp8_weight().t(),
                scale_a=s_in,
                scale_b=self.weight_scale.float(),
                out_dtype=x.dtype if x.dtype != torch.float32 else torch.bfloat16,
            ).to(x.dtype)
        _note_path(self, f"fp8 fake-quantized activations + F.linear on {x.device.type}")
        x = P.fake_quantize_fp8_activation(x, self.input_scale)
        return F.linear(x, self.dequantized_weight().to(x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, per_channel={self.per_channel}"
