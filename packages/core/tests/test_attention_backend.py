"""--attention-backend: Megatron's names, the portable kernels' numerics against the
unfused math, CPU refusals, Megatron's NVTE_* switches, and (on a GPU) the CUDA
kernels against the unfused path."""

from __future__ import annotations

import math
import os
import warnings

import pytest
import torch

from mg.core.models import GPTModel, TransformerConfig, presets
from mg.core.models.attention_backend import (
    BackendUnavailableError,
    choices,
    nvte_environment,
    set_nvte_environment,
)
from mg.core.models.config import ATTENTION_BACKENDS
from mg.core.models.core_attention import SDPAttention, set_attention_backend

CUDA = torch.cuda.is_available()


def _ids(config: TransformerConfig, b: int = 2, s: int = 16) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))


def _reference_attention(q, k, v, causal: bool, window=None, mask=None):
    """softmax(q kᵀ/√d + mask) v written out, in float64: the unfused path by hand."""
    b, s, h, d = q.shape
    g = k.shape[2]
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(h // g, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed &= j <= i
        if window is not None:
            allowed &= j >= i - window[0]
    if mask is not None:
        allowed = allowed & ~mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, h * d)


def test_names_are_megatron_cores() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.transformer.enums import AttnBackend
    assert sorted(choices()) == sorted(b.name for b in AttnBackend)
    assert sorted(ATTENTION_BACKENDS) == sorted(choices())
    assert TransformerConfig(2, 64, 4, 128).attention_backend == "auto"  # Megatron's default


@pytest.mark.parametrize("backend", ["auto", "unfused", "local"])
@pytest.mark.parametrize(
    "case", ["causal_gqa", "window", "mask", "encoder"], ids=lambda c: c.replace("_", "-")
)
def test_portable_backends_match_the_unfused_math(backend: str, case: str) -> None:
    config = presets.tiny_llama(
        attention_backend=backend,
        attention_dropout=0.0,
        window_size=(3, 0) if case == "window" else None,
    )
    causal = case != "encoder"
    attention = SDPAttention(config, causal=causal).eval()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 4, 16, generator=g)
    k, v = (torch.randn(2, 8, 2, 16, generator=g) for _ in range(2))
    mask = None
    if case in ("mask", "encoder"):
        mask = torch.zeros(2, 1, 8, 8, dtype=torch.bool)
        mask[0, :, :, 5:] = True  # the first row's last keys are padding
        mask[:, :, :, 0] = False
    out = attention(q, k, v, attention_mask=mask)
    ref = _reference_attention(q, k, v, causal, config.window_size, mask)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


def test_whole_model_is_the_same_under_each_portable_backend() -> None:
    torch.manual_seed(0)
    model = GPTModel(presets.tiny_llama(attention_backend="unfused")).eval()
    ids = _ids(model.config)
    unfused = model(ids)
    for backend in ("auto", "local"):
        set_attention_backend(model, backend)
        assert model.config.attention_backend == backend
        torch.testing.assert_close(model(ids), unfused, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(CUDA, reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("backend", ["flash", "fused"])
def test_cuda_kernels_are_refused_by_flag_name_without_cuda(backend: str) -> None:
    model = GPTModel(presets.tiny_gpt2(attention_backend=backend))
    with pytest.raises(BackendUnavailableError) as err:
        model(_ids(model.config))
    message = str(err.value)
    assert f"--attention-backend {backend}" in message and "\n" not in message


def test_configs_recorded_with_the_old_names_still_load() -> None:
    old = presets.tiny_gpt2().to_dict()
    assert TransformerConfig.from_dict({**old, "attention_backend": "sdpa"}).attention_backend == (
        "auto"
    )
    te = TransformerConfig.from_dict({**old, "attention_backend": "te"})
    assert (te.attention_backend, te.transformer_impl) == ("auto", "transformer_engine")


def test_nvte_switches_are_the_ones_megatron_sets(monkeypatch) -> None:
    """megatron-core's LanguageModule._set_attention_backend, run on a stub, sets the same
    NVTE_FLASH_ATTN / NVTE_FUSED_ATTN / NVTE_UNFUSED_ATTN values as ours."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.common.language_module.language_module import LanguageModule
        from megatron.core.transformer.enums import AttnBackend

    names = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
    for name in names:  # recorded, so what the code under test sets is undone afterwards
        monkeypatch.setenv(name, "")
    for backend in choices():
        for name in names:
            monkeypatch.delenv(name, raising=False)
        stub = type("Stub", (), {})()
        stub.config = type("Config", (), {"attention_backend": AttnBackend[backend]})()
        LanguageModule._set_attention_backend(stub)
        theirs = {name: os.environ[name] for name in names}
        assert nvte_environment(backend) == theirs, backend
        set_nvte_environment(backend)  # agrees with what is set: no error
    monkeypatch.setenv("NVTE_FLASH_ATTN", "1")
    with pytest.raises(BackendUnavailableError, match="NVTE_FLASH_ATTN=1"):
        set_nvte_environment("fused")


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["flash", "fused", "auto"])
def test_cuda_kernels_match_the_unfused_path(backend: str) -> None:
    """bf16 on the GPU: each CUDA kernel against the math kernel on the same inputs."""

    def attention(name: str) -> SDPAttention:
        config = presets.tiny_llama(attention_backend=name, attention_dropout=0.0, kv_channels=64)
        return SDPAttention(config).eval()

    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2, 128, 4, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (
        torch.randn(2, 128, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        for _ in range(2)
    )
    out = attention(backend)(q, k, v)
    reference = attention("unfused")(q, k, v)
    torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=2e-2)


def _flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1)
):
    """flash-attn 2's `flash_attn_func` contract written out (bshd, GQA, window (left, right)
    with -1 for unbounded, bottom-right aligned causal mask)."""
    window = None if window_size == (-1, -1) else window_size
    assert dropout_p == 0.0 and softmax_scale == pytest.approx(1 / math.sqrt(q.shape[-1]))
    b, s, h, d = q.shape
    return _reference_attention(q, k, v, causal, window).view(b, s, h, d).to(q.dtype)


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_flash_attn_package_is_called_as_its_contract_says(monkeypatch, window) -> None:
    """With flash-attn installed and CUDA present, --attention-backend flash runs
    `flash_attn_func` (a stand-in of its contract here, on the CPU) with Megatron's
    scale, causal flag and window; the result is the unfused math."""
    import sys
    import types

    from mg.core.models import attention_backend
    from mg.core.models.core_attention import FlashAttention, build_core_attention

    stand_in = types.ModuleType("flash_attn")
    stand_in.flash_attn_func = _flash_attn_func
    monkeypatch.setitem(sys.modules, "flash_attn", stand_in)
    monkeypatch.setattr(attention_backend, "cuda_available", lambda: True)
    config = presets.tiny_llama(
        attention_backend="flash", attention_dropout=0.0, window_size=window
    )
    attention = build_core_attention(config).eval()
    assert isinstance(attention, FlashAttention)
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 4, 16, generator=g)
    k, v = (torch.randn(2, 8, 2, 16, generator=g) for _ in range(2))
    expected = _reference_attention(q, k, v, True, window)
    torch.testing.assert_close(attention(q, k, v).double(), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="use --attention-backend auto for custom masks"):
        attention(q, k, v, attention_mask=torch.zeros(1, 1, 8, 8, dtype=torch.bool))


def _without_flash_attn(monkeypatch, broken: bool) -> None:
    """A CUDA machine (as far as the choice asks) where flash-attn is absent, or installed
    but failing to import (a build for another torch)."""
    import builtins
    import sys

    from mg.core.models import attention_backend

    monkeypatch.setattr(attention_backend, "cuda_available", lambda: True)
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(attention_backend, "flash_attn_installed", lambda: broken)
    real_import = builtins.__import__

    def failing(name, *args, **kwargs):
        if name.split(".")[0] == "flash_attn":
            raise ImportError("undefined symbol: _ZN3c10 (built for another torch)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing)
    monkeypatch.setattr(attention_backend, "_said", set())


@pytest.mark.parametrize("broken", [False, True], ids=["absent", "broken-build"])
def test_flash_without_flash_attn_runs_sdpas_flash_kernel_said_once(
    monkeypatch, caplog, broken: bool
) -> None:
    """--attention-backend flash (--use-flash-attn) without a usable flash-attn: every
    layer's core attention is SDPA restricted to PyTorch's FLASH_ATTENTION kernel, and the
    log says so once for the whole model, naming why."""
    from torch.nn.attention import SDPBackend

    from mg.core.models import attention_backend
    from mg.core.models.core_attention import build_core_attention

    _without_flash_attn(monkeypatch, broken)
    config = presets.tiny_llama(attention_backend="flash", num_layers=3)
    with caplog.at_level("WARNING", logger=attention_backend.__name__):
        assert attention_backend.use_flash_attn_package("flash") is False
        built = [build_core_attention(config, layer) for layer in (1, 2, 3)]
        model = GPTModel(config)
    assert all(isinstance(a, SDPAttention) for a in built)
    assert all(a._kernels == (SDPBackend.FLASH_ATTENTION,) for a in built)
    assert all(
        m.core_attention._kernels == (SDPBackend.FLASH_ATTENTION,)
        for m in model.modules()
        if hasattr(m, "core_attention")
    )
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith("--attention-backend flash: the flash-attn package ")
    assert ("does not import" if broken else "is not installed") in said[0]
    assert "FLASH_ATTENTION" in said[0]


def test_fused_is_sdpas_cudnn_and_memory_efficient_kernels() -> None:
    from torch.nn.attention import SDPBackend

    from mg.core.models.attention_backend import sdpa_kernels, use_flash_attn_package

    assert sdpa_kernels("fused") == (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    assert not use_flash_attn_package("fused") and not use_flash_attn_package("auto")


def test_flash_without_cuda_is_still_refused_by_name(monkeypatch) -> None:
    """The fallback is a GPU one: without CUDA, flash stays refused where it would run."""
    from mg.core.models import attention_backend

    monkeypatch.setattr(attention_backend, "cuda_available", lambda: False)
    assert attention_backend.use_flash_attn_package("flash") is False
    attention = SDPAttention(presets.tiny_llama(attention_backend="flash"))
    q = torch.randn(1, 4, 4, 16)
    k = v = torch.randn(1, 4, 2, 16)
    with pytest.raises(BackendUnavailableError, match="--attention-backend flash selects a CUDA"):
        attention(q, k, v)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_flash_without_flash_attn_runs_on_the_gpu(monkeypatch) -> None:
    """On a GPU with flash-attn made unimportable: a bf16 forward and backward of a tiny
    GPT under --attention-backend flash runs SDPA's flash kernel and matches the math."""
    _without_flash_attn(monkeypatch, broken=False)

    def run(backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        config = presets.tiny_llama(attention_backend=backend, kv_channels=64)
        model = GPTModel(config).cuda().to(torch.bfloat16)
        ids = _ids(config, 2, 32).cuda()
        logits = model(ids)
        logits.float().pow(2).mean().backward()
        grad = next(p for p in model.parameters() if p.grad is not None).grad
        return logits.float(), grad.float()

    flash, flash_grad = run("flash")
    math_, math_grad = run("unfused")
    torch.testing.assert_close(flash, math_, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(flash_grad, math_grad, rtol=1e-1, atol=1e-2)
