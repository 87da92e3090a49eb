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
differs from transformers' torch fallback where that matters for speed: C·Bᵀ is
formed once per *group*, not once per head (B and C are never repeated to the
heads); every matmul has its batch dims leading, so no [chunk, chunk] matrix is
copied into another layout; and the recurrence over chunk boundaries is a loop
of c steps, not a [c, c] decay matrix. `ssd_sequential_scan` is the recurrence
written literally, one token at a time (the reference the tests hold the chunked
scan to), and `ssd_step` is one token of it (decoding).

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

    # Layout [b, c, g, r, l, ...]: c chunk, g group, r head in the group, l/s position in
    # the chunk; the batch dims of every matmul below lead, so no large tensor is copied.
    xdt = (x * dt[..., None]).view(b, c, cs, groups, r, p).permute(0, 1, 3, 4, 2, 5)
    a_cum = torch.cumsum((dt * A).view(b, c, cs, groups, r).permute(0, 1, 3, 4, 2), dim=-1)
    Bc = B.view(b, c, cs, groups, n).transpose(2, 3)  # [b, c, g, l, n]
    Cc = C.view(b, c, cs, groups, n).transpose(2, 3)

    # 1. Within each chunk: y_l = Σ_{s≤l} (C_l·B_s) exp(a_{s+1}+…+a_l) dt_s x_s. The decay is
    # a difference of cumulative sums inside one chunk, in the working precision, as
    # mamba_ssm's chunk-scan kernel computes it.
    scores = Cc @ Bc.transpose(-1, -2)  # [b, c, g, l, s], once per group, not per head
    causal = torch.ones(cs, cs, dtype=torch.bool, device=x.device).tril()
    decay = (a_cum[..., :, None] - a_cum[..., None, :]).masked_fill(~causal, float("-inf"))
    weights = decay.exp() * scores[:, :, :, None]  # [b, c, g, r, l, s]
    y = weights @ xdt  # [b, c, g, r, l, p]

    # 2. Each chunk's contribution to the state at its end: Σ_l exp(a_{l+1}+…) B_l ⊗ dt_l x_l.
    to_end = torch.exp(a_cum[..., -1:] - a_cum)[..., None]  # [b, c, g, r, l, 1]
    states = Bc.transpose(-1, -2)[:, :, :, None] @ (xdt * to_end)  # [b, c, g, r, n, p]

    # 3. The state entering each chunk: the recurrence over chunk boundaries, c steps.
    chunk_decay = torch.exp(a_cum[..., -1])[..., None, None]  # [b, c, g, r, 1, 1]
    if initial_state is None:
        state = states.new_zeros(b, groups, r, n, p)
    else:
        state = initial_state.to(work).view(b, groups, r, p, n).transpose(-1, -2)
    entering = []
    for k in range(c):
        entering.append(state)
        state = state * chunk_decay[:, k] + states[:, k]
    entering = torch.stack(entering, dim=1)  # [b, c, g, r, n, p]

    # 4. What the entering state adds at each position: exp(a_1+…+a_l) C_l · state.
    y = y + (Cc[:, :, :, None] @ entering) * torch.exp(a_cum)[..., None]

    y = y.permute(0, 1, 4, 2, 3, 5).reshape(b, c * cs, heads, p)[:, :length]
    if D is not None:
        y = y + x[:, :length] * D.to(work)[:, None]
    final = state.transpose(-1, -2).reshape(b, heads, p, n)
    return y.to(dtype), final


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
