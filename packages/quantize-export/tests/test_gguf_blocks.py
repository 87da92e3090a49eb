"""Our Q8_0 / Q4_0 / Q4_1 blocks are byte-identical to gguf.quants.quantize, our Q4_K /
Q5_K / Q6_K super-blocks to llama.cpp's reference quantizer (recorded bytes), and mg's int8 /
int4 weights re-labelled as blocks dequantize (gguf.quants.dequantize) to mg's
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


def _k_weights() -> torch.Tensor:
    """Exact float32 inputs (multiples of 1/256 and their cubes): no platform-dependent RNG."""
    k = torch.arange(8 * 512)
    w = ((k * 7919 % 1000 - 500) / 256.0).float().reshape(8, 512)
    w = torch.cat([w, w * w * w / 8])
    w[3, :256] = 0  # an all-zero super-block
    w[5, 300] = 40.0  # an outlier
    return w


# sha256 of the bytes of llama.cpp's quantize_row_q{6,5,4}_K_ref
# (ggml/src/ggml-quants.c of the llama.cpp vendored in llama-cpp-python 0.3.36, compiled
# with gcc -O1 -ffp-contract=off and called through ctypes) on _k_weights().
K_QUANT_REFERENCE = {
    "Q6_K": "c839874217212949bde02bf18031e1d8b02f9f9fac09a00b0ddc0089906b4aa9",
    "Q4_K": "86461b406e8b8ecb5f1182d5c2c40fc0fd6b865764942f0b322db7f3e1708bc0",
    "Q5_K": "42308e6cbc068aad00340f7b91044a9ba2831069e37b9d9db763016ad4342a94",
}


@pytest.mark.parametrize("name, bound", [("Q6_K", 0.03), ("Q5_K", 0.04), ("Q4_K", 0.08)])
def test_k_quants_match_llama_cpp_reference_bytes(name: str, bound: float) -> None:
    import hashlib

    w = _k_weights()
    blocks = QUANTIZERS[name](w)
    size = {"Q6_K": 210, "Q5_K": 176, "Q4_K": 144}[name]
    assert blocks.shape == (16, 2 * size) and blocks.dtype == torch.uint8
    assert hashlib.sha256(blocks.numpy().tobytes()).hexdigest() == K_QUANT_REFERENCE[name]
    # and gguf's own reader of the format gives back the weights (the all-zero block exactly)
    back = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType[name]).copy())
    assert back.shape == w.shape
    assert torch.equal(back[3, :256], torch.zeros(256))
    assert float((back - w).norm() / w.norm()) < bound
