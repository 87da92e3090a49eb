"""Core attention backends: softmax(q kᵀ / √d) v, swappable at build time.

This is Megatron-Core's layer-spec idea at the one place where it pays: the
model class stays the same and `config.attention_backend` picks the module
that computes attention from already-projected, already-rotated q, k, v.

Contract of every backend module:
    forward(query [b, s, heads, d], key [b, s, groups, d], value [b, s, groups, d],
            attention_mask: bool [b|1, 1, s, s] | None) -> [b, s, heads * d]
Attention is causal (and windowed on the layers `config.layer_window_size` gives a
window: all of them, or the sliding ones of a local/global pattern) unless
the module is built with `causal=False` (BERT and the T5 encoder, T5 cross
attention, where the key length may differ from the query length). An
`attention_mask` follows Megatron's convention: True marks a position that may
NOT be attended; it is applied on top of the causal mask.

With `config.softmax_type` "off-by-one" or "learnable" (gpt-oss's attention sinks) each
softmax row also holds one extra logit per head, 0 or the learned
`core_attention.softmax_offset` (Megatron's name, one value per head, split over
tensor-parallel ranks with the heads): `sink_attention` gives SDPA a zero key/value
column whose additive mask is that logit. flash-attn and Transformer Engine are refused
for it by name.

`config.attention_backend` takes Megatron's names (auto, flash, fused, unfused,
local; see `mg.core.models.attention_backend`): all but "flash" with flash-attn
installed run `SDPAttention` with the SDPA kernels the name allows; Transformer
Engine's DotProductAttention comes in with the rest of TE's modules
(`mg.core.models.te_spec.apply_transformer_engine`). `set_attention_backend`
rebuilds a built model's core attention for another name (core attention holds
no weights but the sinks, which it hands on), which is how a reader picks the kernels
of the machine it runs on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import sdpa_kernel

from mg.core.models import attention_backend
from mg.core.models.attention_backend import (
    CUDA_ONLY,
    BackendUnavailableError,
    check_attention_backend,
    sdpa_kernels,
    set_nvte_environment,
)
from mg.core.models.config import TransformerConfig
from mg.core.models.local_tensor import local
from mg.core.models.rng_stream import model_parallel_stream
from mg.core.models.te_parallel import TEParallelism

__all__ = [
    "BackendUnavailableError",
    "SDPAttention",
    "build_core_attention",
    "causal_mask",
    "set_attention_backend",
    "sink_attention",
]


def causal_mask(seq_length: int, window_size: tuple[int, int] | None, device) -> Tensor:
    """Bool [s, s], True where query i may attend key j: j <= i, and j >= i - left
    with a sliding window (left, 0)."""
    i = torch.arange(seq_length, device=device)[:, None]
    j = torch.arange(seq_length, device=device)[None, :]
    allowed = j <= i
    if window_size is not None:
        allowed &= j >= i - window_size[0]
    return allowed


def softcapped_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    scale: float,
    cap: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """softmax(c·tanh(q kᵀ·scale / c)) v in explicit math, as HF's eager Gemma 2 computes
    it (no SDPA kernel caps the logits): q [b, heads, s, d], k/v [b, groups, L, d] (each
    group shared by heads/groups consecutive query heads), `allowed` bool broadcastable to
    [b, heads, s, L] (True = attend) or None; the softmax runs in fp32."""
    heads, groups = q.shape[1], k.shape[1]
    if groups != heads:
        k = k.repeat_interleave(heads // groups, dim=1)
        v = v.repeat_interleave(heads // groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / cap) * cap
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if dropout_p:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v)


def sink_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    allowed: Tensor | None,
    sinks: Tensor,
    scale: float,
    dropout_p: float = 0.0,
) -> Tensor:
    """softmax([q kᵀ·scale, sink]) v without the sink's column, through SDPA: q [b, heads,
    s, d], k/v [b, groups, L, d], `allowed` bool broadcastable to [b, heads, s, L] (True =
    attend) or None, `sinks` [heads] (this rank's heads). The sink is a key and a value of
    zeros whose additive mask is the sink logit (q·0 = 0), so its probability is
    exp(sink) / (exp(sink) + Σ exp(logits)) and it adds nothing to the output, as
    Megatron's `SoftmaxOne` and transformers' GptOss attention compute it."""
    b, heads, s, d = q.shape
    length = k.shape[2]
    zeros = k.new_zeros(k.shape[0], k.shape[1], 1, d)
    k, v = torch.cat([k, zeros], dim=2), torch.cat([v, zeros.to(v.dtype)], dim=2)
    if allowed is None:
        bias = q.new_zeros(1, 1, s, length)
    else:
        allowed = allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))
        bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
        bias = bias.masked_fill(~allowed, float("-inf"))
    bias = bias.expand(bias.shape[0], heads, s, length)
    sink = sinks.to(q.dtype).view(1, heads, 1, 1).expand(bias.shape[0], heads, s, 1)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=torch.cat([bias, sink], dim=-1),
        dropout_p=dropout_p,
        scale=scale,
        enable_gqa=k.shape[1] != heads,
    )


def check_softmax_type(config: TransformerConfig) -> None:
    """Refuse, by name, a backend that has no attention sinks."""
    if config.softmax_type != "vanilla" and config.attention_backend == "flash":
        raise BackendUnavailableError(
            f"--softmax-type {config.softmax_type} with --attention-backend flash: flash "
            "kernels take no sink logit; use --attention-backend auto, fused, unfused or local"
        )


def check_softcapping(config: TransformerConfig) -> None:
    """Refuse a fused attention kernel for a model whose attention logits are capped."""
    if config.attn_logit_softcapping is not None and config.attention_backend in CUDA_ONLY:
        raise BackendUnavailableError(
            f"--attention-backend {config.attention_backend}: attention logit soft-capping "
            "(attn_logit_softcapping) needs the explicit-math attention; use "
            "--attention-backend auto, unfused or local"
        )


class SDPAttention(nn.Module):
    """`torch.nn.functional.scaled_dot_product_attention`: CPU and GPU, any dtype.

    The plain causal case uses `is_causal=True` so PyTorch can pick its flash or
    memory-efficient kernel; a sliding window or a user mask becomes an
    explicit boolean mask. `backend` (Megatron's name) restricts the kernels SDPA
    may pick; a CUDA-only one is refused on CPU tensors.
    """

    def __init__(
        self, config: TransformerConfig, layer_number: int = 1, causal: bool = True
    ) -> None:
        super().__init__()
        self.causal = causal
        self.num_heads = config.num_attention_heads
        self.num_groups = config.num_query_groups
        self.window_size = config.layer_window_size(layer_number) if causal else None
        self.dropout = config.attention_dropout
        self.softmax_scale = config.attention_softmax_scale
        self.backend = config.attention_backend
        self._kernels = sdpa_kernels(self.backend)
        self.softcap = config.attn_logit_softcapping
        self.softmax_type = config.softmax_type
        # the learnable sink logit per head, Megatron's `softmax_offset` (gpt-oss's sinks)
        self.softmax_offset = (
            nn.Parameter(torch.empty(self.num_heads))
            if config.softmax_type == "learnable"
            else None
        )

    @torch.no_grad()
    def init_weights(self, std: float) -> None:
        """Megatron inits the learnable sinks with init_method, N(0, σ)."""
        if self.softmax_offset is not None:
            nn.init.normal_(self.softmax_offset, mean=0.0, std=std)

    def sinks(self, device: torch.device) -> Tensor | None:
        """This rank's sink logits [heads] (zeros for off-by-one), or None (vanilla)."""
        return sink_logits(self, self.num_heads, device)

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        if self._kernels is None:
            return self._attend(query, key, value, attention_mask)
        check_attention_backend(self.backend, query.device)
        try:
            with sdpa_kernel(list(self._kernels)):
                return self._attend(query, key, value, attention_mask)
        except RuntimeError as err:
            if "No available kernel" not in str(err):
                raise
            raise BackendUnavailableError(
                f"--attention-backend {self.backend}: PyTorch has no such kernel for these "
                f"inputs ({query.dtype}, head dim {query.shape[-1]}, "
                f"{'a mask' if attention_mask is not None or self.window_size else 'no mask'})"
                "; flash/fused kernels need bf16 or fp16 (--bf16) and no explicit mask; "
                "use --attention-backend auto"
            ) from err

    def _attend(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None
    ) -> Tensor:
        b, s = query.shape[:2]
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [b, heads, s, d]
        sinks = self.sinks(query.device)
        if sinks is not None:
            allowed = causal_mask(s, self.window_size, query.device) if self.causal else None
            if attention_mask is not None:
                allowed = ~attention_mask if allowed is None else allowed & ~attention_mask
            dropout = self.dropout if self.training else 0.0
            out = sink_attention(q, k, v, allowed, sinks, self.softmax_scale, dropout)
            return out.transpose(1, 2).reshape(b, s, -1)
        if self.softcap is not None:
            allowed = causal_mask(s, self.window_size, query.device) if self.causal else None
            if attention_mask is not None:
                allowed = ~attention_mask if allowed is None else allowed & ~attention_mask
            dropout = self.dropout if self.training else 0.0
            out = softcapped_attention(q, k, v, allowed, self.softmax_scale, self.softcap, dropout)
            return out.transpose(1, 2).reshape(b, s, -1)
        mask = None
        if not self.causal:
            mask = None if attention_mask is None else ~attention_mask
        elif self.window_size is not None or attention_mask is not None:
            mask = causal_mask(s, self.window_size, query.device)
            if attention_mask is not None:
                mask = mask & ~attention_mask
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=self.causal and mask is None,
            scale=self.softmax_scale,
            enable_gqa=self.num_groups != self.num_heads,
        )
        return out.transpose(1, 2).reshape(b, s, -1)


def sink_logits(core_attention: nn.Module, heads: int, device: torch.device) -> Tensor | None:
    """A core-attention module's sink logits [heads] (its local ones under tensor
    parallelism; zeros for off-by-one), or None without sinks."""
    kind = getattr(core_attention, "softmax_type", "vanilla")
    if kind == "vanilla":
        return None
    if kind == "off-by-one":
        return torch.zeros(heads, device=device)
    return local(core_attention.softmax_offset)


def require_gpu_package(module: str, pip_name: str, flag: str) -> ModuleType:
    """Import a GPU-only package, or say in one line which extra installs it."""
    try:
        imported = importlib.import_module(module)
    except ImportError as err:
        raise BackendUnavailableError(
            f"{flag} needs the {pip_name} package, which is not installed ({err}); install "
            "the gpu extra: pip install 'mg-core[gpu]' (see the core README)"
        ) from err
    if not attention_backend.cuda_available():
        raise BackendUnavailableError(f"{flag} needs a CUDA GPU and none is visible")
    return imported


class FlashAttention(nn.Module):
    """flash-attn 2 (`flash_attn_func`): bshd layout and GQA natively, no masks."""

    def __init__(
        self, config: TransformerConfig, layer_number: int = 1, causal: bool = True
    ) -> None:
        super().__init__()
        flash_attn = require_gpu_package("flash_attn", "flash-attn", "--attention-backend flash")
        self._flash_attn_func = flash_attn.flash_attn_func
        self.causal = causal
        self.window_size = (config.layer_window_size(layer_number) if causal else None) or (-1, -1)
        self.dropout = config.attention_dropout
        self.softmax_scale = config.attention_softmax_scale

    def forward(
        self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        if attention_mask is not None:
            raise ValueError(
                "flash-attn takes no attention_mask (causal/windowed or unmasked only); "
                "use --attention-backend auto for custom masks"
            )
        # flash-attn takes fp16/bf16 of one dtype: the autocast dtype (a query/key norm
        # runs in fp32 under autocast), else the value's
        dtype = value.dtype
        if torch.is_autocast_enabled("cuda"):
            dtype = torch.get_autocast_dtype("cuda")
        query, key, value = (t.to(dtype) for t in (query, key, value))
        dv = value.shape[-1]
        if dv != query.shape[-1]:  # MLA's narrower values: flash-attn takes one head size
            value = F.pad(value, (0, query.shape[-1] - dv))
        out = self._flash_attn_func(
            query,
            key,
            value,
            dropout_p=self.dropout if self.training else 0.0,
            softmax_scale=self.softmax_scale,
            causal=self.causal,
            window_size=self.window_size,
        )
        return out[..., :dv].reshape(*query.shape[:2], -1)


def build_te_core_attention(
    config: TransformerConfig,
    layer_number: int = 1,
    causal: bool = True,
    parallel: TEParallelism | None = None,
) -> nn.Module:
    """Transformer Engine's DotProductAttention, used as the module itself so its
    `_extra_state` sits at `...core_attention._extra_state`, where Megatron's TE
    spec keeps it. Its forward matches the contract above (bshd, causal); the
    kernel follows `config.attention_backend` through TE's NVTE_* variables.
    `parallel`: the tensor- and context-parallel groups TE is told (it takes the
    whole model's head counts); attention dropout then draws from the per-rank
    stream, as the local spec's does (mg.core.models.rng_stream)."""
    parallel = parallel or TEParallelism()
    if config.softmax_type != "vanilla":
        raise BackendUnavailableError(
            f"--transformer-impl transformer_engine: --softmax-type {config.softmax_type} "
            "(attention sinks) is not supported there; use --transformer-impl local"
        )
    if config.attn_logit_softcapping is not None:
        raise BackendUnavailableError(
            "--transformer-impl transformer_engine: attention logit soft-capping "
            "(attn_logit_softcapping) is not supported there; use --transformer-impl local"
        )

    te = require_gpu_package(
        "transformer_engine.pytorch", "transformer-engine", "--transformer-impl transformer_engine"
    )
    set_nvte_environment(config.attention_backend)

    module = _te_attention_class(te.DotProductAttention)(
        num_attention_heads=config.num_attention_heads,
        kv_channels=te_kv_channels(config),
        num_gqa_groups=config.num_query_groups,
        attention_dropout=config.attention_dropout,
        qkv_format="bshd",
        attn_mask_type="causal" if causal else "no_mask",
        window_size=config.layer_window_size(layer_number) if causal else None,
        layer_number=layer_number,
        softmax_scale=config.attention_softmax_scale,
        **parallel.attention_kwargs(),
    )
    module.fork_dropout = parallel.tp_size > 1 and config.attention_dropout > 0
    return module


def te_kv_channels(config: TransformerConfig) -> int | tuple[int, int]:
    """TE's `kv_channels`: the head size, or with multi-latent attention the key's and the
    value's ((qk_head_dim + qk_pos_emb_head_dim, v_head_dim), as Megatron passes
    k_channels / v_channels)."""
    if config.multi_latent_attention:
        return (config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim)
    return config.kv_channels


@functools.cache
def _te_attention_class(base: type) -> type:
    """Our subclass of TE's DotProductAttention (`base`), made once."""

    class TEDotProductAttention(base):
        """TE's module (same state), taking our q, k, v: TE's kernels want contiguous
        tensors of one dtype, and a split of the fused QKV output is a strided view.
        `fork_dropout`: its dropout draws from the per-rank stream (tensor parallelism)."""

        fork_dropout = False

        def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask=None):
            if attention_mask is not None:
                raise ValueError(
                    "Transformer Engine attention here is causal or unmasked only; "
                    "--reset-attention-mask needs --transformer-impl local"
                )
            # one dtype, as TE's kernels need: the autocast dtype (a query/key norm runs in
            # fp32 under autocast), else the value's
            dtype = value.dtype
            if torch.is_autocast_enabled("cuda"):
                dtype = torch.get_autocast_dtype("cuda")
            q, k, v = (t.to(dtype).contiguous() for t in (query, key, value))
            stream = model_parallel_stream() if self.fork_dropout else None
            with stream.fork() if stream is not None else contextlib.nullcontext():
                return super().forward(q, k, v)

    return TEDotProductAttention


def build_core_attention(
    config: TransformerConfig, layer_number: int = 1, causal: bool = True
) -> nn.Module:
    """The core-attention module for `config.attention_backend` (layer_number is 1-based):
    flash-attn for "flash" where it imports and CUDA is there, SDPA otherwise."""
    check_softcapping(config)
    check_softmax_type(config)
    if attention_backend.use_flash_attn_package(config.attention_backend):
        return FlashAttention(config, layer_number, causal=causal)
    return SDPAttention(config, layer_number, causal=causal)


def set_attention_backend(
    model: nn.Module, backend: str, config: TransformerConfig | None = None
) -> nn.Module:
    """Rebuild every core-attention module of `model` for `backend` in place.

    Core attention holds no weights, so a reader (mg-eval, mg-serve) can pick the
    kernel of the machine it runs on whatever the checkpoint was trained with.
    `config`: the model's (default `model.config`; a pipeline stage shares it)."""
    config = config if config is not None else model.config
    config.attention_backend = backend
    config.validate()
    for module in model.modules():
        attention = getattr(module, "core_attention", None)
        if attention is None:
            continue
        causal = getattr(attention, "causal", True)
        layer_number = getattr(module, "layer_number", 1)
        rebuilt = build_core_attention(config, layer_number, causal=causal)
        if getattr(attention, "softmax_offset", None) is not None:  # the sinks are weights
            rebuilt.softmax_offset = attention.softmax_offset
        module.core_attention = rebuilt
    return model
