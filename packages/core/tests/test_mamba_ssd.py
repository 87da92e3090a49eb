"""The chunked SSD scan against the recurrence written one token at a time.

Forward and gradients of every input (x, dt, A, B, C, D, the initial state),
chunk sizes that do and do not divide the sequence, in fp64 (to rounding) and
fp32 (stated tolerance), plus hand-computed values for the pieces.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from mg.core.models.mamba.ssd import (
    ssd_chunked_scan,
    ssd_sequential_scan,
    ssd_step,
)


def _inputs(dtype, b=2, length=37, heads=6, p=4, groups=2, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, length, heads, p, generator=g, dtype=dtype)
    dt = F.softplus(torch.randn(b, length, heads, generator=g, dtype=dtype))
    A = -torch.rand(heads, generator=g, dtype=dtype) * 4 - 0.1
    B = torch.randn(b, length, groups, n, generator=g, dtype=dtype)
    C = torch.randn(b, length, groups, n, generator=g, dtype=dtype)
    D = torch.randn(heads, generator=g, dtype=dtype)
    state = torch.randn(b, heads, p, n, generator=g, dtype=dtype)
    return x, dt, A, B, C, D, state


def test_one_step_by_hand():
    # one head of P = 1, N = 2, one group: state = e^{dt·A}·s + dt·x·B, y = C·state + D·x
    state = torch.tensor([[[[1.0, 2.0]]]])
    x, dt, A = torch.tensor([[[3.0]]]), torch.tensor([[0.5]]), torch.tensor([-2.0])
    B, C, D = torch.tensor([[[1.0, -1.0]]]), torch.tensor([[[2.0, 1.0]]]), torch.tensor([0.25])
    y, new = ssd_step(state, x, dt, A, B, C, D)
    decay = math.exp(-1.0)
    s = [decay * 1 + 0.5 * 3 * 1, decay * 2 + 0.5 * 3 * -1]
    assert new.flatten().tolist() == pytest.approx(s)
    assert y.item() == pytest.approx(2 * s[0] + 1 * s[1] + 0.25 * 3)


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 16, 64])
def test_chunked_equals_sequential_fp64(chunk_size):
    x, dt, A, B, C, D, state = _inputs(torch.float64)
    ref_y, ref_state = ssd_sequential_scan(x, dt, A, B, C, D, state)
    y, final = ssd_chunked_scan(x, dt, A, B, C, chunk_size, D=D, initial_state=state)
    torch.testing.assert_close(y, ref_y, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, ref_state, rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunk_size,length", [(8, 37), (16, 16), (32, 5), (5, 64)])
def test_gradients_equal_sequential(chunk_size, length):
    """fp32, a sequence not divisible by the chunk; all seven inputs' gradients within 1e-4."""
    inputs = [t.requires_grad_() for t in _inputs(torch.float32, length=length)]
    x, dt, A, B, C, D, state = inputs
    g = torch.Generator().manual_seed(1)
    weight_y = torch.randn(x.shape, generator=g)
    weight_s = torch.randn(state.shape, generator=g)

    def loss(y, s):
        return (y * weight_y).sum() + (s * weight_s).sum()

    ref = torch.autograd.grad(loss(*ssd_sequential_scan(x, dt, A, B, C, D, state)), inputs)
    out = ssd_chunked_scan(x, dt, A, B, C, chunk_size, D=D, initial_state=state)
    got = torch.autograd.grad(loss(*out), inputs)
    for name, a, b in zip(["x", "dt", "A", "B", "C", "D", "state"], got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)


def test_fp32_forward_tolerance_and_no_initial_state():
    x, dt, A, B, C, D, _ = _inputs(torch.float32, length=100)
    ref_y, ref_state = ssd_sequential_scan(x, dt, A, B, C, D)
    y, final = ssd_chunked_scan(x, dt, A, B, C, 32, D=D)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, ref_state, rtol=1e-5, atol=1e-5)


def test_bf16_inputs_scan_in_fp32():
    x, dt, A, B, C, D, _ = _inputs(torch.float32, length=20)
    y32, _ = ssd_chunked_scan(x, dt, A, B, C, 8, D=D)
    y16, state = ssd_chunked_scan(*(t.bfloat16() for t in (x, dt, A, B, C)), 8, D=D)
    assert y16.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(y16.float(), y32, rtol=0.05, atol=0.1)


def test_split_sequence_continues_from_final_state():
    """Scanning [0, 20) then [20, 37) from the carried state equals one scan of [0, 37)."""
    x, dt, A, B, C, D, _ = _inputs(torch.float64)
    whole, whole_state = ssd_chunked_scan(x, dt, A, B, C, 8, D=D)
    first, state = ssd_chunked_scan(x[:, :20], dt[:, :20], A, B[:, :20], C[:, :20], 8, D=D)
    second, final = ssd_chunked_scan(
        x[:, 20:], dt[:, 20:], A, B[:, 20:], C[:, 20:], 8, D=D, initial_state=state
    )
    torch.testing.assert_close(torch.cat([first, second], 1), whole, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, whole_state, rtol=0, atol=1e-12)
