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
