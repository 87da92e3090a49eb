"""A stand-in `transformer_engine` package for CPU tests of the code that drives TE.

Plain PyTorch modules with Transformer Engine's constructor arguments, parameter
names and `_extra_state` (`LayerNormLinear`, `Linear`, `DotProductAttention`) and
TE's tensor- and context-parallel semantics (local shard shapes, the collectives a
column or row module runs, sequence parallelism along the first dimension,
context-parallel attention over the load-balanced chunks; gloo collectives),
`fp8_autocast` / `fp8_model_init` contexts that record how they were entered (the
recipe and the amax-reduction group), and
the `common.recipe` classes recording their arguments. `install(monkeypatch)` puts it
in `sys.modules` and makes CUDA look present, so mg's checks pass and its TE paths
run on the CPU; the real package is exercised by the GPU tests.
"""

from __future__ import annotations

import contextlib
import io
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mg.core.models import attention_backend


class _Extra:
    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """TE's contract (TransformerEngineBaseModule.set_extra_state): None, the uint8
        tensor `get_extra_state` gave, or a BytesIO of an older checkpoint; else it raises."""
        if state is not None and not isinstance(state, torch.Tensor | io.BytesIO):
            raise RuntimeError(f"Unsupported checkpoint format: {type(state).__name__}")


# --- TE's tensor-parallel communication (its contract: sequence-parallel tensors are
# split along their first dimension, [s, b, h]); gloo-friendly, CPU tests only ---------


def _gather0(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts)


def _scatter0(x, group):
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)
    return total.chunk(dist.get_world_size(group))[dist.get_rank(group)].contiguous()


def _summed(x, group):
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


class _Comm(torch.autograd.Function):
    """forward(x) then backward(grad), each one of the functions above (or identity)."""

    @staticmethod
    def forward(ctx, x, group, fwd, bwd):
        ctx.group, ctx.bwd = group, bwd
        return fwd(x, group) if fwd is not None else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.bwd(grad, ctx.group) if ctx.bwd is not None else grad), None, None, None


class _Parallel:
    """TE's parallelism arguments: this rank's shard sizes and the collectives to run."""

    def _parallel_init(self, tp_group, tp_size, parallel_mode, sequence_parallel):
        assert parallel_mode in (None, "column", "row"), parallel_mode
        self.tp_group, self.parallel_mode, self.sequence_parallel = (
            tp_group, parallel_mode, sequence_parallel,
        )  # fmt: skip
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else tp_size
        RECORDER.parallel.append((type(self).__name__, parallel_mode, sequence_parallel))

    def _split(self, in_features, out_features):
        if self.parallel_mode == "column":
            return in_features, out_features // self.tp_size
        if self.parallel_mode == "row":
            return in_features // self.tp_size, out_features
        return in_features, out_features

    def _column_input(self, x):
        if self.parallel_mode != "column" or self.tp_size == 1:
            return x
        if self.sequence_parallel:  # all-gather the sequence; reduce-scatter the gradient
            return _Comm.apply(x, self.tp_group, _gather0, _scatter0)
        return _Comm.apply(x, self.tp_group, None, _summed)  # the gradient all-reduced

    def _row_output(self, y):
        if self.parallel_mode != "row" or self.tp_size == 1:
            return y
        if self.sequence_parallel:
            return _Comm.apply(y, self.tp_group, _scatter0, _gather0)
        return _Comm.apply(y, self.tp_group, _summed, None)


class LayerNormLinear(_Extra, _Parallel, nn.Module):
    def __init__(
        self, in_features, out_features, eps=1e-5, bias=True, normalization="LayerNorm",
        zero_centered_gamma=False, params_dtype=None, device="cuda", tp_group=None, tp_size=1,
        parallel_mode=None, sequence_parallel=False,
    ):  # fmt: skip
        super().__init__()
        self._parallel_init(tp_group, tp_size, parallel_mode, sequence_parallel)
        kw = dict(dtype=params_dtype, device=device)
        self.eps, self.normalization, self.zero = eps, normalization, zero_centered_gamma
        local_in, local_out = self._split(in_features, out_features)
        self.weight = nn.Parameter(torch.randn(local_out, local_in, **kw))
        self.bias = nn.Parameter(torch.randn(local_out, **kw)) if bias else None
        self.layer_norm_weight = nn.Parameter(torch.randn(in_features, **kw))
        self.layer_norm_bias = (
            nn.Parameter(torch.randn(in_features, **kw)) if normalization == "LayerNorm" else None
        )
        RECORDER.built.append(("LayerNormLinear", RECORDER.model_init))

    def forward(self, x):
        g = self.layer_norm_weight + 1 if self.zero else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            x = F.rms_norm(x, x.shape[-1:], g, self.eps)
        else:
            x = F.layer_norm(x, x.shape[-1:], g, self.layer_norm_bias, self.eps)
        return F.linear(self._column_input(x), self.weight, self.bias)


class Linear(_Extra, _Parallel, nn.Module):
    def __init__(
        self, in_features, out_features, bias=True, params_dtype=None, device="cuda",
        tp_group=None, tp_size=1, parallel_mode=None, sequence_parallel=False,
    ):  # fmt: skip
        super().__init__()
        self._parallel_init(tp_group, tp_size, parallel_mode, sequence_parallel)
        kw = dict(dtype=params_dtype, device=device)
        local_in, local_out = self._split(in_features, out_features)
        self.weight = nn.Parameter(torch.randn(local_out, local_in, **kw))
        self.bias = nn.Parameter(torch.randn(out_features, **kw)) if bias else None
        RECORDER.built.append(("Linear", RECORDER.model_init))

    def forward(self, x):
        if self.parallel_mode != "row":
            return F.linear(self._column_input(x), self.weight, self.bias)
        y = self._row_output(F.linear(x, self.weight))  # the bias once, after the reduction
        return y + self.bias if self.bias is not None else y


def _cp_positions(seq_local: int, rank: int, size: int) -> torch.Tensor:
    """Global positions of a cp rank's tokens: chunks r and 2C-1-r of 2C (TE's layout)."""
    chunk = seq_local // 2
    first = torch.arange(rank * chunk, (rank + 1) * chunk)
    second = (2 * size - 1 - rank) * chunk
    return torch.cat([first, torch.arange(second, second + chunk)])


def _gather_seq(x, group):  # [b, s_local, ...] -> [b, size * s_local, ...] in rank order
    # every rank's queries read the gathered block: the gradients are summed back to its owner
    return _Comm.apply(x.transpose(0, 1), group, _gather0, _scatter0).transpose(0, 1)


class DotProductAttention(_Extra, nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.kwargs = kwargs
        group = kwargs.get("tp_group")
        self.tp_size = dist.get_world_size(group) if group is not None else kwargs.get("tp_size", 1)
        self.cp_group = kwargs.get("cp_group")
        if self.cp_group is not None:
            assert kwargs["cp_global_ranks"] == dist.get_process_group_ranks(self.cp_group)
            assert "cp_stream" in kwargs and kwargs.get("cp_comm_type") == "p2p"

    def forward(self, q, k, v, attention_mask=None):
        assert q.is_contiguous() and attention_mask is None
        h, g = (self.kwargs[n] // self.tp_size for n in ("num_attention_heads", "num_gqa_groups"))
        assert (q.shape[2], k.shape[2]) == (h, g), "TE takes the whole model's head counts"
        channels = self.kwargs["kv_channels"]  # an int, or (key's, value's) as MLA gives it
        k_ch, v_ch = channels if isinstance(channels, tuple) else (channels, channels)
        assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (k_ch, k_ch, v_ch), "kv_channels"
        causal = self.kwargs["attn_mask_type"] == "causal"
        mask = None
        if self.cp_group is not None:  # keys/values of the whole sequence, a positional mask
            rank, size = dist.get_rank(self.cp_group), dist.get_world_size(self.cp_group)
            k, v = _gather_seq(k, self.cp_group), _gather_seq(v, self.cp_group)
            mine = _cp_positions(q.shape[1], rank, size)
            every = torch.cat([_cp_positions(q.shape[1], r, size) for r in range(size)])
            mask, causal = every[None, :] <= mine[:, None], False
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, scale=self.kwargs["softmax_scale"],
            enable_gqa=g != h,
        )  # fmt: skip
        return out.transpose(1, 2).flatten(2)


class Recipe:
    def __init__(self, **kwargs):
        self.kind, self.kwargs = type(self).__name__, kwargs


class Recorder:
    """What the code under test did with the stand-in: (module, built under
    fp8_model_init) per TE linear built, (enabled, recipe) per fp8_autocast entered and
    the `fp8_group` it was given (`fp8_groups`, in step with `autocasts`),
    (module, parallel_mode, sequence_parallel) per TE linear built."""

    built: list = []
    autocasts: list = []
    fp8_groups: list = []
    parallel: list = []
    model_init = False


RECORDER = Recorder()


@contextlib.contextmanager
def _fp8_autocast(enabled=True, fp8_recipe=None, fp8_group=None):
    RECORDER.autocasts.append((enabled, fp8_recipe))
    RECORDER.fp8_groups.append(fp8_group)
    yield


@contextlib.contextmanager
def _fp8_model_init(enabled=True, recipe=None):
    RECORDER.model_init = enabled
    try:
        yield
    finally:
        RECORDER.model_init = False


def install(monkeypatch: Any) -> Recorder:
    """`transformer_engine` (and .pytorch, .common.recipe) as the stand-in, CUDA 'present';
    returns the recorder (modules built, autocasts entered)."""
    RECORDER.built, RECORDER.autocasts, RECORDER.parallel = [], [], []
    RECORDER.fp8_groups = []
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
    for name in ("DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling"):
        setattr(recipe, name, type(name, (Recipe,), {}))
    recipe.MXFP8BlockScaling = type("MXFP8BlockScaling", (Recipe,), {})
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.LayerNormLinear, pytorch.Linear = LayerNormLinear, Linear
    pytorch.DotProductAttention = DotProductAttention
    pytorch.fp8_autocast, pytorch.fp8_model_init = _fp8_autocast, _fp8_model_init
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    root = types.ModuleType("transformer_engine")
    root.pytorch, root.common = pytorch, common
    for name, module in (
        ("transformer_engine", root),
        ("transformer_engine.pytorch", pytorch),
        ("transformer_engine.common", common),
        ("transformer_engine.common.recipe", recipe),
    ):
        monkeypatch.setitem(sys.modules, name, module)
    # CUDA 'present' for mg's checks only: torch itself still sees none
    monkeypatch.setattr(attention_backend, "cuda_available", lambda: True)
    for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
        # recorded first, so what mg's code sets is undone with the rest
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    return RECORDER
