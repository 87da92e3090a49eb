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

It is C++ specialised to one model's shape and dtype. Where the CPU has AVX-512
and head_dim and the block size are multiples of 16 (AVX2: 8), it scores 16 (8)
positions at a time and runs the softmax on vectors (per-position dot products
spent most of their time in horizontal sums); elsewhere it is plain loops the
compiler vectorizes. It is built at first use with the C++ toolchain that
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
#include <vector>

constexpr int64_t G = {groups};      // key/value heads (query groups)
constexpr int64_t H = {per_group};   // query heads per group
#define HEAD_DIM {head_dim}
#define BLOCK_SIZE {block_size}
constexpr int64_t D = HEAD_DIM;
constexpr int64_t BS = BLOCK_SIZE;  // positions per block
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

// The arguments every variant takes. query: [n, G, H, D], rows and groups at the given
// strides (elements), heads D apart; keys, values: one layer's pool [blocks, BS, G, D];
// tables: [n, width] block ids; lengths: [n] positions each sequence attends to (its new
// one included); window < 0: no sliding window. With `write_new`, sequence i's new key and
// value rows (groups at the given strides) are first written to its pool slot slots[i].
// With `has_sinks`, sinks[g * H + h] is query head (g, h)'s sink logit: one more term of
// its softmax's denominator, exp(sink), with no value (gpt-oss's attention sinks).
#define KERNEL_ARGUMENTS \
    const scalar_t* query, scalar_t* keys, scalar_t* values, const int64_t* tables, \
    const int64_t* lengths, scalar_t* out, const scalar_t* new_keys, \
    const scalar_t* new_values, const int64_t* slots, int64_t n, int64_t width, \
    int64_t window, int64_t write_new, int64_t query_row, int64_t query_group, int64_t key_row, \
    int64_t key_group, int64_t value_row, int64_t value_group, float scale, \
    const float* sinks, int64_t has_sinks

// One sequence's new key and value rows (groups `key_group` / `value_group` apart)
// into pool slot `slot`.
static inline void store_new(scalar_t* keys, scalar_t* values, const scalar_t* key,
                             const scalar_t* value, int64_t key_group, int64_t value_group,
                             int64_t slot) {{
    for (int64_t g = 0; g < G; g++) {{
        std::memcpy(keys + (slot * G + g) * D, key + g * key_group, D * sizeof(scalar_t));
        std::memcpy(values + (slot * G + g) * D, value + g * value_group, D * sizeof(scalar_t));
    }}
}}

static inline void prefetch_block(const scalar_t* keys, const scalar_t* values, int64_t block) {{
    const char* k = reinterpret_cast<const char*>(keys + block * BS * G * D);
    const char* v = reinterpret_cast<const char*>(values + block * BS * G * D);
    for (int64_t c = 0; c < int64_t(BS * G * D * sizeof(scalar_t)); c += 64) {{
        __builtin_prefetch(k + c);
        __builtin_prefetch(v + c);
    }}
}}

#if defined(__AVX512F__)
// 16 lanes at a time: loads and stores of either scalar type (bf16 rounded to nearest
// even), and e^x (also used by `mg.generate_server.fused_decode`, which includes this)
#include <immintrin.h>
static inline __m512 load16(const float* x) {{ return _mm512_loadu_ps(x); }}
static inline __m512 load16(const uint16_t* x) {{  // bfloat16 bits -> float
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}}
static inline void store16(__m512 x, float* y) {{ _mm512_storeu_ps(y, x); }}
static inline void store16(__m512 x, uint16_t* y) {{  // round to nearest even
    __m512i u = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    const __m256i bits = _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), bits);
}}
static inline __m512 splat(float x) {{ return _mm512_set1_ps(x); }}
// e^x (Cephes' expf: x = n ln2 + r, a degree-7 polynomial in r, times 2^n), x clamped to
// [-104, 88] (e^-104 is 0 in float, e^88 near its largest)
static inline __m512 exp16(__m512 x) {{
    x = _mm512_min_ps(_mm512_max_ps(x, splat(-104.f)), splat(88.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, splat(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, splat(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, splat(-2.12194440e-4f), r);
    __m512 p = splat(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, splat(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, splat(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, splat(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, splat(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, splat(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, splat(1.f)));
    return _mm512_scalef_ps(p, n);
}}

#endif

#if defined(__AVX2__) && defined(__FMA__)
// 8 lanes at a time, as above (also used by `mg.generate_server.vector_decode`)
#include <immintrin.h>
static inline __m256 load8(const float* x) {{ return _mm256_loadu_ps(x); }}
static inline __m256 load8(const uint16_t* x) {{  // bfloat16 bits -> float
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}}
static inline void store8(__m256 x, float* y) {{ _mm256_storeu_ps(y, x); }}
static inline void store8(__m256 x, uint16_t* y) {{  // round to nearest even
    __m256i u = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF)));
    u = _mm256_srli_epi32(u, 16);
    const __m128i bits =
        _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y), bits);
}}
// e^x: the same Cephes expf (x = n ln 2 + r, |r| <= ln 2 / 2), 2^n made in the exponent
// bits, so x is clamped to [-87.3, 88.7] (e^x a normal float)
static inline __m256 exp8(__m256 x) {{
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.7f));
    const __m256 magic = _mm256_set1_ps(12582912.f);  // 1.5 x 2^23: adding it rounds
    const __m256 shifted = x * 1.44269504088896341f + magic;
    const __m256 n = shifted - magic;
    const __m256 r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + r + 1.f;
    const __m256i bits = _mm256_castps_si256(shifted);  // n's bits: shifted's low ones
    const __m256i two_to_n = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_sub_epi32(bits, _mm256_set1_epi32(0x4B400000)),
                         _mm256_set1_epi32(127)), 23);
    return p * _mm256_castsi256_ps(two_to_n);
}}
#endif

// The two-pass kernel's operations on `vec`, from one set of intrinsics (P: _mm512 or
// _mm256) and that width's loads, stores and e^x.
#define LANE_OPERATIONS(P, LOAD, STORE, EXP)                                                \
    static inline vec vsplat(float x) {{ return P##_set1_ps(x); }}                            \
    static inline vec vload(const float* x) {{ return LOAD(x); }}                             \
    static inline vec vload(const uint16_t* x) {{ return LOAD(x); }}                          \
    static inline void vstore(vec x, float* y) {{ STORE(x, y); }}                             \
    static inline void vstore(vec x, uint16_t* y) {{ STORE(x, y); }}                          \
    static inline vec vadd(vec a, vec b) {{ return P##_add_ps(a, b); }}                       \
    static inline vec vsub(vec a, vec b) {{ return P##_sub_ps(a, b); }}                       \
    static inline vec vmul(vec a, vec b) {{ return P##_mul_ps(a, b); }}                       \
    static inline vec vfmadd(vec a, vec b, vec c) {{ return P##_fmadd_ps(a, b, c); }}         \
    static inline vec vmax(vec a, vec b) {{ return P##_max_ps(a, b); }}                       \
    static inline vec vexp(vec x) {{ return EXP(x); }}

#if defined(__AVX512F__) && HEAD_DIM % 16 == 0 && BLOCK_SIZE % 16 == 0
// AVX-512: the scores of 16 positions at a time. Each position's partial products fold
// into one vector per query head, and `sums` turns 16 such vectors into one vector of
// 16 scores (a transposing add tree: 45 instructions where 16 horizontal sums take
// ~130), so the softmax runs on vectors too (`exp16`).
#define LANES 16
typedef __m512 vec;
LANE_OPERATIONS(_mm512, load16, store16, exp16)
static inline float vtotal(vec x) {{ return _mm512_reduce_add_ps(x); }}
static inline float vpeak(vec x) {{ return _mm512_reduce_max_ps(x); }}
// x's lanes start..stop - 1, and `other`'s elsewhere
static inline vec vlanes(vec x, int64_t start, int64_t stop, vec other) {{
    const uint32_t below_stop = (1u << stop) - 1, below_start = (1u << start) - 1;
    return _mm512_mask_blend_ps(static_cast<__mmask16>(below_stop & ~below_start), other, x);
}}

static inline __m512 fold(__m512 a, __m512 b, int lanes) {{  // 128-bit lanes of a and b, added
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, lanes & 0xFF),
                         _mm512_shuffle_f32x4(a, b, lanes >> 8));
}}

// lane j of the result: the sum of v[j]'s 16 lanes
static inline vec sums(const vec* v) {{
    __m512 s[8], u[4];
    for (int k = 0; k < 8; k++)  // per 128-bit lane: (a0+a2, b0+b2, a1+a3, b1+b3)
        s[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]),
                             _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
    for (int k = 0; k < 4; k++) {{  // per 128-bit lane: that lane's sums of 4 vectors
        const __m512d a = _mm512_castps_pd(s[2 * k]), b = _mm512_castps_pd(s[2 * k + 1]);
        u[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    }}
    // the four 128-bit lanes of each u[k] added into the k-th lane
    return fold(fold(u[0], u[1], 0xEE44), fold(u[2], u[3], 0xEE44), 0xDD88);
}}

// Lane j of partial[j] sums to the dot product of the query row `q` with the key row of
// position j (row j at keys + j * G * D).
#if defined(__AVX512BF16__) && HEAD_DIM % 32 == 0
static inline void dots(const uint16_t* q, const uint16_t* keys, vec* partial) {{
    // bfloat16 pairs multiplied exactly and summed in float, straight from the pool
    __m512i query[D / 32];
    for (int64_t c = 0; c < D / 32; c++) query[c] = _mm512_loadu_si512(q + 32 * c);
    for (int64_t j = 0; j < 16; j++) {{
        __m512 dot = _mm512_setzero_ps();
        for (int64_t c = 0; c < D / 32; c++) {{
            const __m512i key = _mm512_loadu_si512(keys + j * G * D + 32 * c);
            dot = _mm512_dpbf16_ps(dot, (__m512bh)query[c], (__m512bh)key);
        }}
        partial[j] = dot;
    }}
}}
#endif
#elif defined(__AVX2__) && defined(__FMA__) && HEAD_DIM % 8 == 0 && BLOCK_SIZE % 8 == 0
// AVX2: the same, 8 positions at a time (per-position dot products and a scalar exp a
// score took twice the time at 8 sequences)
#define LANES 8
typedef __m256 vec;
LANE_OPERATIONS(_mm256, load8, store8, exp8)
static inline float vtotal(vec x) {{
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}}
static inline float vpeak(vec x) {{
    const __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 t = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
}}
static inline vec vlanes(vec x, int64_t start, int64_t stop, vec other) {{
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i in = _mm256_and_si256(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(stop)), lane),
        _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(start) - 1)));
    return _mm256_blendv_ps(other, x, _mm256_castsi256_ps(in));
}}
// lane j of the result: the sum of v[j]'s 8 lanes (pairs, then quads, then the halves)
static inline vec sums(const vec* v) {{
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}}
#endif

#ifdef LANES
constexpr int64_t V = D / LANES;  // vectors per head row

template <typename T>
static inline void dots(const T* q, const T* keys, vec* partial) {{
    vec query[V];
    for (int64_t v = 0; v < V; v++) query[v] = vload(q + LANES * v);
    for (int64_t j = 0; j < LANES; j++) {{
        vec dot = vmul(query[0], vload(keys + j * G * D));
        for (int64_t v = 1; v < V; v++)
            dot = vfmadd(query[v], vload(keys + j * G * D + LANES * v), dot);
        partial[j] = dot;
    }}
}}

// Two passes over a sequence's blocks. The first scores every position for every query
// head, LANES positions at a time, into `scores` ([G][H][positions], masked lanes -inf); one
// softmax per head follows; the second sums the value rows by their weights. (A running
// softmax rescales each head's state every LANES positions: a chain of reductions and an
// exponential that kept the cores waiting, ~2x the time at 32 sequences.)
extern "C" void kernel(KERNEL_ARGUMENTS)
{{
    #pragma omp parallel
    {{
    std::vector<float> scores;  // per thread, reused across its sequences
    #pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) {{
        if (write_new)
            store_new(keys, values, new_keys + i * key_row, new_values + i * value_row,
                      key_group, value_group, slots[i]);
        const int64_t length = lengths[i];
        const int64_t first = window >= 0 ? std::max<int64_t>(0, length - 1 - window) : 0;
        const int64_t origin = first / LANES * LANES;  // scores[.][.][0] is this position's
        const int64_t span = (length - origin + LANES - 1) / LANES * LANES;
        if (int64_t(scores.size()) < G * H * span) scores.resize(G * H * span);
        const int64_t* table = tables + i * width;
        if ((first / BS + 1) * BS < length)  // two blocks ahead of the one being scored
            prefetch_block(keys, values, table[first / BS + 1]);
        for (int64_t b = first / BS; b * BS < length; b++) {{
            if ((b + 2) * BS < length)
                prefetch_block(keys, values, table[b + 2]);
            const int64_t block_end = std::min((b + 1) * BS, length);
            for (int64_t t = std::max(b * BS, origin); t < block_end; t += LANES) {{
                const int64_t start = std::max(t, first) - t;
                const int64_t stop = std::min(t + LANES, length) - t;
                const int64_t row = (table[b] * BS + t - b * BS) * G * D;
                for (int64_t g = 0; g < G; g++) {{
                    const scalar_t* q = query + i * query_row + g * query_group;
                    for (int64_t h = 0; h < H; h++) {{
                        vec partial[LANES];
                        dots(q + h * D, keys + row + g * D, partial);
                        const vec scores_t = vmul(sums(partial), vsplat(scale));
                        vstore(vlanes(scores_t, start, stop, vsplat(-INFINITY)),
                               scores.data() + (g * H + h) * span + t - origin);
                    }}
                }}
            }}
        }}
        float total[G][H];
        for (int64_t g = 0; g < G; g++) for (int64_t h = 0; h < H; h++) {{
            float* x = scores.data() + (g * H + h) * span;
            vec top = vsplat(-INFINITY);
            for (int64_t c = 0; c < span; c += LANES) top = vmax(top, vload(x + c));
            float peak = vpeak(top);
            const float sink = has_sinks ? sinks[g * H + h] : -INFINITY;
            peak = std::max(peak, sink);
            const vec most = vsplat(peak);
            vec sum = vsplat(0.f);
            for (int64_t c = 0; c < span; c += LANES) {{
                const vec w = vexp(vsub(vload(x + c), most));
                vstore(w, x + c);
                sum = vadd(sum, w);
            }}
            total[g][h] = vtotal(sum) + (has_sinks ? std::exp(sink - peak) : 0.f);
        }}
        for (int64_t g = 0; g < G; g++) {{
            vec acc[H][V];
            for (int64_t h = 0; h < H; h++) for (int64_t v = 0; v < V; v++) acc[h][v] = vsplat(0.f);
            for (int64_t b = first / BS; b * BS < length; b++) {{
                const int64_t begin = std::max(b * BS, first), end = std::min((b + 1) * BS, length);
                const scalar_t* rows = values + (table[b] * BS - b * BS) * G * D + g * D;
                for (int64_t p = begin; p < end; p++) {{  // positions outside are never read
                    vec row[V];
                    for (int64_t v = 0; v < V; v++) row[v] = vload(rows + p * G * D + LANES * v);
                    for (int64_t h = 0; h < H; h++) {{
                        const vec w = vsplat(scores[(g * H + h) * span + p - origin]);
                        for (int64_t v = 0; v < V; v++)
                            acc[h][v] = vfmadd(w, row[v], acc[h][v]);
                    }}
                }}
            }}
            for (int64_t h = 0; h < H; h++) {{
                scalar_t* out_row = out + ((i * G + g) * H + h) * D;
                const vec inverse = vsplat(1.f / total[g][h]);
                for (int64_t v = 0; v < V; v++)
                    vstore(vmul(acc[h][v], inverse), out_row + LANES * v);
            }}
        }}
    }}
    }}
}}
#else
extern "C" void kernel(KERNEL_ARGUMENTS)
{{
    #pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; i++) {{
        if (write_new)
            store_new(keys, values, new_keys + i * key_row, new_values + i * value_row,
                      key_group, value_group, slots[i]);
        float q[G][H][D], acc[G][H][D], running_max[G][H], total[G][H], p[G][H][BS];
        for (int64_t g = 0; g < G; g++) for (int64_t h = 0; h < H; h++) {{
            const scalar_t* row = query + i * query_row + g * query_group + h * D;
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
            if ((b + 1) * BS < length)  // the next block, while this one is computed
                prefetch_block(keys, values, table[b + 1]);
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
        if (has_sinks) for (int64_t g = 0; g < G; g++) for (int64_t h = 0; h < H; h++) {{
            const float sink = sinks[g * H + h], m = std::max(running_max[g][h], sink);
            const float rescale = std::exp(running_max[g][h] - m);
            #pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[g][h][d] *= rescale;
            total[g][h] = total[g][h] * rescale + std::exp(sink - m);
        }}
        for (int64_t g = 0; g < G; g++) for (int64_t h = 0; h < H; h++) {{
            scalar_t* row = out + ((i * G + g) * H + h) * D;
            const float inverse = 1.f / total[g][h];
            for (int64_t d = 0; d < D; d++) store(acc[g][h][d] * inverse, row + d);
        }}
    }}
}}
#endif
"""

_SCALARS = {torch.float32: "float", torch.bfloat16: "uint16_t"}
_ARGUMENTS = ["const scalar_t*", "scalar_t*", "scalar_t*", "const int64_t*", "const int64_t*"]
_ARGUMENTS += ["scalar_t*", "const scalar_t*", "const scalar_t*", "const int64_t*"]
_ARGUMENTS += ["int64_t"] * 10 + ["float", "const float*", "int64_t"]


_NO_SINKS = torch.zeros(1)  # what the kernel's sink pointer points to when it has none


class DecodeKernel:
    """The kernel built for one shape and dtype."""

    def __init__(self, entry: Callable[..., None]) -> None:
        self._entry = entry

    def __call__(
        self,
        query: Tensor,
        keys: Tensor,
        values: Tensor,
        tables: Tensor,
        lengths: Tensor,
        window: int,
        scale: float,
        new: tuple[Tensor, Tensor, Tensor] | None = None,
        sinks: Tensor | None = None,
    ) -> Tensor:
        """Context [n, heads, d] of the queries [n, heads, d] over one layer's pool `keys`,
        `values` [blocks, block_size, groups, d]: row i over the first lengths[i]
        positions of the blocks tables[i] (the last `window` + 1 of them when window >= 0).
        `new` (keys, values [n, groups, d], slots [n]): the step's own keys and values,
        written into the pool first, each row's before it is read (what would otherwise
        take two `index_copy_` a layer). Views are read where they lie (a fused QKV
        projection's split), as long as a head's values are contiguous. `sinks` [heads]:
        each head's sink logit (gpt-oss), one more term of its softmax with no value."""
        if not (keys.is_contiguous() and values.is_contiguous() and tables.is_contiguous()):
            raise ValueError("paged decode kernel: keys, values and tables must be contiguous")
        n, heads, d = query.shape
        groups = keys.shape[2]
        if query.stride(2) != 1 or query.stride(1) != d:
            query = query.contiguous()
        out = query.new_empty(n, heads, d)
        width = tables.shape[1]
        if new is None:
            new_keys, new_values, slots, strides = query, query, lengths, (0, 0, 0, 0)
        else:
            new_keys, new_values, slots = (x if x.stride(-1) == 1 else x.contiguous() for x in new)
            strides = (*new_keys.stride()[:2], *new_values.stride()[:2])
        sink_logits = _NO_SINKS if sinks is None else sinks.float().contiguous()
        self._entry(
            query, keys, values, tables, lengths, out, new_keys, new_values, slots,
            n, width, window, int(new is not None), query.stride(0), heads // groups * d,
            *strides, scale, sink_logits, int(sinks is not None),
        )  # fmt: skip
        return out


def decode_kernel(
    dtype: torch.dtype,
    groups: int,
    heads: int,
    head_dim: int,
    block_size: int,
    isa_flags: tuple[str, ...] = (),
) -> tuple[DecodeKernel | None, str]:
    """The kernel for this shape, or None and why it cannot be had here. `isa_flags`:
    compiler flags that confine it to an older instruction set than this CPU's (say
    ("-mno-avx512f",): the AVX2 path), as a server's --cpu-isa asks."""
    if dtype not in _SCALARS:
        return None, f"no CPU paged-attention kernel for {dtype} (float32 and bfloat16 only)"
    try:
        entry = _build(_SCALARS[dtype], groups, heads // groups, head_dim, block_size, isa_flags)
    except Exception as err:  # noqa: BLE001 - no compiler, or it failed: SDPA serves
        return None, f"the CPU paged-attention kernel could not be built ({type(err).__name__})"
    return DecodeKernel(entry), "the CPU paged-attention kernel (blocks read in place)"


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
def _build(
    scalar: str,
    groups: int,
    per_group: int,
    head_dim: int,
    block_size: int,
    isa_flags: tuple[str, ...] = (),
):
    """Compile (or load from inductor's on-disk cache) the kernel for one shape."""
    # lazy: inductor takes seconds to import, and every model import reaches this module
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    source = kernel_source(scalar, groups, per_group, head_dim, block_size)
    if isa_flags:  # (the cache knows a library by its source)
        source = f"// built with {' '.join(isa_flags)}\n{source}"
    with quiet_cpp_extension():
        return CppPythonBindingsCodeCache.load_pybinding(
            _ARGUMENTS,
            source,
            needs_vec_isa=not isa_flags,  # (inductor's ISA flags would follow, and undo, these)
            extra_flags=(*kernel_flags(), *isa_flags),
        )


def kernel_source(scalar: str, groups: int, per_group: int, head_dim: int, block_size: int) -> str:
    """The kernel's C++ for one shape: `extern "C" void kernel(KERNEL_ARGUMENTS)`, for a
    caller that builds it into a larger library (`mg.generate_server.fused_decode`)."""
    return _SOURCE.format(
        groups=groups, per_group=per_group, head_dim=head_dim, block_size=block_size, scalar=scalar
    )


def kernel_flags() -> tuple[str, ...]:
    """The compiler flags the kernel needs: inductor builds its own kernels unvectorized and
    without FMA contraction (they are vectorized by hand); this one relies on the compiler's
    loop vectorizer."""
    # lazy: inductor takes seconds to import, and every model import reaches this module
    from torch._inductor.cpp_builder import get_cpp_compiler

    clang = "clang" in get_cpp_compiler()
    flags = ("-fvectorize",) if clang else ("-ftree-loop-vectorize",)
    return (*flags, "-ffp-contract=fast", "-fno-math-errno")
