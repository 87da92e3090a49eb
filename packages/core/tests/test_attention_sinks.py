"""Attention sinks (`softmax_type` off-by-one / learnable) and gpt-oss's clamped SwiGLU,
against the explicit math of transformers' GptOss eager attention and experts."""

from __future__ import annotations

import pytest
import torch

from mg.core.models.activations import activate
from mg.core.models.attention_backend import BackendUnavailableError
from mg.core.models.config import ConfigError, TransformerConfig
from mg.core.models.core_attention import SDPAttention, build_core_attention
from mg.core.models.gpt import GPTModel
from mg.core.models.kv_cache import KVCache


def _config(**kw) -> TransformerConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=64,
        seq_length=16,
        position_embedding_type="rope",
        normalization="RMSNorm",
        attention_dropout=0.0,
        hidden_dropout=0.0,
        softmax_type="learnable",
    )
    base.update(kw)
    return TransformerConfig(**base)


def _eager_sinks(q, k, v, sinks, window: int | None, scale: float):
    """transformers' GptOss eager attention: [logits, sink] softmax, the sink dropped.
    q [b, s, heads, d], k/v [b, s, groups, d]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q.shape[2]
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j >= i - window
    logits = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    sink = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, s, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return (probs @ v).transpose(1, 2).reshape(q.shape[0], s, -1)


@pytest.mark.parametrize("window", [None, 3])
def test_learnable_sinks_match_eager_math_and_gradient(window):
    torch.manual_seed(0)
    config = _config(window_size=None if window is None else (window, 0))
    core = SDPAttention(config)
    core.init_weights(1.0)
    q = torch.randn(2, 9, 4, 8, requires_grad=True)
    k = torch.randn(2, 9, 2, 8)
    v = torch.randn(2, 9, 2, 8)
    out = core(q, k, v)
    sinks = core.softmax_offset.detach().clone().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    ref = _eager_sinks(q2, k, v, sinks, window, config.attention_softmax_scale)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(core.softmax_offset.grad, sinks.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(q.grad, q2.grad, atol=1e-5, rtol=0)


def test_off_by_one_is_a_zero_sink_and_has_no_parameter():
    torch.manual_seed(1)
    core = SDPAttention(_config(softmax_type="off-by-one"))
    assert dict(core.named_parameters()) == {}
    q, k, v = torch.randn(1, 6, 4, 8), torch.randn(1, 6, 2, 8), torch.randn(1, 6, 2, 8)
    ref = _eager_sinks(q, k, v, torch.zeros(4), None, 8**-0.5)
    torch.testing.assert_close(core(q, k, v), ref, atol=1e-6, rtol=0)
    # the first query attends one key: its weight is e^x / (1 + e^x), not 1
    vanilla = SDPAttention(_config(softmax_type="vanilla"))
    assert (core(q, k, v)[:, 0] - vanilla(q, k, v)[:, 0]).abs().max() > 1e-3


def test_model_names_the_sink_parameter_as_megatron_and_the_cache_matches():
    torch.manual_seed(2)
    config = _config(window_size=(3, 0), window_attn_skip_freq=2)
    model = GPTModel(config)
    model.eval()
    names = [n for n, _ in model.named_parameters() if "softmax_offset" in n]
    assert names == [
        "decoder.layers.0.self_attention.core_attention.softmax_offset",
        "decoder.layers.1.self_attention.core_attention.softmax_offset",
    ]
    assert model.decoder.layers[0].self_attention.core_attention.softmax_offset.std() > 0
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache.for_model(model, num_slots=1, max_length=16)
        cache.bind(torch.tensor([0]), torch.tensor([0]))
        steps = [model(ids[:, :5], torch.arange(5)[None], inference_cache=cache)]
        for t in range(5, 12):
            cache.bind(torch.tensor([0]), torch.tensor([t]))
            steps.append(model(ids[:, t : t + 1], torch.tensor([[t]]), inference_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


def test_backends_without_sinks_are_refused_by_name():
    with pytest.raises(BackendUnavailableError, match="--softmax-type learnable.*flash"):
        build_core_attention(_config(attention_backend="flash"))
    with pytest.raises(ConfigError, match="softmax_type"):
        _config(softmax_type="quiet")
    with pytest.raises(ConfigError, match="pick one"):
        _config(attn_logit_softcapping=30.0)


def _gpt_oss_gate(gate_up: torch.Tensor, alpha: float = 1.702, limit: float = 7.0):
    """transformers' GptOssExperts._apply_gate (interleaved gate/up columns)."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def test_clamped_quick_geglu_matches_gpt_oss_and_megatron_glu():
    torch.manual_seed(3)
    config = _config(
        activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=7.0
    )
    x = torch.randn(5, 2 * 6) * 6  # well past the clamp
    interleaved = torch.stack(x.chunk(2, dim=-1), dim=-1).reshape(5, 12)  # [g0 u0 g1 u1 ...]
    torch.testing.assert_close(activate(x, config), _gpt_oss_gate(interleaved), rtol=0, atol=0)
    # Megatron's MLP.glu: act(min(g, L)) * (clamp(u, -L, L) + c), act = x*sigmoid(1.702x)
    g, u = x.chunk(2, dim=-1)
    g, u = g.clamp(max=7.0), u.clamp(-7.0, 7.0)
    torch.testing.assert_close(activate(x, config), g * torch.sigmoid(1.702 * g) * (u + 1.0))
    with pytest.raises(ConfigError, match="glu_linear_offset.*gated"):
        _config(glu_linear_offset=1.0)


@pytest.mark.slow  # a kernel build each (C++): ~40 s
@pytest.mark.parametrize(
    ("dtype", "head_dim", "block_size", "window"),
    [
        (torch.float32, 32, 16, -1),
        (torch.bfloat16, 32, 16, 5),
        (torch.float32, 16, 4, 5),
    ],
    ids=["avx512-fp32", "avx512-window-bf16", "loops-window-fp32"],  # a build each
)
def test_cpu_decode_kernel_adds_each_heads_sink(dtype, head_dim, block_size, window):
    """The paged decode kernel with sinks equals softmax([logits, sink]) over the gathered
    positions (the AVX-512 path where head_dim and block_size are multiples of 16 and the
    CPU has it, the portable loops otherwise)."""
    from mg.core.models.paged_attention_cpu import decode_kernel

    groups, heads = 2, 4
    kernel, why = decode_kernel(dtype, groups, heads, head_dim, block_size)
    if kernel is None:
        pytest.skip(why)
    g = torch.Generator().manual_seed(4)
    pool = (12, block_size, groups, head_dim)
    keys, values = (
        torch.randn(pool, generator=g).to(dtype),
        torch.randn(pool, generator=g).to(dtype),
    )
    tables = torch.randperm(12, generator=g).view(3, 4)
    lengths = torch.tensor([1, block_size + 3, 4 * block_size])
    query = torch.randn(3, heads, head_dim, generator=g).to(dtype)
    sinks = torch.randn(heads, generator=g) * 2
    scale = head_dim**-0.5
    got = kernel(query, keys, values, tables, lengths, window, scale, sinks=sinks)
    for i, length in enumerate(lengths.tolist()):
        k = keys[tables[i]].reshape(-1, groups, head_dim)[:length].float()
        v = values[tables[i]].reshape(-1, groups, head_dim)[:length].float()
        first = max(0, length - 1 - window) if window >= 0 else 0
        k, v = k[first:].repeat_interleave(2, 1), v[first:].repeat_interleave(2, 1)
        logits = torch.einsum("hd,lhd->hl", query[i].float(), k) * scale
        probs = torch.cat([logits, sinks[:, None]], dim=-1).softmax(-1)[:, :-1]
        want = torch.einsum("hl,lhd->hd", probs, v).to(dtype)
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)
    plain = kernel(query, keys, values, tables, lengths, window, scale)
    assert (plain.float() - got.float()).abs().max() > 1e-2  # the sinks took their share


def test_context_parallel_keeps_the_sinks_under_their_name(monkeypatch):
    import mg.core.parallel.context_parallel as cp
    from mg.core.parallel.context_parallel import RingAttention, apply_context_parallel

    monkeypatch.setattr(cp.dist, "get_world_size", lambda group=None: 2)  # a CP group of 2
    model = GPTModel(_config())
    before = dict(model.named_parameters())
    apply_context_parallel(model, None)
    assert dict(model.named_parameters()) == before  # the same sink parameters, same names
    assert all(
        isinstance(layer.self_attention.core_attention, RingAttention)
        for layer in model.decoder.layers
    )
