"""Decode attention over paged KV blocks on a CPU, read in place.

A decode step asks each running sequence's one new query to attend over every
position it has cached. SDPA needs those positions contiguous, so the blocks
are first gathered into a copy ([sequences, positions, groups, head_dim]) that
is written, read once and dropped: at 32 sequences of ~200 positions the gather
and SDPA took ~0.8 ms a layer, a third of a bf16 decode step of a 135M model on
two cores. This kernel walks each sequence's block table instead and reads the
blocks where they lie, with a running (online) softmax per query head, the next
block prefetched while one is computed, and all of a sequence's query groups
served from one pass over its blocks.

It is plain C++ (the compiler vectorizes the head_dim loops), specialised to one
model's shape and dtype, and built at first use with the C++ toolchain that
torch.compile's inductor uses on CPUs (its cache keeps the library across
processes). `decode_kernel` answers None, with the reason, where that toolchain
is missing or the build fails; the caller then keeps SDPA over gathered blocks.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

constexpr int64_t G = {groups};      // key/value heads (query groups)
constexpr int64_t H = {per_group};   // query heads per group
constexpr int64_t D = {head_dim};
constexpr int64_t BS = {block_size}; // positions per block
typedef {scalar} scalar_t;

static inline float to_float(float x) {{ return x; }}
static inline float to_float(uint16_t x) {{  // bfloat16 bits
    uint32_t u = static_cast<uint32_t>(x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}}
static inline void load_row(const scalar_t* x, float* y) {{  // D values as float
    #pragma omp simd
    for (int64_t d = 0; d < D; d++) y[d] = to_float(x[d]);
}}
static inline void store(float x, float* y) {{ *y = x; }}
static inline void store(float x, uint16_t* y) {{  // round to nearest even
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    *y = static_cast<uint16_t>(u >> 16);
}}

// query, out: [n, G, H, D]; keys, values: one layer's pool [blocks, BS, G, D];
// tables: [n, width] block ids; lengths: [n] positions each sequence attends to
// (its new one included); window < 0: no sliding window.
extern "C" void kernel(const scalar_t* query, const scalar_t* keys, const scalar_t* values,
                       const int64_t* tables, const int64_t* lengths, scalar_t* out,
                       int64_t n, int64_t width, int64_t window, float scale)
{{
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) {{
        float q[G][H][D], acc[G][H][D], running_max[G][H], total[G][H], p[G][H][BS];
        for (int64_t g = 0; g < G; g++) for (int64_t h = 0; h < H; h++) {{
            const scalar_t* row = query + ((i * G + g) * H + h) * D;
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) {{
                q[g][h][d] = to_float(row[d]) * scale;
                acc[g][h][d] = 0.f;
            }}
            running_max[g][h] = -INFINITY;
            total[g][h] = 0.f;
        }}
        const int64_t length = lengths[i];
        const int64_t first = window >= 0 ? std::max<int64_t>(0, length - 1 - window) : 0;
        const int64_t* table = tables + i * width;
        for (int64_t b = first / BS; b * BS < length; b++) {{
            const int64_t start = std::max(b * BS, first), stop = std::min((b + 1) * BS, length);
            const int64_t count = stop - start;
            if ((b + 1) * BS < length) {{  // the next block, while this one is computed
                const char* k = reinterpret_cast<const char*>(keys + table[b + 1] * BS * G * D);
                const char* v = reinterpret_cast<const char*>(values + table[b + 1] * BS * G * D);
                const int64_t bytes = BS * G * D * sizeof(scalar_t);
                for (int64_t c = 0; c < bytes; c += 64) {{
                    __builtin_prefetch(k + c);
                    __builtin_prefetch(v + c);
                }}
            }}
            const int64_t base = table[b] * BS + start % BS;
            for (int64_t j = 0; j < count; j++) {{
                const scalar_t* k = keys + (base + j) * G * D;
                for (int64_t g = 0; g < G; g++) {{
                    float kf[D];
                    load_row(k + g * D, kf);
                    for (int64_t h = 0; h < H; h++) {{
                        float dot = 0.f;
                        #pragma omp simd reduction(+:dot)
                        for (int64_t d = 0; d < D; d++) dot += q[g][h][d] * kf[d];
                        p[g][h][j] = dot;
                    }}
                }}
            }}
            for (int64_t g = 0; g < G; g++) for (int64_t h = 0; h < H; h++) {{
                float m = running_max[g][h];
                for (int64_t j = 0; j < count; j++) m = std::max(m, p[g][h][j]);
                const float rescale = std::exp(running_max[g][h] - m);
                #pragma omp simd
                for (int64_t d = 0; d < D; d++) acc[g][h][d] *= rescale;
                float sum = 0.f;
                for (int64_t j = 0; j < count; j++) {{
                    p[g][h][j] = std::exp(p[g][h][j] - m);
                    sum += p[g][h][j];
                }}
                total[g][h] = total[g][h] * rescale + sum;
                running_max[g][h] = m;
            }}
            for (int64_t j = 0; j < count; j++) {{
                const scalar_t* v = values + (base + j) * G * D;
                for (int64_t g = 0; g < G; g++) {{
                    float vf[D];
                    load_row(v + g * D, vf);
                    for (int64_t h = 0; h < H; h++) {{
                        const float w = p[g][h][j];
                        #pragma omp simd
                        for (int64_t d = 0; d < D; d++) acc[g][h][d] += w * vf[d];
                    }}
                }}
            }}
        }}
        for (int64_t g = 0; g < G; g++) for (int64_t h = 0; h < H; h++) {{
            scalar_t* row = out + ((i * G + g) * H + h) * D;
            const float inverse = 1.f / total[g][h];
            for (int64_t d = 0; d < D; d++) store(acc[g][h][d] * inverse, row + d);
        }}
    }}
}}
"""

_SCALARS = {torch.float32: "float", torch.bfloat16: "uint16_t"}
_ARGUMENTS = ["const scalar_t*"] * 3 + ["const int64_t*"] * 2 + ["scalar_t*"] + ["int64_t"] * 3
_ARGUMENTS += ["float"]

DecodeKernel = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, int, float], Tensor]
"""(query [n, heads, d], keys, values [blocks, block_size, groups, d] of one layer,
tables [n, width], lengths [n], window (-1: none), scale) -> context [n, heads, d]."""


def decode_kernel(
    dtype: torch.dtype, groups: int, heads: int, head_dim: int, block_size: int
) -> tuple[DecodeKernel | None, str]:
    """The kernel for this shape, or None and why it cannot be had here."""
    if dtype not in _SCALARS:
        return None, f"no CPU paged-attention kernel for {dtype} (float32 and bfloat16 only)"
    try:
        entry = _build(_SCALARS[dtype], groups, heads // groups, head_dim, block_size)
    except Exception as err:  # noqa: BLE001 - no compiler, or it failed: SDPA serves
        return None, f"the CPU paged-attention kernel could not be built ({type(err).__name__})"

    def run(
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        tables: Tensor,
        lengths: Tensor,
        window: int,
        scale: float,
    ) -> Tensor:
        if not (keys.is_contiguous() and values.is_contiguous() and tables.is_contiguous()):
            raise ValueError("paged decode kernel: keys, values and tables must be contiguous")
        query = query.contiguous()
        out = torch.empty_like(query)
        n, width = tables.shape
        entry(query, keys, values, tables, lengths, out, n, width, window, scale)
        return out

    return run, "the CPU paged-attention kernel (blocks read in place)"


@contextlib.contextmanager
def quiet_cpp_extension() -> Iterator[None]:
    """Silence the warning inductor's import of torch.utils.cpp_extension prints on a
    machine without CUDA (true, and nothing to act on)."""
    quiet = logging.getLogger("torch.utils.cpp_extension")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quiet.setLevel(level)


@functools.cache
def _build(scalar: str, groups: int, per_group: int, head_dim: int, block_size: int):
    """Compile (or load from inductor's on-disk cache) the kernel for one shape."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache
    from torch._inductor.cpp_builder import get_cpp_compiler

    source = _SOURCE.format(
        groups=groups,
        per_group=per_group,
        head_dim=head_dim,
        block_size=block_size,
        scalar=scalar,
    )
    # inductor builds its own kernels unvectorized and without FMA contraction (they are
    # vectorized by hand); this one relies on the compiler's loop vectorizer
    with quiet_cpp_extension():
        clang = "clang" in get_cpp_compiler()
        flags = ("-fvectorize",) if clang else ("-ftree-loop-vectorize",)
        flags += ("-ffp-contract=fast", "-fno-math-errno")
        return CppPythonBindingsCodeCache.load_pybinding(
            _ARGUMENTS, source, needs_vec_isa=True, extra_flags=flags
        )
