"""bf16 linear layers on CPUs with AMX, for decode steps: the weights read at memory speed.

A decode step multiplies a few rows (one per running sequence) by every weight
of the model, so its linears cost what reading the weights costs. oneDNN's
packed bf16 matmul reads them at ~14 GB/s for 8 rows and ~10 GB/s for 32 on a
two-core Xeon whose two cores stream 22 GB/s. This kernel stores each weight
in the order its AMX tiles are loaded (panels of 32 output columns, each a
contiguous run of 1 KB tiles), so that every core streams its share of the
panels front to back with the next tiles prefetched, and multiplies with AMX
tiles (16 rows x 32 inputs by 32 inputs x 16 columns, fp32 accumulation). The
135M model's 30 layers of linears: 17.9 -> 9.6 ms for 8 rows, 20.7 -> 11.3 ms
for 32, on that machine. More rows (a prompt chunk) loop over 32-row tiles
within a panel, which stays in the core's cache: the weights are still read
once.

It is C++ built at first use with the toolchain torch.compile's inductor uses
on CPUs (like the paged-attention kernel), for CPUs whose flags include
`amx_bf16` on Linux (the process asks the kernel for the tile state first).
`amx_matmul()` answers None, with the reason, elsewhere; the caller then keeps
oneDNN.
"""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from mg.core.models.paged_attention_cpu import quiet_cpp_extension
from mg.generate_server import cpu_isa

_SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
#include <cstdint>
#include <cstring>
#include <vector>

struct TileConfig {
    uint8_t palette, start;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// 16 fp32 (plus bias) to bf16, rounding to nearest even
static inline void store_bf16(const float* c, const float* bias, uint16_t* y) {
    __m512 v = _mm512_loadu_ps(c);
    if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
    __m512i u = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), half);
}

// y[M, N] = x[M, K] @ W^T (+ bias), bf16 in and out. w: W packed by `pack_weight`, panels of
// 32 columns [N / 32][K / 32][2 tiles][16 input pairs][16 columns][2]. bias: N floats, read
// only with has_bias.
extern "C" void kernel(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y,
                       int64_t M, int64_t N, int64_t K, int64_t has_bias) {
    if (!has_bias) bias = nullptr;
    const int64_t rows = (M + 15) / 16 * 16, panels = N / 32, steps = K / 32;
    std::vector<uint16_t> padded;
    if (rows != M) {  // the A tiles read 16 rows: pad with zero rows
        padded.assign(rows * K, 0);
        std::memcpy(padded.data(), x, M * K * sizeof(uint16_t));
        x = padded.data();
    }
    #pragma omp parallel
    {
        TileConfig config;
        std::memset(&config, 0, sizeof config);
        config.palette = 1;
        for (int t = 0; t < 8; t++) { config.rows[t] = 16; config.colsb[t] = 64; }
        _tile_loadconfig(&config);  // tiles 0-1: A; 2-3: B; 4-7: C (A0 B0, A0 B1, A1 B0, A1 B1)
        alignas(64) float c[32][32];
        const int threads = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t first = panels * me / threads, last = panels * (me + 1) / threads;
        for (int64_t p = first; p < last; p++) {
            const uint16_t* panel = w + p * steps * 1024;
            for (int64_t m = 0; m < rows; m += 32) {
                const bool two = m + 16 < rows;
                _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
                for (int64_t k = 0; k < steps; k++) {
                    if (m == 0) {  // the panel's first pass reads it from memory
                        const char* ahead = reinterpret_cast<const char*>(panel + (k + 4) * 1024);
                        for (int line = 0; line < 2048; line += 64)
                            _mm_prefetch(ahead + line, _MM_HINT_T0);
                    }
                    _tile_loadd(2, panel + k * 1024, 64);
                    _tile_loadd(3, panel + k * 1024 + 512, 64);
                    _tile_loadd(0, x + m * K + k * 32, K * 2);
                    _tile_dpbf16ps(4, 0, 2);
                    _tile_dpbf16ps(5, 0, 3);
                    if (two) {
                        _tile_loadd(1, x + (m + 16) * K + k * 32, K * 2);
                        _tile_dpbf16ps(6, 1, 2);
                        _tile_dpbf16ps(7, 1, 3);
                    }
                }
                _tile_stored(4, &c[0][0], 128);
                _tile_stored(5, &c[0][16], 128);
                _tile_stored(6, &c[16][0], 128);
                _tile_stored(7, &c[16][16], 128);
                const float* b = bias ? bias + p * 32 : nullptr;
                for (int64_t r = m; r < m + 32 && r < M; r++) {
                    uint16_t* out = y + r * N + p * 32;
                    store_bf16(c[r - m], b, out);
                    store_bf16(c[r - m] + 16, b ? b + 16 : nullptr, out + 16);
                }
            }
        }
        _tile_release();
    }
}
"""

_ARGUMENTS = ["const uint16_t*", "const uint16_t*", "const float*", "uint16_t*"]
_ARGUMENTS += ["int64_t"] * 4
_XFEATURE_XTILEDATA, _ARCH_REQ_XCOMP_PERM, _SYS_ARCH_PRCTL = 18, 0x1023, 158


class AMXLinear:
    """One bf16 weight [N, K] packed for the kernel, with its bias; called on [..., K]."""

    def __init__(self, kernel: Callable[..., None], weight: Tensor, bias: Tensor | None) -> None:
        self._kernel = kernel
        self.out_features, self.in_features = weight.shape
        self.packed = pack_weight(weight.detach())
        self.has_bias = int(bias is not None)
        self.bias = torch.zeros(0) if bias is None else bias.detach().float().contiguous()

    def __call__(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.in_features:  # the kernel would read past the weight
            raise ValueError(f"AMX linear: {x.shape[-1]} inputs for a [{self.out_features}, "
                             f"{self.in_features}] weight")  # fmt: skip
        if torch.compiler.is_compiling():  # a node of the graph, run by `_linear`
            return torch.ops.mg_amx.linear(x, self.packed, self.bias, self.has_bias)
        return _linear(self._kernel, x, self.packed, self.bias, self.has_bias)

    def rows(self, ids: Tensor) -> Tensor:
        """The weight's rows `ids` (any shape) -> [*ids.shape, in_features], read from the
        packed copy (a tied embedding looks its tokens up here, and keeps no plain copy)."""
        n, k = self.out_features, self.in_features
        tiles = self.packed.view(n // 32, k // 32, 2, 16, 16, 2)  # see pack_weight
        flat = ids.reshape(-1)
        picked = tiles[flat // 32, :, flat % 32 // 16, :, flat % 16, :]  # [ids, k/32, 16, 2]
        return picked.reshape(*ids.shape, k)


def _linear(kernel, x: Tensor, packed: Tensor, bias: Tensor, has_bias: int) -> Tensor:
    """x [..., K] @ the packed weight [N, K].T (+ bias)."""
    in_features = x.shape[-1]
    out_features = packed.numel() // in_features
    rows = x.reshape(-1, in_features)
    if rows.dtype != torch.bfloat16:
        raise TypeError(f"AMX linear: bf16 inputs only, got {rows.dtype}")
    rows = rows.contiguous()
    y = rows.new_empty(rows.shape[0], out_features)
    if rows.shape[0]:
        kernel(rows, packed, bias, y, rows.shape[0], out_features, in_features, has_bias)
    return y.view(*x.shape[:-1], out_features)


# For torch.compile (`--enable-torch-compile`): the kernel as an operator the graph calls
# (defined through torch.library.Library: the `custom_op` decorator's checks cost more
# per call than the kernel's smaller products take).
_LIBRARY = torch.library.Library("mg_amx", "DEF")
_LIBRARY.define("linear(Tensor x, Tensor packed, Tensor bias, int has_bias) -> Tensor")


def _operator(x: Tensor, packed: Tensor, bias: Tensor, has_bias: int) -> Tensor:
    return _linear(amx_matmul()[0], x, packed, bias, has_bias)


_LIBRARY.impl("linear", _operator, "CPU")


@torch.library.register_fake("mg_amx::linear")
def _(x: Tensor, packed: Tensor, bias: Tensor, has_bias: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], packed.numel() // x.shape[-1])


def pack_weight(weight: Tensor) -> Tensor:
    """[N, K] -> the kernel's order: panels of 32 columns, each K / 32 pairs of AMX B tiles
    (16 pairs of inputs x 16 columns x the pair), contiguous."""
    n, k = weight.shape
    tiles = weight.reshape(n // 32, 2, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5)
    return tiles.contiguous().view(-1)


def fits(weight: Tensor) -> bool:
    """Whether the kernel takes this weight: bf16 on the CPU, both sides multiples of 32."""
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and n % 32 == k % 32 == 0


@functools.cache
def amx_matmul() -> tuple[Callable[..., None] | None, str]:
    """The built kernel, or None and why this machine cannot have it."""
    if platform.machine() not in ("x86_64", "AMD64") or platform.system() != "Linux":
        return None, "AMX matmuls need Linux on x86-64"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None, "cannot read /proc/cpuinfo"
    if " amx_bf16" not in flags or " amx_tile" not in flags:
        return None, "this CPU has no AMX-BF16"
    if not cpu_isa.allows("amx"):
        return None, f"--cpu-isa {cpu_isa.chosen()} rules AMX out"
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) != 0:
        return None, "the kernel refused this process AMX's tile state"
    try:
        return _build(), "AMX"
    except Exception as err:  # noqa: BLE001 - no compiler, or it failed: oneDNN serves
        return None, f"the AMX matmul kernel could not be built ({type(err).__name__})"


def _build() -> Callable[..., None]:
    # lazy: torch._inductor takes seconds to import; only a CPU with AMX builds the kernel
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    with quiet_cpp_extension():
        return CppPythonBindingsCodeCache.load_pybinding(
            _ARGUMENTS, _SOURCE, needs_vec_isa=True, extra_flags=KERNEL_FLAGS
        )


KERNEL_FLAGS = ("-mamx-tile", "-mamx-bf16", "-mavx512f", "-mavx512bw")
"""What the kernel is compiled with, also by a library that includes its source."""


def kernel_source() -> str:
    """The kernel's C++ (`extern "C" void kernel(x, w, bias, y, M, N, K, has_bias)`), for a
    library built around it (`fused_decode`)."""
    return _SOURCE
