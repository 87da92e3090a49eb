"""A Llama-shaped fp32/bf16 model's serving step as one C++ call, on CPUs with AVX2 or AVX-512.

The AMX step (`fused_decode`) needs AMX and bf16. Elsewhere a decode step ran op by
op: per layer five matmuls through oneDNN and a dozen small torch ops, each with its
dispatch and an OpenMP team woken for microseconds. This module builds one library
for the chosen instruction set (`cpu_isa`: AVX-512, or AVX2 on any x86-64 from
2013 on, also forced on a newer CPU) and runs every layer of a step in one call with
the GIL released, as the AMX step does.

Its matmuls are a hand-written kernel because none of the libraries at hand fits a
step of 1-32 rows: each output is one row's dot product with one weight row, summed
16 (AVX-512) or 8 (AVX2) lanes at a time in a fixed order (GCC/clang vector types, one
register each), four weight rows against four or two input rows per inner loop, OpenMP over
blocks of weight rows. So every row's numbers are the same whatever else the step
holds (oneDNN picks its blocking by the number of rows) and the weights are read
once a step. A step of many rows (a prompt) takes a GEMM form of the same sums: a block
of weight rows transposed into the vector lanes once, each input value broadcast, the
products of each lane summed in the dot product's order and the lanes added in its tree,
so its numbers are bitwise the dot product's (MKL's order is its own) at MKL's pace on
the rows (1.25x the dot-product form for a 144-token prompt with AVX-512, 2x with AVX2).
The kernel reads each matrix as it is held: fp32, bf16, or mg-quantize's
weight-only int8 (a scale per output channel) and int4 (two a byte, a scale and zero
point per group of columns), made into the eager modules' dequantized fp32 values in
registers (`q * scale`, `(q - zero) * scale`: the same products), so a quantized step
reads a quarter or an eighth of the fp32 bytes and computes the eager quantized model's
numbers up to the order of the sums. Activations and the KV cache are the model's, fp32
or bf16 (a bf16 model where AMX does not run). The step computes in fp32; for a bf16 model
it rounds to bf16 where the eager model's bf16 ops round (each norm's and linear's output,
RoPE's products and their sum, SiLU and its product, each residual add), so it computes
that model's numbers up to the order of the sums too. The paged attention is
`mg.core.models.paged_attention_cpu`'s kernel for the cache's type.

It serves what the AMX step serves (pre-norm RMSNorm, fused QKV without bias, RoPE,
SwiGLU without bias, dense layers), its linears in the model's dtype or int8_wo or int4
ones (int4_wo, AWQ, GPTQ: one format), the output layer too where it is one of those
without bias; `vector_decode_unsupported` says why anything else keeps the per-op step
(linears `pack_linears` packed for oneDNN among them: that layout cannot be read back).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from mg.core.models import GPTModel
from mg.core.models.output_head import (
    OutputModuleHead,
    is_plain_output,
    mask_padded_vocab,
    real_vocab_size,
)
from mg.core.models.paged_attention_cpu import kernel_flags, kernel_source, quiet_cpp_extension
from mg.core.models.paged_kv_cache import PagedKVCache, PagedSegment
from mg.core.quantization.linear import Int4WeightOnlyLinear, Int8WeightOnlyLinear
from mg.core.quantization.primitives import pack_int4
from mg.generate_server import cpu_isa
from mg.generate_server.fused_decode import (
    layer_linears,
    llama_shape_unsupported,
    step_tables,
    takes,
)
from mg.generate_server.packed_linears import PackedLinear

_STEP = r"""
// VL lanes a vector (16: one zmm; 8: one ymm), MR input rows an inner loop: 4 weight rows
// times MR input rows of accumulators, the inputs and a weight vector fit the registers.
typedef float fv __attribute__((vector_size(VL * 4)));

static inline fv load(const float* x) { fv v; std::memcpy(&v, x, sizeof v); return v; }
static inline fv load(const uint16_t* x) {  // bf16 bits -> float: widened, shifted up
#if VL == 16
    const __m512i u = _mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16);
#else
    const __m256i u = _mm256_slli_epi32(
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x))), 16);
#endif
    fv v; std::memcpy(&v, &u, sizeof v); return v;
}
// A value as the model's activations hold it: fp32 as it is; bf16 rounded to the nearest
// even bf16 (kept as a float): where the eager bf16 model's ops round their outputs.
static inline float act(float x) {
#if BF16_ACTIVATIONS
    uint32_t u; std::memcpy(&u, &x, 4);
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000u;
    std::memcpy(&x, &u, 4);
#endif
    return x;
}
static inline float total(fv v) {  // the lanes in order
    float s = 0.f;
    for (int j = 0; j < VL; j++) s += v[j];
    return s;
}

// The lanes of four vectors summed, each in the same fixed tree (halves added until four
// lanes are left, then pairs): four sums at the cost of a few shuffles, not 4 x VL scalar adds.
typedef float f4 __attribute__((vector_size(16)));
static inline f4 quarter_sums(fv v) {  // lanes j, j + 4, j + 8, ... summed into lane j
#if VL == 16
    typedef float f8 __attribute__((vector_size(32)));
    const f8 half = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
    const fv half = v;
#endif
    return __builtin_shufflevector(half, half, 0, 1, 2, 3) +
           __builtin_shufflevector(half, half, 4, 5, 6, 7);
}
static inline void totals4(const fv* a, float* sums) {
    const f4 q0 = quarter_sums(a[0]), q1 = quarter_sums(a[1]);
    const f4 q2 = quarter_sums(a[2]), q3 = quarter_sums(a[3]);
    const f4 p01 = __builtin_shufflevector(q0, q1, 0, 2, 4, 6) +
                   __builtin_shufflevector(q0, q1, 1, 3, 5, 7);
    const f4 p23 = __builtin_shufflevector(q2, q3, 0, 2, 4, 6) +
                   __builtin_shufflevector(q2, q3, 1, 3, 5, 7);
    const f4 all = __builtin_shufflevector(p01, p23, 0, 2, 4, 6) +
                   __builtin_shufflevector(p01, p23, 1, 3, 5, 7);
    std::memcpy(sums, &all, sizeof all);
}

// A weight matrix [N, K] as the step reads it (`_matrix`): fp32 or bf16 values; int8 ones
// with a scale per output row (w = q * scale); or int4 ones, two a byte (column 2i in the
// low nibble, 2i + 1 in the high), with a scale and an integer zero point per `group`
// columns of a row (w = (q - zero) * scale). Each kind's values are those the eager
// quantized linear dequantizes to, made in registers: each product x * w is the eager
// dequantized model's.
struct Matrix {
    int64_t kind;  // FP32, BF16, INT8, INT4
    const void* values;
    const float* scales;
    const int8_t* zeros;
    int64_t group;
};
enum { FP32 = 0, BF16 = 1, INT8 = 2, INT4 = 3 };
static const int64_t ROW_BITS[] = {32, 16, 8, 4};  // a value's bits, by kind

// One weight row's values VL at a time, from column k (k at or after the chunk `start`
// was made for: int4's chunks are its groups, the others' the whole row).
template <typename T>
struct FloatRow {
    const T* row;
    const T* ahead;  // the same column four rows on: what the next block reads
    FloatRow(const Matrix& w, int64_t n, int64_t K, int64_t) {
        row = static_cast<const T*>(w.values) + n * K;
        ahead = row + 4 * K;
    }
    fv at(int64_t k) const { return load(row + k); }
    void prefetch(int64_t k) const { __builtin_prefetch(ahead + k, 0, 1); }
};

// VL int8 (AVX2: the low 8 bytes of `bytes`) widened to int32 and made floats by the
// instructions themselves (GCC's vector conversions of bytes go through scalars)
static inline fv int8_floats(__m128i bytes) {
#if VL == 16
    const __m512 f = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
#else
    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
#endif
    fv v; std::memcpy(&v, &f, sizeof v); return v;
}

struct Int8Row {
    const int8_t* row;
    const int8_t* ahead;
    float scale;
    Int8Row(const Matrix& w, int64_t n, int64_t K, int64_t) {
        row = static_cast<const int8_t*>(w.values) + n * K;
        ahead = row + 4 * K;
        scale = w.scales[n];
    }
    void prefetch(int64_t k) const { __builtin_prefetch(ahead + k, 0, 1); }
    fv at(int64_t k) const {
#if VL == 16
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k));
#else
        const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k));
#endif
        return int8_floats(q) * scale;  // as dequantize_int8: q * scale
    }
};

// Int4: VL / 2 bytes to VL lanes, each byte twice (its low nibble's column, then its high
// one's), shifted so that a lane's low 4 bits are its nibble.
struct Int4Row {
    const uint8_t* row;
#if VL == 16
    __m512 table;  // the group's 16 values (q - zero) * scale, looked up by nibble
#else
    float zero, scale;
#endif
    const uint8_t* ahead;
    void prefetch(int64_t k) const { __builtin_prefetch(ahead + k / 2, 0, 1); }
    Int4Row(const Matrix& w, int64_t n, int64_t K, int64_t start) {
        row = static_cast<const uint8_t*>(w.values) + n * (K / 2);
        ahead = row + 4 * (K / 2);
        const int64_t g = n * (K / w.group) + start / w.group;
#if VL == 16
        const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512 zero = _mm512_set1_ps(static_cast<float>(w.zeros[g]));
        table = _mm512_mul_ps(_mm512_sub_ps(q, zero), _mm512_set1_ps(w.scales[g]));
#else
        zero = static_cast<float>(w.zeros[g]);
        scale = w.scales[g];
#endif
    }
    fv at(int64_t k) const {
#if VL == 16
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + k / 2));
        const __m512i shifts = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
        const __m512i nibbles = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(b, b)),
                                                  shifts);  // (the lookup reads 4 bits)
        const __m512 f = _mm512_permutexvar_ps(nibbles, table);  // as dequantize_int4
        fv v; std::memcpy(&v, &f, sizeof v); return v;
#else
        int32_t four; std::memcpy(&four, row + k / 2, 4);
        const __m128i b = _mm_cvtsi32_si128(four);
        const __m256i shifts = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
        const __m256i wide = _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(b, b));
        const __m256i q = _mm256_and_si256(_mm256_srlv_epi32(wide, shifts), _mm256_set1_epi32(15));
        const __m256 f = _mm256_cvtepi32_ps(q);
        fv v; std::memcpy(&v, &f, sizeof v);
        return (v - zero) * scale;  // as dequantize_int4: (q - zero) * scale
#endif
    }
};

// R input rows m.. against weight rows n0..n0 + nb - 1 (nb <= 4): R x 4 accumulators;
// columns ahead_from..ahead_to - 1 of the next 4 weight rows fetched into L2 meanwhile.
template <typename Row, int R>
static void block(const float* x, const Matrix& w, float* y, int64_t m, int64_t n0, int64_t nb,
                  int64_t N, int64_t K, int64_t chunk, int64_t ahead_from, int64_t ahead_to) {
    const float* in[R];
    for (int64_t r = 0; r < R; r++) in[r] = x + (m + r) * K;
    fv a[R][4] = {};
    for (int64_t start = 0; start < K; start += chunk) {
        const Row rows[4] = {Row(w, n0, K, start), Row(w, n0 + (1 < nb), K, start),
                             Row(w, n0 + (2 < nb) * 2, K, start),
                             Row(w, n0 + (3 < nb) * 3, K, start)};
        for (int64_t k = start; k < start + chunk; k += VL) {
            fv u[R];
            for (int r = 0; r < R; r++) u[r] = load(in[r] + k);
            for (int j = 0; j < 4; j++) {
                if (k >= ahead_from && k < ahead_to) rows[j].prefetch(k);
                const fv v = rows[j].at(k);
                for (int r = 0; r < R; r++) a[r][j] += u[r] * v;
            }
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float sums[4];
        totals4(a[r], sums);
        for (int64_t j = 0; j < nb; j++) y[(m + r) * N + n0 + j] = act(sums[j]);
    }
}

// The last `left` (< MR) rows: a block of just them (no work for rows that are not there).
template <typename Row, int R>
static void tail(const float* x, const Matrix& w, float* y, int64_t left, int64_t m, int64_t n0,
                 int64_t nb, int64_t N, int64_t K, int64_t chunk, int64_t from, int64_t to) {
    if constexpr (R > 1)
        if (left < R) return tail<Row, R - 1>(x, w, y, left, m, n0, nb, N, K, chunk, from, to);
    block<Row, R>(x, w, y, m, n0, nb, N, K, chunk, from, to);
}

// A block's weight rows already made floats (`widen`): read as they are, from cache.
struct Widened {
    const float* row;
    Widened(const Matrix& w, int64_t n, int64_t K, int64_t) {
        row = static_cast<const float*>(w.values) + n * K;
    }
    fv at(int64_t k) const { return load(row + k); }
    void prefetch(int64_t) const {}
};

// Rows n0.. n0 + nb - 1 of `w` made the floats `Row::at` makes (the same values, so the
// same sums), into `out` [nb, K]: what the rows' inputs then read instead.
template <typename Row>
static void widen(const Matrix& w, int64_t n0, int64_t nb, int64_t K, int64_t chunk, float* out) {
    for (int64_t n = n0; n < n0 + nb; n++)
        for (int64_t start = 0; start < K; start += chunk) {
            const Row row(w, n, K, start);
            for (int64_t k = start; k < start + chunk; k += VL) {
                row.prefetch(k);
                const fv v = row.at(k);
                std::memcpy(out + (n - n0) * K + k, &v, sizeof v);
            }
        }
}

// Every input row past weight rows first..end - 1, MR rows at a time against 4 weight rows:
// each 4 weight rows meet every input row while they are in L1 (the inputs, fewer than
// GEMM_ROWS rows, stay in L2). The next 4 rows are fetched into L2 a slice a pass, so the
// reads from memory spread over the whole time (all in the first pass: 8-12% slower with
// AVX2 at 8-16 rows, as many lines asked for at once as the core can have in flight).
template <typename Row>
static void rows_past(const float* x, const Matrix& w, float* y, int64_t M, int64_t first,
                      int64_t end, int64_t N, int64_t K, int64_t chunk) {
    const int64_t passes = (M + MR - 1) / MR;
    auto slice = [&](int64_t pass) { return K * pass / passes / VL * VL; };
    for (int64_t n0 = first; n0 < end; n0 += 4) {
        const int64_t nb = end - n0 < 4 ? end - n0 : 4;
        int64_t m = 0, pass = 0;
        for (; m + MR <= M; m += MR, pass++)
            block<Row, MR>(x, w, y, m, n0, nb, N, K, chunk, slice(pass), slice(pass + 1));
        if (m < M)
            tail<Row, MR - 1>(x, w, y, M - m, m, n0, nb, N, K, chunk, slice(pass), slice(pass + 1));
    }
}

// The same sums for many rows (a prompt), as a GEMM: a tile of GR input rows against GN
// weight rows, the weight rows in the vector lanes and each input value broadcast, GR x GV
// accumulators. `block` sums lane j of a row's products (columns j, j + VL, j + 2 VL, ...)
// in column order, then the lanes in `totals4`'s tree; here pass j sums those same products
// in the same order, for GN weight rows at once, and the VL passes' sums are added in that
// tree as vectors. So every y[m][n] is bitwise the one `block` makes: which form a step
// takes (by its number of rows) changes no sequence's numbers.
#if VL == 16
#define GR 8
#define GV 3
#else
#define GR 6
#define GV 2
#endif
static inline fv splat(const float* x) {  // one value in every lane (a broadcast load)
#if VL == 16
    const __m512 v = _mm512_set1_ps(*x);
#else
    const __m256 v = _mm256_set1_ps(*x);
#endif
    fv f; std::memcpy(&f, &v, sizeof f); return f;
}
#define GN (GV * VL)

// Input rows, GR a tile (rows past M zero), each tile as [VL][K / VL][GR]: (j, i, r) holds
// x[tile * GR + r][i * VL + j], what pass j broadcasts in order.
static void pack_rows(const float* x, int64_t M, int64_t K, float* out) {
    const int64_t tiles = (M + GR - 1) / GR, I = K / VL;
    #pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < tiles; t++)
        for (int64_t r = 0; r < GR; r++) {
            const int64_t m = t * GR + r;
            float* o = out + t * GR * K + r;
            for (int64_t k = 0; k < K; k++)
                o[((k % VL) * I + k / VL) * GR] = m < M ? x[m * K + k] : 0.f;
        }
}

// VL vectors transposed in place (v[c][j] -> v[j][c]): log2(VL) rounds of the perfect
// shuffle (vector i + 1 / 2 interleaved with vector i + VL / 2 + 1 / 2), each a two-source
// shuffle an instruction or two.
static inline void transpose(fv* v) {
    for (int round = 1; round < VL; round *= 2) {
        fv out[VL];
        for (int i = 0; i < VL / 2; i++) {
#if VL == 16
            out[2 * i] = __builtin_shufflevector(v[i], v[i + 8], 0, 16, 1, 17, 2, 18, 3, 19, 4,
                                                 20, 5, 21, 6, 22, 7, 23);
            out[2 * i + 1] = __builtin_shufflevector(v[i], v[i + 8], 8, 24, 9, 25, 10, 26, 11,
                                                     27, 12, 28, 13, 29, 14, 30, 15, 31);
#else
            out[2 * i] = __builtin_shufflevector(v[i], v[i + 4], 0, 8, 1, 9, 2, 10, 3, 11);
            out[2 * i + 1] = __builtin_shufflevector(v[i], v[i + 4], 4, 12, 5, 13, 6, 14, 7, 15);
#endif
        }
        std::memcpy(v, out, sizeof out);
    }
}

// Weight rows n0.. n0 + nb - 1 (nb <= GN) made the floats `Row::at` makes, as [VL][K / VL][GN]:
// (j, i, c) holds w[n0 + c][i * VL + j] (zero for c >= nb); VL rows a time, transposed.
template <typename Row>
static void pack_weights(const Matrix& w, int64_t n0, int64_t nb, int64_t K, int64_t chunk,
                         float* out) {
    const int64_t I = K / VL;
    for (int64_t c0 = 0; c0 < GN; c0 += VL)
        for (int64_t start = 0; start < K; start += chunk) {
            alignas(64) unsigned char storage[VL * sizeof(Row)];
            Row* rows = reinterpret_cast<Row*>(storage);
            for (int64_t c = 0; c < VL; c++)  // rows past nb: the last real one's, unused
                new (rows + c) Row(w, n0 + (c0 + c < nb ? c0 + c : nb - 1), K, start);
            for (int64_t k = start; k < start + chunk; k += VL) {
                fv v[VL];
                for (int64_t c = 0; c < VL; c++) v[c] = c0 + c < nb ? rows[c].at(k) : fv{};
                transpose(v);
                for (int j = 0; j < VL; j++)
                    std::memcpy(out + (j * I + k / VL) * GN + c0, v + j, sizeof(fv));
            }
        }
}

// One tile: packed rows `xp` (rows m0.. m0 + rows - 1 real) against packed weights `wp`.
// Meanwhile the cache lines [ahead, ahead + 64 lines) are fetched into L2, spread over its
// iterations (the weights the thread packs next: a step of few rows then waits less on memory).
static void tile(const float* xp, const float* wp, float* y, int64_t m0, int64_t rows,
                 int64_t n0, int64_t nb, int64_t N, int64_t K, const char* ahead, int64_t lines) {
    const int64_t I = K / VL, each = (lines + VL * I - 1) / (VL * I);
    const char* const ahead_end = ahead + lines * 64;
    fv part[VL][GR][GV];
    for (int j = 0; j < VL; j++) {
        const float* xj = xp + j * I * GR;
        const float* wj = wp + j * I * GN;
        fv a[GR][GV] = {};
        for (int64_t i = 0; i < I; i++) {
            for (int64_t p = 0; p < each && ahead < ahead_end; p++, ahead += 64)
                __builtin_prefetch(ahead, 0, 2);
            fv v[GV];
            for (int g = 0; g < GV; g++) v[g] = load(wj + i * GN + g * VL);
            for (int r = 0; r < GR; r++) {
                const fv u = splat(xj + i * GR + r);
                for (int g = 0; g < GV; g++) a[r][g] += u * v[g];
            }
        }
        std::memcpy(part[j], a, sizeof a);
    }
    for (int64_t r = 0; r < rows; r++)
        for (int g = 0; g < GV; g++) {
            fv q[4];
            for (int t = 0; t < 4; t++)  // quarter_sums' tree, then totals4's
#if VL == 16
                q[t] = (part[t][r][g] + part[t + 8][r][g]) +
                       (part[t + 4][r][g] + part[t + 12][r][g]);
#else
                q[t] = part[t][r][g] + part[t + 4][r][g];
#endif
            const fv sums = (q[0] + q[1]) + (q[2] + q[3]);
            for (int c = 0; c < VL && g * VL + c < nb; c++)
                y[(m0 + r) * N + n0 + g * VL + c] = act(sums[c]);
        }
}

// Every row past every weight row, GEMM-form: the rows packed once, then a thread takes GN
// weight rows at a time, packs them (in L2) and runs every row tile past them.
template <typename Row>
static void gemm_rows(const float* x, const Matrix& w, float* y, int64_t M, int64_t N,
                      int64_t K, int64_t chunk) {
    const int64_t tiles = (M + GR - 1) / GR;
    thread_local std::vector<float> buffer;  // the calling thread's: its workers read `rows`
    if (buffer.size() < static_cast<size_t>(tiles * GR * K)) buffer.resize(tiles * GR * K);
    const float* rows = buffer.data();
    pack_rows(x, M, K, buffer.data());
    #pragma omp parallel for schedule(static)
    for (int64_t n0 = 0; n0 < N; n0 += GN) {
        const int64_t nb = N - n0 < GN ? N - n0 : GN;
        thread_local std::vector<float> packed;
        if (packed.size() < static_cast<size_t>(GN * K)) packed.resize(GN * K);
        pack_weights<Row>(w, n0, nb, K, chunk, packed.data());
        // the thread's next weight rows (static: its iterations are consecutive) fetched
        // into L2 while this block's tiles compute, a slice each
        const int64_t next = n0 + GN < N ? n0 + GN : N;
        const int64_t next_bytes = ((N - next < GN ? N - next : GN) * K * ROW_BITS[w.kind]) / 8;
        const char* ahead = static_cast<const char*>(w.values) + next * K * ROW_BITS[w.kind] / 8;
        const int64_t lines = (next_bytes + 63) / 64;
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t first = lines * t / tiles, end = lines * (t + 1) / tiles;
            tile(rows + t * GR * K, packed.data(), y, t * GR, M - t * GR < GR ? M - t * GR : GR,
                 n0, nb, N, K, ahead + first * 64, end - first);
        }
    }
}

// y[M, N] = x[M, K] @ W[N, K]^T; K a multiple of VL (and of int4's group, itself one of VL).
// Each y[m][n] is summed in the same order whatever M is and wherever row m falls (each
// accumulator its own row's and weight row's): VL lanes over K, then the lanes in order.
// From GEMM_ROWS rows, the GEMM form (`gemm_rows`). Below, a thread takes NB weight rows at
// a time and runs every input row past them (`rows_past`). With more than 2 x MR input rows,
// int8 and int4 rows are first made floats once a block, in a buffer of the thread's, rather
// than once for every MR inputs (bf16's widening, two instructions, gained nothing).
#define NB 32
template <typename Row>
static void linear_of(const float* x, const Matrix& w, float* y, int64_t M, int64_t N,
                      int64_t K) {
    const int64_t chunk = w.kind == INT4 ? w.group : K;
    if (M >= GEMM_ROWS) return gemm_rows<Row>(x, w, y, M, N, K, chunk);
    const bool widened = (w.kind == INT8 || w.kind == INT4) && M > 2 * MR;
    #pragma omp parallel for schedule(static)
    for (int64_t first = 0; first < N; first += NB) {
        const int64_t end = N - first < NB ? N : first + NB;
        if (!widened) {
            rows_past<Row>(x, w, y, M, first, end, N, K, chunk);
            continue;
        }
        thread_local std::vector<float> floats;
        if (floats.size() < static_cast<size_t>(NB * K)) floats.resize(NB * K);
        widen<Row>(w, first, end - first, K, chunk, floats.data());
        const Matrix block_rows{FP32, floats.data(), nullptr, nullptr, 0};
        rows_past<Widened>(x, block_rows, y + first, M, 0, end - first, N, K, K);
    }
}

static void linear(const float* x, const Matrix& w, float* y, int64_t M, int64_t N, int64_t K) {
    switch (w.kind) {
        case FP32: return linear_of<FloatRow<float>>(x, w, y, M, N, K);
        case BF16: return linear_of<FloatRow<uint16_t>>(x, w, y, M, N, K);
        case INT8: return linear_of<Int8Row>(x, w, y, M, N, K);
        default: return linear_of<Int4Row>(x, w, y, M, N, K);
    }
}

// y = x / rms(x) * w per row, as torch's RMSNorm (x * rsqrt(mean(x^2) + eps) * w in fp32,
// one rounding to bf16 at the end).
static void rms_norm(const float* x, const float* w, float* y, int64_t n, int64_t width,
                     float eps) {
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++) {
        const float* row = x + i * width;
        fv squares = {};
        for (int64_t c = 0; c < width; c += VL) { const fv v = load(row + c); squares += v * v; }
        const float inverse = 1.f / std::sqrt(total(squares) / width + eps);
        for (int64_t c = 0; c < width; c++) y[i * width + c] = act(row[c] * inverse * w[c]);
    }
}

// RoPE ("rotate half") over the first `rot` channels of every query and key head, in place
// in the QKV rows ([n][groups][per_group queries, key, value][d]); cos, sin: [n, rot] (a
// bf16 model's rounded to bf16, as RoPE casts them; each product and their sum rounded).
static void rope(float* qkv, const float* cos, const float* sin, int64_t n, int64_t rot) {
    const int64_t row = G * (H + 2) * D, half = rot / 2;
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t h = 0; h < H + 1; h++) {  // the group's queries, then its key
                float* head = qkv + i * row + (g * (H + 2) + h) * D;
                float x[D];
                for (int64_t j = 0; j < rot; j++) x[j] = head[j];
                for (int64_t j = 0; j < rot; j++) {
                    const float other = j < half ? -x[j + half] : x[j - half];
                    head[j] = act(act(x[j] * cos[i * rot + j]) + act(other * sin[i * rot + j]));
                }
            }
}

static void add_into(float* hidden, const float* x, int64_t count) {
    #pragma omp parallel for simd
    for (int64_t c = 0; c < count; c++) hidden[c] = act(hidden[c] + x[c]);
}

// e^x in every lane: the attention kernel's Cephes expf, `exp16` with AVX-512 and `exp8`
// with AVX2 (std::exp is a call a value; these are VL values in a few cycles).
static inline fv exp_lanes(fv x) {
#if VL == 16
    __m512 v;
    std::memcpy(&v, &x, sizeof v);
    v = exp16(v);
#else
    __m256 v;
    std::memcpy(&v, &x, sizeof v);
    v = exp8(v);
#endif
    std::memcpy(&x, &v, sizeof v);
    return x;
}

// out = silu(gate) * up over rows [gate | up] of 2 * ffn (bf16: silu rounded, then the
// product); ffn a multiple of VL (every linear's inputs are).
static void swiglu(const float* fc1, float* out, int64_t n, int64_t ffn) {
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++)
        for (int64_t c = 0; c < ffn; c += VL) {
            const fv gate = load(fc1 + i * 2 * ffn + c), up = load(fc1 + i * 2 * ffn + ffn + c);
            const fv silu = gate / (1.f + exp_lanes(-gate));
            for (int j = 0; j < VL; j++) out[i * ffn + c + j] = act(act(silu[j]) * up[j]);
        }
}

// Every layer of a step: hidden [n, width] (the embeddings in; the final norm's output
// out). weights: per layer (STRIDE apart) the input norm's address, the QKV and output
// projections (a Matrix each: MATRIX int64s), the pre-MLP norm's address, fc1 and fc2
// ([out, in]); then the final norm's address and the output layer [vocab, width] (kind -1:
// none). keys, values: the pool [layers][blocks, block_size, G, D] (`layer_elements`
// apart; scalar_t: fp32 or bf16, as the activations); tables [n, blocks_width], lengths [n]
// (the new position included), slots [n]. With an output layer, logits [logit_count,
// vocab] of the rows logit_rows. Activations are floats (a bf16 model's bf16 values: `act`);
// the attention reads and writes the cache's type (the bf16 copies of bf16 values: exact).
#define MATRIX 5
#define STRIDE (2 + 4 * MATRIX)
extern "C" void kernel(float* hidden, const int64_t* weights, scalar_t* keys, scalar_t* values,
                       const float* cos, const float* sin, const int64_t* tables,
                       const int64_t* lengths, const int64_t* slots, int64_t n, int64_t layers,
                       int64_t width, int64_t ffn, int64_t rot, int64_t blocks_width,
                       int64_t window, int64_t layer_elements, float eps, float scale,
                       const int64_t* logit_rows, int64_t logit_count, int64_t vocab,
                       float* logits) {
    PyThreadState* released = PyEval_SaveThread();  // the server's other threads run meanwhile
    const int64_t qkv_width = G * (H + 2) * D, context_width = G * H * D;
    std::vector<float> normed(n * width), qkv(n * qkv_width), context(n * context_width);
    std::vector<float> out(n * width), fc1(n * 2 * ffn), gated(n * ffn);
#if BF16_ACTIVATIONS
    std::vector<scalar_t> qkv_cache(n * qkv_width), context_cache(n * context_width);
    scalar_t* attention_in = qkv_cache.data();
    scalar_t* attention_out = context_cache.data();
#else
    scalar_t* attention_in = qkv.data();
    scalar_t* attention_out = context.data();
#endif
    auto matrix_at = [](const int64_t* m) {
        return Matrix{m[0], reinterpret_cast<const void*>(m[1]),
                      reinterpret_cast<const float*>(m[2]), reinterpret_cast<const int8_t*>(m[3]),
                      m[4]};
    };
    auto vector = [&](int64_t layer, int64_t k) {  // k: 0 input norm, 1 pre-MLP norm
        return reinterpret_cast<const float*>(weights[layer * STRIDE + k * (1 + 2 * MATRIX)]);
    };
    auto matrix = [&](int64_t layer, int64_t k) {  // k: 0 QKV, 1 proj, 2 fc1, 3 fc2
        return matrix_at(weights + layer * STRIDE + 1 + k * MATRIX + (k >= 2));
    };
    for (int64_t l = 0; l < layers; l++) {
        rms_norm(hidden, vector(l, 0), normed.data(), n, width, eps);
        linear(normed.data(), matrix(l, 0), qkv.data(), n, qkv_width, width);
        rope(qkv.data(), cos, sin, n, rot);
        const int64_t group = (H + 2) * D;  // every row's key and value first
        scalar_t* layer_keys = keys + l * layer_elements;
        scalar_t* layer_values = values + l * layer_elements;
#if BF16_ACTIVATIONS
        #pragma omp parallel for
        for (int64_t c = 0; c < n * qkv_width; c++) store(qkv[c], attention_in + c);
#endif
        #pragma omp parallel for
        for (int64_t i = 0; i < n; i++)
            store_new(layer_keys, layer_values, attention_in + i * qkv_width + H * D,
                      attention_in + i * qkv_width + (H + 1) * D, group, group, slots[i]);
        paged_attention(attention_in, layer_keys, layer_values, tables, lengths, attention_out,
                        nullptr, nullptr, slots, n, blocks_width, window, 0, qkv_width, group, 0,
                        0, 0, 0, scale, nullptr, 0);
#if BF16_ACTIVATIONS
        #pragma omp parallel for
        for (int64_t c = 0; c < n * context_width; c++) context[c] = to_float(attention_out[c]);
#endif
        linear(context.data(), matrix(l, 1), out.data(), n, width, context_width);
        add_into(hidden, out.data(), n * width);
        rms_norm(hidden, vector(l, 1), normed.data(), n, width, eps);
        linear(normed.data(), matrix(l, 2), fc1.data(), n, 2 * ffn, width);
        swiglu(fc1.data(), gated.data(), n, ffn);
        linear(gated.data(), matrix(l, 3), out.data(), n, width, ffn);
        add_into(hidden, out.data(), n * width);
    }
    const int64_t* last = weights + layers * STRIDE;
    rms_norm(hidden, reinterpret_cast<const float*>(last[0]), hidden, n, width, eps);
    if (last[1] >= 0) {  // the output layer over the rows that sample, by the same kernel
        std::vector<float> picked(logit_count * width);
        for (int64_t r = 0; r < logit_count; r++)
            std::memcpy(picked.data() + r * width, hidden + logit_rows[r] * width,
                        width * sizeof(float));
        linear(picked.data(), matrix_at(last + 1), logits, logit_count, vocab, width);
    }
    PyEval_RestoreThread(released);
}
"""

_ARGUMENTS = ["float*", "const int64_t*", "scalar_t*", "scalar_t*", "const float*", "const float*"]
_ARGUMENTS += ["const int64_t*"] * 3 + ["int64_t"] * 8 + ["float", "float"]
_ARGUMENTS += ["const int64_t*", "int64_t", "int64_t", "float*"]
_KINDS = {"fp32": 0, "bf16": 1, "int8": 2, "int4": 3}
"""The kernel's weight kinds (its `Matrix`)."""
_NO_MATRIX = [-1, 0, 0, 0, 0]
_BLOCKING = {"avx512": (16, 4, 32), "avx2": (8, 3, 40)}
"""Per instruction set: the lanes a vector (VL), the input rows `block` takes a time (MR: AVX2's
3 x 4 accumulators, 3 inputs and a weight fill its 16 registers; 3 rather than 2 made the
135M model's steps of 4-32 rows 10-25% faster in every weight kind), and the rows from which a
step's linears take the GEMM form (GEMM_ROWS: where it measured as fast or faster on two
cores, the 135M model's steps of 12-144 rows in fp32, bf16 and int8; below, packing the
weights costs more than it saves)."""
VECTOR_ISAS = ("avx512", "avx2")
"""The instruction sets this step is built for, best first."""


def vector_isa() -> str | None:
    """The instruction set this step would be built for here (`cpu_isa`), or None."""
    return next((isa for isa in VECTOR_ISAS if cpu_isa.allows(isa)), None)


def weight_kind(linear: nn.Module) -> str | None:
    """The kernel's weight kind for a layer it reads as it is ("fp32", "bf16", "int8",
    "int4": mg-quantize's int8_wo and int4 modules), or None: one it cannot read."""
    if type(linear) is nn.Linear:
        return _FLOAT_KINDS.get(linear.weight.dtype)
    if type(linear) is Int8WeightOnlyLinear:  # (not its W8A8 subclass)
        return "int8"
    if type(linear) is Int4WeightOnlyLinear and linear.group_size % 16 == 0:
        return "int4"
    return None


_FLOAT_KINDS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


def activations(cache: PagedKVCache) -> str:
    """The model's activations as the step computes them: "bf16" with a bf16 cache (a bf16
    model's), else "fp32"."""
    return "bf16" if cache.keys.dtype == torch.bfloat16 else "fp32"


def vector_decode_unsupported(model: nn.Module, cache: PagedKVCache | None) -> str | None:
    """Why `VectorDecode` cannot run this model's steps here, or None."""
    if vector_isa() is None:
        return f"the CPU kernels may use neither AVX-512 nor AVX2 ({cpu_isa.chosen()})"
    dtype = activations(cache) if cache is not None else "fp32"
    if why := llama_shape_unsupported(model, cache, _DTYPES[dtype]):
        return why
    for layer in model.decoder.layers:
        for linear in layer_linears(layer):
            if isinstance(linear, PackedLinear):  # (oneDNN's layout cannot be read back)
                return "its linears are packed for another kernel (pack_linears)"
            if linear.bias is not None:
                return "its linears are not bias-free"
            kind = weight_kind(linear)
            if kind not in (dtype, "int8", "int4") or linear.in_features % 16:
                return (
                    f"its linears are not {dtype}, int8_wo or int4 (groups of a multiple of "
                    "16) with inputs in multiples of 16"
                )
    return None


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class VectorDecode:
    """A model's serving steps over its paged cache, each one C++ call, for a model and
    cache `vector_decode_unsupported` accepts. `takes` and `logits` as `FusedDecode`'s."""

    def __init__(self, model: GPTModel, cache: PagedKVCache) -> None:
        config = model.config
        self.model, self.cache = model, cache
        attention = model.decoder.layers[0].self_attention
        groups, heads, d = attention.num_groups, attention.num_heads, attention.head_dim
        self.isa = vector_isa()
        self.activations = activations(cache)
        """"fp32", or "bf16": each op's outputs rounded to bf16 where the eager model's are."""
        bf16 = self.activations == "bf16"
        self._step = _build(self.isa, bf16, groups, heads // groups, d, cache.block_size)
        table: list[int] = []
        self._keep: list[Tensor] = []  # what the addresses point into
        kinds: list[str] = []
        for layer in model.decoder.layers:
            attention, mlp = layer.self_attention, layer.mlp
            table.append(self._address(layer.input_layernorm.weight.float()))
            table += self._matrix(attention.linear_qkv, kinds)
            table += self._matrix(attention.linear_proj, kinds)
            table.append(self._address(layer.pre_mlp_layernorm.weight.float()))
            table += self._matrix(mlp.linear_fc1, kinds)
            table += self._matrix(mlp.linear_fc2, kinds)
        table.append(self._address(model.decoder.final_layernorm.weight.float()))
        self._vocab = 0
        """The output layer's rows where the step computes the logits itself (a plain
        head without bias, or a quantized output layer: the same sums whatever the batch,
        as the layers'); 0: the model's head computes them."""
        dtype = _DTYPES[self.activations]
        output = _output_layer(model, dtype) if config.hidden_size % 16 == 0 else None
        if isinstance(output, Tensor):
            table += [_KINDS[self.activations], self._address(output), 0, 0, 0]
            self._vocab = output.shape[0]
        elif output is not None:
            table += self._matrix(output, [])
            self._vocab = output.out_features
        else:
            table += _NO_MATRIX
        self._weights = torch.tensor(table, dtype=torch.int64)
        narrower = sorted({k for k in kinds if k != self.activations})
        self.description = f"{self.isa} {self.activations}"
        self.description += "".join(f", {k} weights" for k in narrower)
        """For the log: "avx2 fp32", "avx512 bf16", "avx512 fp32, int8 weights"."""
        self._sizes = (
            len(model.decoder.layers),
            config.hidden_size,
            config.ffn_hidden_size,
            config.rotary_dim,
        )
        self._eps = float(config.layernorm_epsilon)
        self._scale = 1.0 / math.sqrt(d)
        self._window = config.window_size[0] if config.window_size is not None else -1
        self.steps = 0
        """Steps run so far."""

    def _address(self, tensor: Tensor) -> int:
        tensor = tensor.detach().contiguous()
        self._keep.append(tensor)
        return tensor.data_ptr()

    def _matrix(self, linear: nn.Module, kinds: list[str]) -> list[int]:
        """The kernel's `Matrix` of a layer `weight_kind` reads: kind, values, scales,
        zero points, group size (the tensors kept alive here: a quantized layer may drop
        its own copy for another kernel's layout)."""
        kind = weight_kind(linear)
        kinds.append(kind)
        if kind in ("fp32", "bf16"):
            return [_KINDS[kind], self._address(linear.weight), 0, 0, 0]
        if kind == "int8":
            scales = self._address(linear.weight_scale.float())
            return [_KINDS[kind], self._address(linear.qweight), scales, 0, 0]
        packed = linear.qweight if linear.qweight is not None else pack_int4(linear.q_values())
        values, scales = self._address(packed), self._address(linear.weight_scale.float())
        zeros = self._address(linear.weight_zero_point.to(torch.int8))
        return [_KINDS[kind], values, scales, zeros, linear.group_size]

    def takes(self, segments: Sequence[PagedSegment]) -> bool:
        """Whether this step runs fused (the AMX step's rule, `fused_decode.takes`)."""
        return takes(segments)

    @torch.inference_mode()
    def logits(
        self, segments: Sequence[PagedSegment], ids: Tensor, pos: Tensor, logit_rows: Sequence[int]
    ) -> Tensor:
        """`ModelRunner.forward` for a step it `takes`: logits [len(logit_rows), vocab]."""
        blocks, lengths, slots = step_tables(segments, self.cache.block_size)
        model, cache = self.model, self.cache
        dtype = _DTYPES[self.activations]  # (a bf16 model's values held exactly as floats)
        hidden = model.embedding(ids, pos)[0].float().contiguous()
        rope = model.rotary_pos_emb(pos)  # fp32 [1, n, 1, rot], cast as RoPE casts them
        cos, sin = (x[0, :, 0].to(dtype).float().contiguous() for x in rope)
        layers, width, ffn, rot = self._sizes
        rows = torch.tensor(list(logit_rows), dtype=torch.long)
        logits = hidden.new_empty(len(rows), self._vocab)
        self._step(
            hidden, self._weights, cache.keys, cache.values, cos, sin, blocks, lengths, slots,
            hidden.shape[0], layers, width, ffn, rot, blocks.shape[1], self._window,
            cache.keys[0].numel(), self._eps, self._scale, rows, len(rows), self._vocab, logits,
        )  # fmt: skip
        self.steps += 1
        if self._vocab:
            return mask_padded_vocab(logits, real_vocab_size(model))
        return model.output_and_loss(hidden[rows][None].to(dtype), None)[0]


def _output_layer(model: GPTModel, dtype: torch.dtype) -> Tensor | nn.Module | None:
    """What the step computes the logits with, where it can: the plain head's weight in
    the activations' `dtype` without bias, or a quantized output layer without bias whose
    module computes the logits (`OutputModuleHead`)."""
    if is_plain_output(model):
        weight = model.output_weight()
        if model.output_bias() is None and weight.dtype == dtype:
            return weight
        return None
    if type(model.output_head) is OutputModuleHead:
        layer = model.output_layer
        if weight_kind(layer) in ("int8", "int4") and layer.bias is None:
            return layer
    return None


@functools.cache
def _build(isa: str, bf16: bool, groups: int, per_group: int, head_dim: int, block: int):
    # lazy: torch._inductor takes seconds to import; only a serving CPU builds this step
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = "\n".join(
        [
            f"// instruction set: {isa}",
            "#define PY_SSIZE_T_CLEAN\n#include <Python.h>\n#include <immintrin.h>",
            "#include <cmath>\n#include <vector>",
            "#define kernel paged_attention",
            kernel_source("uint16_t" if bf16 else "float", groups, per_group, head_dim, block),
            "#undef kernel",
            "#define VL {}\n#define MR {}\n#define GEMM_ROWS {}".format(*_BLOCKING[isa]),
            f"#define BF16_ACTIVATIONS {int(bf16)}",
            _STEP,
        ]
    )
    with quiet_cpp_extension():
        return CppPythonBindingsCodeCache.load_pybinding(
            _ARGUMENTS,
            source,
            needs_vec_isa=False,  # inductor's ISA flags would follow (and undo) ours
            extra_flags=(*kernel_flags(), *cpu_isa.build_flags(isa)),
        )
