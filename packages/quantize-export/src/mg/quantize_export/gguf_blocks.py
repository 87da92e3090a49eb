"""llama.cpp's Q8_0, Q4_0 and Q4_1 blocks in PyTorch, byte for byte what
``gguf.quants.quantize`` (and ggml-quants.c) produce, plus the exact re-labelling of
mg's own int8 / int4 weights as such blocks.

Blocks hold 32 consecutive inputs of one row:
  Q8_0  fp16 d, 32 × int8 q                      w = q · d
  Q4_0  fp16 d, 16 bytes: q[j] | q[j + 16] << 4  w = (q − 8) · d
  Q4_1  fp16 d, fp16 m, 16 bytes as Q4_0         w = q · d + m
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32


def _fp16_bytes(x: Tensor) -> Tensor:
    """[n, 1] float → [n, 2] uint8 (little-endian fp16)."""
    return x.to(torch.float16).contiguous().view(torch.uint8).reshape(-1, 2)


def _pack_halves(q: Tensor) -> Tensor:
    """[n, 32] values 0..15 → [n, 16]: the first half in the low nibbles, the second high."""
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _blocks(weight: Tensor) -> Tensor:
    rows, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"GGUF blocks need rows of a multiple of {BLOCK} values, not {cols}")
    return weight.float().reshape(-1, BLOCK)


def _rows(blocks: Tensor, rows: int) -> Tensor:
    return blocks.reshape(rows, -1)


def quantize_q8_0(weight: Tensor) -> Tensor:
    b = _blocks(weight)
    d = b.abs().amax(dim=1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    x = b * inv
    q = torch.sign(x) * (x.abs().floor() + (2 * (x.abs() - x.abs().floor())).floor())  # roundf
    return _rows(torch.cat([_fp16_bytes(d), q.to(torch.int8).view(torch.uint8)], 1), len(weight))


def quantize_q4_0(weight: Tensor) -> Tensor:
    b = _blocks(weight)
    index = b.abs().argmax(dim=1, keepdim=True)
    d = torch.gather(b, 1, index) / -8
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc(b * inv + 8.5).clamp(0, 15)
    return _rows(torch.cat([_fp16_bytes(d), _pack_halves(q)], 1), len(weight))


def quantize_q4_1(weight: Tensor) -> Tensor:
    b = _blocks(weight)
    high, low = b.amax(dim=1, keepdim=True), b.amin(dim=1, keepdim=True)
    d = (high - low) / 15
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = torch.trunc((b - low) * inv + 0.5).clamp(0, 15)
    return _rows(torch.cat([_fp16_bytes(d), _fp16_bytes(low), _pack_halves(q)], 1), len(weight))


QUANTIZERS = {"Q8_0": quantize_q8_0, "Q4_0": quantize_q4_0, "Q4_1": quantize_q4_1}


def q8_0_from_int8(q: Tensor, scale: Tensor) -> Tensor:
    """mg int8 per-channel (q, scale [out]) → Q8_0 rows: each block d = its row's scale."""
    rows, cols = q.shape
    d = scale.float().repeat_interleave(cols // BLOCK)[:, None]
    qs = q.reshape(-1, BLOCK).view(torch.uint8)
    return _rows(torch.cat([_fp16_bytes(d), qs], 1), rows)


def q4_from_int4(q: Tensor, scale: Tensor, zero: Tensor) -> tuple[str, Tensor]:
    """mg int4 (q 0..15, scale and zero [out, in/g], g a multiple of 32) → Q4_0 rows when
    every zero point is 8 (symmetric), Q4_1 rows (m = −z·scale) otherwise."""
    rows, cols = q.shape
    per_group = cols // scale.shape[1] // BLOCK
    d = scale.float().repeat_interleave(per_group, dim=1).reshape(-1, 1)
    z = zero.float().repeat_interleave(per_group, dim=1).reshape(-1, 1)
    qs = _pack_halves(q.reshape(-1, BLOCK))
    if bool((zero == 8).all()):
        return "Q4_0", _rows(torch.cat([_fp16_bytes(d), qs], 1), rows)
    return "Q4_1", _rows(torch.cat([_fp16_bytes(d), _fp16_bytes(-z * d), qs], 1), rows)


# ---------------------------------------------------------------------------------- K-quants
#
# Super-blocks of QK_K = 256 inputs of one row (llama.cpp's ggml-common.h):
#   Q6_K  ql[128] (low 4 bits), qh[64] (high 2 bits), int8 scales[16] (one per 16 values),
#         fp16 d                                        w = d · scale · (q − 32), q 0..63
#   Q4_K  fp16 d, fp16 dmin, scales[12] (6-bit scale and min of each 32 values, packed),
#         qs[128]                                      w = d · sc · q − dmin · m, q 0..15
#   Q5_K  Q4_K's header, qh[32] (the fifth bits), qs[128]            the same, q 0..31
# quantize_row_q{6,5,4}_K_ref of ggml-quants.c, operation for operation in
# float32 (sums accumulated in the C loops' order, no fused multiply-add), so the bytes are
# the reference's compiled without FMA contraction.

QK_K = 256
_GROUP_MAX_EPS = 1e-15


def _f32(value: float) -> Tensor:
    return torch.tensor(value, dtype=torch.float32)


def _make_qx_quants(x: Tensor, nmax: int) -> tuple[Tensor, Tensor]:
    """make_qx_quants(n, nmax, x, L, rmse_type=1, NULL) on each row of x [n, k] →
    (scale [n], L [n, k] in 0..2·nmax−1)."""
    n, k = x.shape
    index = x.abs().argmax(dim=1, keepdim=True)  # the first of the largest |x|, as the C loop
    top = torch.gather(x, 1, index).squeeze(1)
    empty = top.abs() < _GROUP_MAX_EPS
    top = torch.where(empty, torch.ones_like(top), top)
    w = x * x

    def attempt(iscale: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q = torch.round(iscale[:, None] * x).clamp(-nmax, nmax - 1)
        sumlx = torch.zeros(n, dtype=torch.float32)
        suml2 = torch.zeros(n, dtype=torch.float32)
        for i in range(k):
            sumlx = sumlx + w[:, i] * x[:, i] * q[:, i]
            suml2 = suml2 + w[:, i] * q[:, i] * q[:, i]
        return q, sumlx, suml2

    levels, sumlx, suml2 = attempt(_f32(-nmax) / top)
    scale = torch.where(suml2 != 0, sumlx / suml2, torch.zeros_like(sumlx))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        numerator = _f32(nmax) + _f32(0.1) * _f32(step)
        q, sx, s2 = attempt(-numerator / top)
        better = (s2 > 0) & (sx * sx > best * s2)
        levels = torch.where(better[:, None], q, levels)
        scale = torch.where(better, sx / s2, scale)
        best = torch.where(better, scale * sx, best)
    levels = torch.where(empty[:, None], torch.zeros_like(levels), levels + nmax)
    return torch.where(empty, torch.zeros_like(scale), scale), levels


def _make_qkx2_quants(
    x: Tensor, weights: Tensor, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[Tensor, Tensor, Tensor]:
    """make_qkx2_quants(n, nmax, x, weights, L, &the_min, Laux, rmin, rdelta, nstep,
    use_mad=false) on each row of x [n, k] → (scale [n], the_min [n], L [n, k] in 0..nmax)."""
    n, k = x.shape
    low, high = x[:, 0].clone(), x[:, 0].clone()
    sum_w = weights[:, 0].clone()
    sum_x = sum_w * x[:, 0]
    for i in range(1, k):
        low = torch.minimum(low, x[:, i])
        high = torch.maximum(high, x[:, i])
        sum_w = sum_w + weights[:, i]
        sum_x = sum_x + weights[:, i] * x[:, i]
    low = torch.where(low > 0, torch.zeros_like(low), low)
    flat = high == low
    span = torch.where(flat, torch.ones_like(high), high - low)
    iscale = _f32(nmax) / span
    scale = 1 / iscale
    levels = torch.round(iscale[:, None] * (x - low[:, None])).clamp(0, nmax)
    best_error = torch.zeros(n, dtype=torch.float32)
    for i in range(k):
        diff = scale * levels[:, i] + low - x[:, i]
        best_error = best_error + weights[:, i] * (diff * diff)
    for step in range(nstep + 1):
        # the C loop reads `min` as it goes: an accepted step moves the next steps' origin
        span = torch.where(flat, torch.ones_like(high), high - low)
        iscale = (_f32(rmin) + _f32(rdelta) * _f32(step) + _f32(nmax)) / span
        aux = torch.round(iscale[:, None] * (x - low[:, None])).clamp(0, nmax)
        sum_l = torch.zeros(n, dtype=torch.float32)
        sum_l2 = torch.zeros(n, dtype=torch.float32)
        sum_xl = torch.zeros(n, dtype=torch.float32)
        for i in range(k):
            wl = weights[:, i] * aux[:, i]
            sum_l = sum_l + wl
            sum_l2 = sum_l2 + wl * aux[:, i]
            sum_xl = sum_xl + wl * x[:, i]
        det = sum_w * sum_l2 - sum_l * sum_l
        safe = torch.where(det > 0, det, torch.ones_like(det))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        positive = this_min > 0
        this_min = torch.where(positive, torch.zeros_like(this_min), this_min)
        this_scale = torch.where(positive, sum_xl / sum_l2, this_scale)
        error = torch.zeros(n, dtype=torch.float32)
        for i in range(k):
            diff = this_scale * aux[:, i] + this_min - x[:, i]
            error = error + weights[:, i] * (diff * diff)
        better = (det > 0) & (error < best_error) & ~flat
        levels = torch.where(better[:, None], aux, levels)
        best_error = torch.where(better, error, best_error)
        scale = torch.where(better, this_scale, scale)
        low = torch.where(better, this_min, low)
    levels = torch.where(flat[:, None], torch.zeros_like(levels), levels)
    scale = torch.where(flat, torch.zeros_like(scale), scale)
    return scale, -low, levels


def _k_blocks(weight: Tensor) -> Tensor:
    rows, cols = weight.shape
    if cols % QK_K:
        raise ValueError(f"K-quants need rows of a multiple of {QK_K} values, not {cols}")
    return weight.float().reshape(-1, QK_K)


def _fp16_round(x: Tensor) -> Tensor:
    return x.to(torch.float16).float()


def quantize_q6_k(weight: Tensor) -> Tensor:
    """[rows, cols] float → [rows, cols / 256 · 210] uint8 Q6_K super-blocks."""
    x = _k_blocks(weight)
    nb = len(x)
    scales, levels = _make_qx_quants(x.reshape(-1, 16), 32)
    scales, levels = scales.reshape(nb, 16), levels.reshape(nb, 16, 16)
    index = scales.abs().argmax(dim=1, keepdim=True)
    max_scale = torch.gather(scales, 1, index).squeeze(1)
    empty = max_scale.abs() < _GROUP_MAX_EPS
    iscale = _f32(-128.0) / torch.where(empty, torch.ones_like(max_scale), max_scale)
    d = (1 / iscale).to(torch.float16)
    sc = torch.round(iscale[:, None] * scales).clamp(max=127)
    dd = d.float()[:, None] * sc
    safe = torch.where(dd == 0, torch.ones_like(dd), dd)
    fresh = torch.round(x.reshape(nb, 16, 16) / safe[..., None]).clamp(-32, 31) + 32
    levels = torch.where((dd != 0)[..., None], fresh, levels).reshape(nb, QK_K).to(torch.uint8)
    ql, qh = [], []
    for j in (0, 128):
        a, b, c, e = (levels[:, j + 32 * t : j + 32 * (t + 1)] for t in range(4))
        ql += [(a & 0xF) | ((c & 0xF) << 4), (b & 0xF) | ((e & 0xF) << 4)]
        qh.append((a >> 4) | ((b >> 4) << 2) | ((c >> 4) << 4) | ((e >> 4) << 6))
    sc_bytes = sc.to(torch.int8).view(torch.uint8)
    blocks = torch.cat([*ql, *qh, sc_bytes, _fp16_bytes(d.float()[:, None])], dim=1)
    blocks[empty] = 0
    return _rows(blocks, len(weight))


def _scale_min_blocks(
    weight: Tensor, nmax: int, rmin: float, nstep: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Q4_K / Q5_K's common part: each 32 values' scale and min by make_qkx2_quants, those
    as 6-bit multiples of the super-block's fp16 d and dmin (packed in 12 bytes), and the
    levels 0..nmax re-quantized with them → (d, dmin, packed scales [nb, 12], levels
    [nb, 256])."""
    x = _k_blocks(weight)
    nb = len(x)
    sub = x.reshape(-1, 32)
    sum_x2 = torch.zeros(len(sub), dtype=torch.float32)
    for i in range(32):
        sum_x2 = sum_x2 + sub[:, i] * sub[:, i]
    av_x = torch.sqrt(sum_x2 / 32)
    weights = av_x[:, None] + sub.abs()
    scales, mins, levels = _make_qkx2_quants(sub, weights, nmax, rmin, 0.1, nstep)
    scales, mins, levels = scales.reshape(nb, 8), mins.reshape(nb, 8), levels.reshape(nb, 8, 32)
    zero = torch.zeros((), dtype=torch.float32)
    max_scale = torch.where(scales > 0, scales, zero).amax(dim=1)  # +0 when none is > 0
    max_min = torch.where(mins > 0, mins, zero).amax(dim=1)
    inv_scale = torch.where(max_scale > 0, _f32(63.0) / max_scale, torch.zeros_like(max_scale))
    inv_min = torch.where(max_min > 0, _f32(63.0) / max_min, torch.zeros_like(max_min))
    ls = (torch.round(inv_scale[:, None] * scales).to(torch.int64) & 0xFF).clamp(max=63)
    lm = (torch.round(inv_min[:, None] * mins).to(torch.int64) & 0xFF).clamp(max=63)
    packed = torch.zeros(nb, 12, dtype=torch.int64)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    d = (max_scale / 63).to(torch.float16)
    dmin = (max_min / 63).to(torch.float16)
    step = d.float()[:, None] * ls.float()
    offset = dmin.float()[:, None] * lm.float()
    safe = torch.where(step == 0, torch.ones_like(step), step)
    fresh = torch.round((x.reshape(nb, 8, 32) + offset[..., None]) / safe[..., None])
    fresh = fresh.clamp(0, nmax)
    levels = torch.where((step != 0)[..., None], fresh, levels).reshape(nb, QK_K).to(torch.uint8)
    return d, dmin, packed.to(torch.uint8), levels


def quantize_q4_k(weight: Tensor) -> Tensor:
    """[rows, cols] float → [rows, cols / 256 · 144] uint8 Q4_K super-blocks."""
    d, dmin, packed, levels = _scale_min_blocks(weight, 15, -1.0, 20)
    qs = [levels[:, j : j + 32] | (levels[:, j + 32 : j + 64] << 4) for j in range(0, QK_K, 64)]
    header = [_fp16_bytes(d.float()[:, None]), _fp16_bytes(dmin.float()[:, None]), packed]
    return _rows(torch.cat([*header, *qs], dim=1), len(weight))


def quantize_q5_k(weight: Tensor) -> Tensor:
    """[rows, cols] float → [rows, cols / 256 · 176] uint8 Q5_K super-blocks: Q4_K's
    layout with levels 0..31, their fifth bits in qh[32] (bit 2i / 2i+1 for the i-th
    pair of 32-value groups)."""
    d, dmin, packed, levels = _scale_min_blocks(weight, 31, -0.5, 15)
    qh = torch.zeros(len(levels), 32, dtype=torch.uint8)
    qs = []
    for pair, j in enumerate(range(0, QK_K, 64)):
        low, high = levels[:, j : j + 32], levels[:, j + 32 : j + 64]
        qh |= ((low >> 4) << (2 * pair)) | ((high >> 4) << (2 * pair + 1))
        qs.append((low & 0xF) | ((high & 0xF) << 4))
    header = [_fp16_bytes(d.float()[:, None]), _fp16_bytes(dmin.float()[:, None]), packed]
    return _rows(torch.cat([*header, qh, *qs], dim=1), len(weight))


QUANTIZERS.update(Q6_K=quantize_q6_k, Q5_K=quantize_q5_k, Q4_K=quantize_q4_k)
