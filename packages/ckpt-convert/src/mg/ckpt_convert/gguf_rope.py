"""Llama 3.1-style RoPE scaling read back from a GGUF file's ``rope_freqs.weight``.

llama.cpp's converter does not store ``rope_scaling``'s four numbers; it stores the
factor each rotary frequency is divided by (``generate_extra_tensors`` in
convert_hf_to_gguf.py): 1 above the high-frequency cutoff, ``factor`` below the
low-frequency one, and between them ``1 / ((1 - s) / factor + s)`` with
``s = (original_max_position_embeddings / wavelength - low_freq_factor) /
(high_freq_factor - low_freq_factor)``.

``factor`` is the largest stored factor. ``s`` is linear in 1 / wavelength, so two
frequencies in the smooth band give the rest; scaling ``original_max_position_embeddings``
and both frequency factors by one constant gives the same frequencies, so
``low_freq_factor`` is fixed at 1 unless the usual (1, 4) fits. The recovered numbers are
accepted only if they reproduce every stored factor.
"""

from __future__ import annotations

import math

import numpy as np

_REL_TOL = 1e-5


def rope_factors(
    head_dim: int, base: float, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for these llama3 parameters (float64)."""
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def _fits(stored: np.ndarray, params: tuple[float, float, float, int], head_dim, base) -> bool:
    expected = rope_factors(head_dim, base, *params)
    return bool(np.allclose(stored, expected, rtol=_REL_TOL, atol=0))


def llama3_scaling(stored: np.ndarray, head_dim: int, base: float) -> dict | None:
    """``rope_scaling`` (transformers' llama3 form) that reproduces `stored`; an empty
    dict when every factor is 1 (no scaling); None when no llama3 parameters fit."""
    stored = np.asarray(stored, dtype=np.float64).reshape(-1)
    if stored.shape[0] != head_dim // 2 or not np.all(np.isfinite(stored)):
        return None
    if np.all(stored == 1.0):
        return {}
    factor = float(stored.max())
    candidates = []
    # the published Llama 3.1 / 3.2 settings scaled to any original context
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelengths = 2 * math.pi / freqs
    smooth_band = (stored > 1 + _REL_TOL) & (stored < factor * (1 - _REL_TOL))
    if smooth_band.sum() >= 2:
        inverse = 1 / stored[smooth_band]
        s = (inverse - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelengths[smooth_band], s, 1)
        if intercept < 0:
            high = 1 - 1 / intercept  # low = 1: s = (original / λ - 1) / (high - 1)
            original = slope * (high - 1)
            for low_value in (1.0, 2.0, 0.5):  # prefer the round spelling that fits
                candidates.append(
                    (
                        factor,
                        low_value,
                        round(float(high) * low_value, 4),
                        round(float(original) * low_value),
                    )
                )
    for original in (8192, 4096, 16384, 2048, 131072):
        candidates.append((factor, 1.0, 4.0, original))
    for params in candidates:
        if params[3] > 0 and params[2] > params[1] and _fits(stored, params, head_dim, base):
            factor, low, high, original = params
            return {
                "rope_type": "llama3",
                "factor": float(factor),
                "low_freq_factor": float(low),
                "high_freq_factor": float(high),
                "original_max_position_embeddings": int(original),
            }
    return None
