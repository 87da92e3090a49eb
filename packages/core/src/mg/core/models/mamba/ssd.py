"""The Mamba-2 state-space recurrence (SSD), chunked for training and stepwise for decoding.

Per head h (P channels) with a state of N entries per channel and a scalar decay:

    state_t = exp(dt_t · A_h) · state_{t-1} + dt_t · x_t ⊗ B_t     [P, N]
    y_t     = state_t · C_t + D_h · x_t                            [P]

B and C are shared by the heads of a group (heads = groups · r, head h uses group
h // r, the order of `repeat_interleave` in mamba_ssm and transformers).

`ssd_chunked_scan` computes this for a whole sequence the way the SSD paper's
Listing 1 (`ssd_minimal_discrete`) does: inside each chunk the recurrence is a
masked, decay-weighted attention (quadratic in the chunk, matmuls only), and a
short recurrence over chunk boundaries carries the state between chunks. It
differs from transformers' torch fallback in one respect that matters for speed:
C·Bᵀ is formed once per *group*, not once per head, and B, C are never repeated
to the heads. `ssd_sequential_scan` is the recurrence written literally, one
token at a time (the reference the tests hold the chunked scan to), and
`ssd_step` is one token of it (decoding).

Shapes: x [b, l, heads, P], dt [b, l, heads] (after softplus), A [heads]
(negative), B and C [b, l, groups, N], D [heads], state [b, heads, P, N]. The
scan runs in fp32 for bf16/fp16 inputs, as mamba_ssm's kernels do (fp64 stays fp64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def _work_dtype(x: Tensor) -> torch.dtype:
    """fp32 for half-precision inputs (as mamba_ssm's kernels), else the input's own."""
    return torch.promote_types(x.dtype, torch.float32)


def segment_sum(a: Tensor) -> Tensor:
    """[..., T] → [..., T, T] with out[i, j] = a[j+1] + … + a[i] for j ≤ i, −inf above.

    Summed from masked copies rather than as cumsum[i] − cumsum[j], which would
    lose precision to cancellation when the decays over a chunk are large."""
    t = a.shape[-1]
    a = a[..., None].expand(*a.shape, t)  # [..., i, j] = a[i]
    strictly_lower = torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=-1)
    sums = torch.cumsum(a.masked_fill(~strictly_lower, 0.0), dim=-2)
    lower = torch.tril(torch.ones(t, t, dtype=torch.bool, device=a.device), diagonal=0)
    return sums.masked_fill(~lower, float("-inf"))


def ssd_chunked_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The SSD recurrence over a whole sequence → (y [b, l, heads, P], final state).

    Any length: the sequence is zero-padded to a multiple of `chunk_size` (a padded
    step has dt = 0, which leaves the state unchanged), and the padding is cut off."""
    b, length, heads, p = x.shape
    groups, n = B.shape[2], B.shape[3]
    if heads % groups:
        raise ValueError(f"{heads} heads do not divide into {groups} groups")
    r = heads // groups
    dtype, work = x.dtype, _work_dtype(x)
    x, dt, A, B, C = (t.to(work) for t in (x, dt, A, B, C))
    chunk_size = min(chunk_size, length)  # a short prefill is one chunk, unpadded
    pad = (-length) % chunk_size
    if pad:
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        dt = F.pad(dt, (0, 0, 0, pad))
        B = F.pad(B, (0, 0, 0, 0, 0, pad))
        C = F.pad(C, (0, 0, 0, 0, 0, pad))
    c = (length + pad) // chunk_size
    cs = chunk_size

    # Chunked layouts: c = chunk, l/s = position in it, g = group, r = head in group.
    xdt = (x * dt[..., None]).view(b, c, cs, groups, r, p)
    a = (dt * A).view(b, c, cs, heads).permute(0, 3, 1, 2)  # [b, heads, c, cs]
    a_cum = torch.cumsum(a, dim=-1)
    Bc = B.view(b, c, cs, groups, n)
    Cc = C.view(b, c, cs, groups, n)

    # 1. Within each chunk: y_l = Σ_{s≤l} (C_l·B_s) exp(a_{s+1}+…+a_l) dt_s x_s.
    decay = torch.exp(segment_sum(a)).view(b, groups, r, c, cs, cs)
    scores = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)  # once per group
    weights = scores[:, :, None] * decay  # [b, g, r, c, l, s]
    y = torch.einsum("bgrcls,bcsgrp->bclgrp", weights, xdt)

    # 2. Each chunk's contribution to the state at its end.
    to_end = torch.exp(a_cum[..., -1:] - a_cum).view(b, groups, r, c, cs)
    states = torch.einsum("bclgn,bgrcl,bclgrp->bcgrpn", Bc, to_end, xdt)

    # 3. The state entering each chunk: a recurrence over chunk boundaries.
    if initial_state is None:
        first = states.new_zeros(b, 1, groups, r, p, n)
    else:
        first = initial_state.to(work).view(b, 1, groups, r, p, n)
    states = torch.cat([first, states], dim=1)  # [b, c+1, g, r, p, n]
    chunk_decay = torch.exp(segment_sum(F.pad(a_cum[..., -1], (1, 0))))  # [b, h, c+1, c+1]
    chunk_decay = chunk_decay.view(b, groups, r, c + 1, c + 1)
    states = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, states)
    entering, final = states[:, :-1], states[:, -1]

    # 4. What the entering state adds to each position: C_l · state · exp(a_1+…+a_l).
    from_start = torch.exp(a_cum).view(b, groups, r, c, cs)
    y = y + torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", Cc, entering, from_start)

    y = y.reshape(b, c * cs, heads, p)[:, :length]
    if D is not None:
        y = y + x[:, :length] * D.to(work)[:, None]
    return y.to(dtype), final.reshape(b, heads, p, n)


def ssd_step(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """One token: state [b, heads, P, N], x [b, heads, P], dt [b, heads], B/C [b, groups, N]
    → (y [b, heads, P], the new state)."""
    heads, groups = x.shape[1], B.shape[1]
    dtype, work = x.dtype, _work_dtype(x)
    x, dt = x.to(work), dt.to(work)
    B = B.to(work).repeat_interleave(heads // groups, dim=1)  # [b, heads, N]
    C = C.to(work).repeat_interleave(heads // groups, dim=1)
    decay = torch.exp(dt * A.to(work))[..., None, None]
    state = state.to(work) * decay + (dt[..., None] * x)[..., None] * B[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", state, C)
    if D is not None:
        y = y + x * D.to(work)[:, None]
    return y.to(dtype), state


def ssd_sequential_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    initial_state: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The recurrence one token at a time: slow, and obviously right (the reference)."""
    b, length, heads, p = x.shape
    n = B.shape[-1]
    state = (
        x.new_zeros(b, heads, p, n, dtype=_work_dtype(x))
        if initial_state is None
        else initial_state
    )
    ys = []
    for t in range(length):
        y, state = ssd_step(state, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        ys.append(y)
    return torch.stack(ys, dim=1), state
