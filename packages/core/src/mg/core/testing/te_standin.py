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

It keeps the rules of TE 2.x that the code driving it must meet (each written where it
is kept, naming TE's function): the linears' `prepare_forward` (a strided input copied,
then viewed as (-1, in_features)), the `sequence_parallel` and tensor-parallel marks
`reset_parameters` puts on parameters, FP8's `_extra_state` as `get_extra_state` and
`set_extra_state` keep it (empty before the first FP8 forward, then a pickled state of
delayed scaling with amaxes reduced over the autocast's group; a pickled state refused
without NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1). The numbers stay fp32's.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import sys
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mg.core.models import attention_backend
from mg.core.models.recompute_state import recomputing


class _FP8State:
    """What the innermost `fp8_autocast` says (TE's FP8GlobalStateManager, in small)."""

    enabled = False
    recipe: Any = None
    group: Any = None


_FP8 = _FP8State()
_E4M3_MAX = 448.0
_DELAYED_KEYS = ("scale_fwd", "amax_history_fwd", "scale_bwd", "amax_history_bwd")
UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


class _Extra:
    """TE's TransformerEngineBaseModule: `prepare_forward` and the FP8 `_extra_state`."""

    fp8 = False  # the last forward ran under fp8_autocast(enabled=True)

    def _fp8_meta(self) -> dict:
        if "fp8_meta" not in self.__dict__:
            self.fp8_meta = {"fp8_checkpoint": False, "recipe": None}
        return self.fp8_meta

    def _prepare_forward(
        self, inp: torch.Tensor, allow_non_contiguous: bool = False
    ) -> torch.Tensor:
        """TransformerEngineBaseModule.prepare_forward: the FP8 metadata of the innermost
        fp8_autocast and, unless `allow_non_contiguous` (DotProductAttention's), a
        non-contiguous input copied to a contiguous one (LayerNormLinear and Linear then
        `view` it as (-1, in_features))."""
        meta = self._fp8_meta()
        self.fp8 = _FP8.enabled
        if self.fp8:
            recipe = _FP8.recipe
            if getattr(self, "sequence_parallel", False) and isinstance(recipe, DelayedScaling):
                # prepare_forward: delayed scaling under sequence parallelism reduces amaxes
                assert recipe.kwargs.get("reduce_amax", True), "reduce_amax with SP and FP8"
            meta.update(recipe=recipe, fp8_checkpoint=True)
            if isinstance(recipe, DelayedScaling) and not recomputing():
                self._record_amax(inp, recipe)
        if not allow_non_contiguous and not inp.is_contiguous():
            inp = inp.contiguous()
        return inp

    def _record_amax(self, inp: torch.Tensor, recipe: DelayedScaling) -> None:
        """Delayed scaling's state: a rolling amax history (reduced over the autocast's
        group, TE's default reduce_amax) and the scale it gives; not updated while a
        checkpointed region is recomputed (TE's recompute phase)."""
        meta = self.fp8_meta
        length = recipe.kwargs.get("amax_history_len", 1)
        if "amax_history_fwd" not in meta:
            meta["amax_history_fwd"] = torch.zeros(length, 1)
            meta["scale_fwd"] = torch.ones(1)
            meta["amax_history_bwd"] = torch.zeros(length, 1)
            meta["scale_bwd"] = torch.ones(1)
        amax = inp.detach().abs().max().float().reshape(1)
        if dist.is_initialized() and recipe.kwargs.get("reduce_amax", True):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=_FP8.group)
        history = meta["amax_history_fwd"].roll(1, 0)
        history[0] = amax
        meta["amax_history_fwd"] = history
        meta["scale_fwd"] = _E4M3_MAX / history.max().clamp(min=1e-12).reshape(1)

    def get_extra_state(self) -> torch.Tensor:
        """TransformerEngineBaseModule.get_extra_state: an empty uint8 tensor before the
        first FP8 forward (and for a stateless recipe), then a uint8 tensor of the pickled
        dict {recipe, scale_fwd, amax_history_fwd, scale_bwd, amax_history_bwd,
        extra_fp8_variables}: its size changes when FP8 starts."""
        meta = self._fp8_meta()
        if not (meta["fp8_checkpoint"] or self.fp8) or not isinstance(
            meta["recipe"], DelayedScaling
        ):
            return torch.empty(0, dtype=torch.uint8)
        state: dict[str, Any] = {"recipe": meta["recipe"]}
        if "amax_history_fwd" in meta:
            state.update({k: meta[k].clone() for k in _DELAYED_KEYS})
        state["extra_fp8_variables"] = {
            k: v for k, v in meta.items() if isinstance(v, bool | int | float | str | tuple | list)
        }
        return torch.frombuffer(bytearray(pickle.dumps(state)), dtype=torch.uint8)

    def set_extra_state(self, state) -> None:
        """TransformerEngineBaseModule.set_extra_state: None or an empty tensor is
        nothing; a pickled delayed-scaling state is refused unless
        NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1 (TE 2.x's should_load_extra_state_pickle),
        then restored; a BytesIO (older checkpoints) needs the same opt-in; anything
        else raises."""
        if state is None:
            return
        if isinstance(state, io.BytesIO):
            if os.environ.get(UNSAFE_PICKLE_ENV, "0") != "1":
                raise RuntimeError(f"Refusing pickled extra state; set {UNSAFE_PICKLE_ENV}=1")
            return
        if not isinstance(state, torch.Tensor):
            raise RuntimeError("Unsupported checkpoint format.")
        if state.numel() == 0:
            return
        if state.dtype != torch.uint8:
            raise RuntimeError(f"extra state of dtype {state.dtype}, TE stores torch.uint8")
        if os.environ.get(UNSAFE_PICKLE_ENV, "0") != "1":
            raise RuntimeError(
                "Refusing to load pickled Transformer Engine extra state for "
                f"{type(self).__name__}. To load it anyway, set {UNSAFE_PICKLE_ENV}=1."
            )
        loaded = pickle.loads(state.numpy().tobytes())
        meta = self._fp8_meta()
        meta.update(loaded["extra_fp8_variables"])
        meta["recipe"] = loaded["recipe"]
        meta.update({k: loaded[k].clone() for k in _DELAYED_KEYS if k in loaded})


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
        self.tp_group, self.parallel_mode = tp_group, parallel_mode
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else tp_size
        self.sequence_parallel = self.tp_size > 1 and sequence_parallel  # TE's own rule
        RECORDER.parallel.append((type(self).__name__, parallel_mode, sequence_parallel))

    def _split(self, in_features, out_features):
        if self.parallel_mode == "column":
            return in_features, out_features // self.tp_size
        if self.parallel_mode == "row":
            return in_features // self.tp_size, out_features
        return in_features, out_features

    def _mark_parameters(self, norms: tuple[str, ...]) -> None:
        """The attributes TE's reset_parameters sets (Megatron's finalize_model_grads reads
        `sequence_parallel`): the norms' and a row module's bias `sequence_parallel`, the
        weights' and a column module's bias tensor-parallel attributes."""
        for name in norms:
            if getattr(self, name, None) is not None:
                getattr(self, name).sequence_parallel = self.sequence_parallel
        self.weight.tensor_model_parallel = True
        self.weight.partition_dim = 1 if self.parallel_mode == "row" else 0
        self.weight.partition_stride = 1
        if self.bias is None:
            return
        if self.parallel_mode == "row":
            self.bias.sequence_parallel = self.sequence_parallel
        elif self.parallel_mode == "column":
            self.bias.tensor_model_parallel, self.bias.partition_dim = True, 0
            self.bias.partition_stride = 1

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
        self.in_features = in_features
        self._mark_parameters(("layer_norm_weight", "layer_norm_bias"))
        RECORDER.built.append(("LayerNormLinear", RECORDER.model_init))

    def forward(self, inp):
        inp = self._prepare_forward(inp)
        shape = inp.shape
        assert shape[-1] == self.in_features, "GEMM not possible"
        x = inp.view((-1, self.in_features))  # _LayerNormLinear.forward's view
        g = self.layer_norm_weight + 1 if self.zero else self.layer_norm_weight
        if self.normalization == "RMSNorm":
            x = F.rms_norm(x, x.shape[-1:], g, self.eps)
        else:
            x = F.layer_norm(x, x.shape[-1:], g, self.layer_norm_bias, self.eps)
        out = F.linear(self._column_input(x), self.weight, self.bias)
        return out.view(-1, *shape[1:-1], out.shape[-1])


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
        self.bias = nn.Parameter(torch.randn(local_out, **kw)) if bias else None
        self.in_features = local_in
        self._mark_parameters(())
        RECORDER.built.append(("Linear", RECORDER.model_init))

    def forward(self, inp):
        inp = self._prepare_forward(inp)
        shape = inp.shape
        assert shape[-1] == self.in_features, "GEMM not possible"
        x = inp.view((-1, self.in_features))  # _Linear.forward's view
        if self.parallel_mode != "row":
            y = F.linear(self._column_input(x), self.weight, self.bias)
        else:
            y = self._row_output(F.linear(x, self.weight))  # the bias once, after the reduction
            y = y + self.bias if self.bias is not None else y
        return y.view(-1, *shape[1:-1], y.shape[-1])


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
        self._prepare_forward(q, allow_non_contiguous=True)  # its FP8 state (prepare_forward_ctx)
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
    """transformer_engine.common.recipe's classes: their arguments, recorded (picklable:
    TE pickles the recipe into a delayed-scaling `_extra_state`)."""

    def __init__(self, **kwargs):
        self.kind, self.kwargs = type(self).__name__, kwargs


class DelayedScaling(Recipe):
    """The one recipe with state to checkpoint (TE's recipe_extra_state_policy)."""


class Float8CurrentScaling(Recipe):
    pass


class Float8BlockScaling(Recipe):
    pass


class MXFP8BlockScaling(Recipe):
    pass


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
    before = (_FP8.enabled, _FP8.recipe, _FP8.group)
    _FP8.enabled, _FP8.recipe = enabled, fp8_recipe if fp8_recipe is not None else DelayedScaling()
    _FP8.group = fp8_group
    try:
        yield
    finally:
        _FP8.enabled, _FP8.recipe, _FP8.group = before


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
    _FP8.enabled, _FP8.recipe, _FP8.group = False, None, None
    monkeypatch.delenv(UNSAFE_PICKLE_ENV, raising=False)
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.Format = types.SimpleNamespace(E4M3="E4M3", HYBRID="HYBRID")
    recipe.DelayedScaling, recipe.Float8CurrentScaling = DelayedScaling, Float8CurrentScaling
    recipe.Float8BlockScaling, recipe.MXFP8BlockScaling = Float8BlockScaling, MXFP8BlockScaling
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
