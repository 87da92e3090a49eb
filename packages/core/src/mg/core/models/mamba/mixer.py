"""The Mamba-2 mixer: what a Mamba layer does in place of attention.

    zxBCdt = in_proj(hidden)                          one projection, split as
        z [d_inner] | x [d_inner] | B [G·N] | C [G·N] | dt [heads]
    x, B, C = silu(conv1d(x, B, C))                   depthwise, causal, width d_conv
    dt = softplus(dt + dt_bias);  A = -exp(A_log)    (dt >= mamba_dt_clamp_min)
    y = SSD(x, dt, A, B, C) + D · x                   ssd.py
    y = rmsnorm_per_group(y · silu(z)) · norm.weight  gated RMSNorm, norm after gate
    out = out_proj(y)

Parameter names and layouts are megatron-core 0.16.1's `MambaMixer` (and
transformers' `Mamba2Mixer`, which uses the same ones): `in_proj.weight`
rows in the order z, x, B, C, dt; `conv1d.weight` [x | B | C channels, 1,
d_conv]; `dt_bias`, `A_log`, `D` one per head; `norm.weight` [d_inner];
`out_proj.weight`. Megatron has no biases on the projections (it asserts
`bias=False`) and a bias on the convolution.

With an inference state the mixer continues each row's sequence from its
stored convolution window and SSM state instead of from zeros, and leaves the
state after the row's last real token behind (padding positions past a row's
length have dt = 0, which leaves the state unchanged).

Under tensor parallelism (applied from outside: mg.core.parallel.tensor_parallel_mamba)
each rank runs this for its own heads and groups: the counts are set to the local ones,
in_proj/out_proj communicate, and `local()` reads this rank's shard of the others.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mg.core.models.local_tensor import local
from mg.core.models.mamba.config import MambaConfig
from mg.core.models.mamba.ssd import ssd_chunked_scan, ssd_step

# MambaMixer's initialisation constants (megatron-core 0.16.1, also mamba_ssm's).
DT_MIN, DT_MAX, DT_INIT_FLOOR = 0.001, 0.1, 1e-4
A_INIT_RANGE = (1.0, 16.0)


class GatedRMSNorm(nn.Module):
    """RMSNorm of y · silu(z), taken over each group's channels separately.

    mamba_ssm's `RMSNormGated(norm_before_gate=False, group_size=d_inner / groups)`:
    per group, so that tensor parallelism (which splits whole groups) leaves each
    rank's norm complete."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, y: Tensor, z: Tensor) -> Tensor:
        dtype = y.dtype
        y = y.float() * F.silu(z.float())
        grouped = y.unflatten(-1, (-1, self.group_size))
        grouped = grouped * torch.rsqrt(grouped.square().mean(-1, keepdim=True) + self.eps)
        return local(self.weight) * grouped.flatten(-2).to(dtype)


class MambaMixer(nn.Module):
    """in_proj → causal conv1d → SSD scan → gated RMSNorm → out_proj; [b, s, h] → [b, s, h]."""

    def __init__(self, config: MambaConfig, layer_number: int) -> None:
        super().__init__()
        self.layer_number = layer_number
        self.hidden_size = config.hidden_size
        self.num_heads = config.mamba_num_heads
        self.head_dim = config.mamba_head_dim
        self.num_groups = config.mamba_num_groups
        self.state_dim = config.mamba_state_dim
        self.d_conv = config.mamba_conv_kernel
        self.chunk_size = config.mamba_chunk_size
        self.dt_clamp_min = config.mamba_dt_clamp_min
        self.d_inner = self.num_heads * self.head_dim
        self.conv_dim = self.d_inner + 2 * self.num_groups * self.state_dim
        self.in_proj = nn.Linear(
            config.hidden_size, self.d_inner + self.conv_dim + self.num_heads, bias=False
        )
        self.conv1d = nn.Conv1d(
            self.conv_dim,
            self.conv_dim,
            kernel_size=self.d_conv,
            groups=self.conv_dim,
            padding=self.d_conv - 1,
            bias=True,
        )
        self.dt_bias = nn.Parameter(torch.empty(self.num_heads))
        self.A_log = nn.Parameter(torch.empty(self.num_heads))
        self.D = nn.Parameter(torch.empty(self.num_heads))
        self.norm = GatedRMSNorm(
            self.d_inner, self.d_inner // self.num_groups, eps=config.layernorm_epsilon
        )
        self.out_proj = nn.Linear(self.d_inner, config.hidden_size, bias=False)
        self.chunk_scan = ssd_chunked_scan
        """The whole-sequence scan; `kernels.use_mamba_ssm_kernels` swaps in mamba_ssm's."""

    def init_weights(self, std: float, output_std: float) -> None:
        """MambaMixer's init: in_proj N(0, σ), out_proj N(0, σ_out), conv weight
        kaiming-uniform(√5) and bias U(±1/√d_conv) (PyTorch's Conv1d defaults),
        dt_bias = softplus⁻¹(dt) with dt log-uniform in [0.001, 0.1] (floor 1e-4),
        A_log = log U(1, 16), D = 1, norm weight 1."""
        nn.init.normal_(self.in_proj.weight, mean=0.0, std=std)
        nn.init.normal_(self.out_proj.weight, mean=0.0, std=output_std)
        self.conv1d.reset_parameters()
        dt = torch.exp(
            torch.rand_like(self.dt_bias) * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)
        ).clamp(min=DT_INIT_FLOOR)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus
        self.A_log.copy_(torch.log(torch.empty_like(self.A_log).uniform_(*A_INIT_RANGE)))
        nn.init.ones_(self.D)
        self.norm.reset_parameters()

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per sequence: the convolution window [conv_dim, d_conv - 1] (the last inputs
        the next token's convolution reads) and the SSM state [heads, P, N]."""
        return (self.conv_dim, self.d_conv - 1), (self.num_heads, self.head_dim, self.state_dim)

    def forward(self, hidden: Tensor, inference_cache=None) -> Tensor:
        """hidden [b, s, h] → [b, s, h]. `inference_cache` (a bound `HybridCache`)
        continues each row from its stored state and stores the new one."""
        zxBCdt = self.in_proj(hidden)  # under sequence parallelism: the whole sequence
        b, s, _ = zxBCdt.shape
        z, xBC, dt = zxBCdt.split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        # local(): a tensor-parallel rank's heads (mg.core.parallel.tensor_parallel_mamba)
        dt = F.softplus(dt + local(self.dt_bias))
        if self.dt_clamp_min > 0.0:
            dt = dt.clamp(min=self.dt_clamp_min)
        A = -torch.exp(local(self.A_log).float())
        conv_weight, conv_bias = local(self.conv1d.weight), local(self.conv1d.bias)

        layer = self.layer_number - 1
        if inference_cache is None:
            xBC = F.conv1d(
                xBC.transpose(1, 2),
                conv_weight,
                conv_bias,
                padding=self.d_conv - 1,
                groups=self.conv_dim,
            )[..., :s]
            conv_state = ssm_state = None
        else:
            conv_state, ssm_state = inference_cache.mamba_state(layer)
            lengths = inference_cache.lengths(b, s)
            padded = torch.cat([conv_state.to(xBC.dtype), xBC.transpose(1, 2)], dim=-1)
            xBC = F.conv1d(padded, conv_weight, conv_bias, groups=self.conv_dim)
            # the window after each row's last real token: inputs lengths .. lengths + d_conv-2
            window = lengths[:, None] + torch.arange(self.d_conv - 1, device=hidden.device)
            conv_state = padded.gather(2, window[:, None, :].expand(b, self.conv_dim, -1))
            # padding past a row's length must not move its state: dt = 0 there
            real = torch.arange(s, device=hidden.device)[None, :] < lengths[:, None]
            dt = dt * real[..., None]
        x, B, C = (
            F.silu(xBC)
            .transpose(1, 2)
            .split(
                [self.d_inner, self.num_groups * self.state_dim, self.num_groups * self.state_dim],
                dim=-1,
            )
        )
        x = x.unflatten(-1, (self.num_heads, self.head_dim))
        B = B.unflatten(-1, (self.num_groups, self.state_dim))
        C = C.unflatten(-1, (self.num_groups, self.state_dim))

        D = local(self.D)
        if ssm_state is not None and s == 1:  # a decoding step: the recurrence itself
            y, ssm_state = ssd_step(ssm_state, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D)
            y = y[:, None]
        else:
            y, ssm_state = self.chunk_scan(
                x, dt, A, B, C, self.chunk_size, D=D, initial_state=ssm_state
            )
        if inference_cache is not None:
            inference_cache.store_mamba_state(layer, conv_state, ssm_state)
        y = self.norm(y.flatten(-2), z)
        return self.out_proj(y)
