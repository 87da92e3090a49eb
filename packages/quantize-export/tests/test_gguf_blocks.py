"""Our Q8_0 / Q4_0 / Q4_1 blocks are byte-identical to gguf.quants.quantize, and mg's
int8 / int4 weights re-labelled as blocks dequantize (gguf.quants.dequantize) to mg's
dequantized weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from mg.core.quantization.primitives import (
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8_per_channel,
)
from mg.quantize_export.gguf_blocks import QUANTIZERS, q4_from_int4, q8_0_from_int8


def _weights() -> torch.Tensor:
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(0)) * 0.05
    w[0] = 0  # an all-zero block row
    w[1, :32] = torch.linspace(-1, 1, 32)  # ties on the rounding boundaries
    w[2, :32] = 0.5
    return w


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_blocks_are_byte_identical_to_gguf(name: str) -> None:
    w = _weights()
    ours = QUANTIZERS[name](w).numpy()
    theirs = quantize(w.numpy(), GGMLQuantizationType[name])
    assert ours.dtype == theirs.dtype == np.uint8
    assert ours.shape == theirs.shape
    assert np.array_equal(ours, theirs)


def test_int8_relabelled_as_q8_0_dequantizes_to_ours() -> None:
    q, scale = quantize_int8_per_channel(_weights()[1:])
    theirs = dequantize(q8_0_from_int8(q, scale).numpy(), GGMLQuantizationType.Q8_0)
    ours = dequantize_int8(q, scale).numpy()
    # equal up to the fp16 rounding of the scale
    assert np.allclose(theirs, ours, rtol=1e-3, atol=0)


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_relabelled_as_q4_dequantizes_to_ours(group: int, symmetric: bool) -> None:
    q, scale, zero = quantize_int4(_weights()[1:], group, symmetric)
    kind, blocks = q4_from_int4(q, scale, zero)
    assert kind == ("Q4_0" if symmetric else "Q4_1")
    theirs = dequantize(blocks.numpy(), GGMLQuantizationType[kind])
    ours = dequantize_int4(q, scale, zero).numpy()
    # equal up to the fp16 rounding of d (and of m = -z * d, a term of its own in Q4_1)
    s = scale.repeat_interleave(group, 1)
    bound = 2**-10 * (q.float() * s + zero.float().repeat_interleave(group, 1) * s)
    assert (np.abs(theirs - ours) <= bound.numpy() + 1e-8).all()
