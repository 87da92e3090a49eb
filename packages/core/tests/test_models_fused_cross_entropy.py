"""The fused output layer + cross-entropy equals the unfused one (loss and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.fused_cross_entropy import apply_cross_entropy_fusion, linear_cross_entropy


def _unfused(hidden, weight, labels):
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none").view(
        labels.shape
    )


def _loss_and_grads(fn, hidden, weight, labels, upstream, autocast: bool):
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(h, w, labels)
    (loss * upstream).sum().backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("autocast", [False, True])
def test_equals_unfused_loss_and_gradients(autocast: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 50, 16, generator=gen)  # 150 tokens: chunks of 64 leave 22
    weight = torch.randn(97, 16, generator=gen) * 0.3
    labels = torch.randint(0, 97, (3, 50), generator=gen)
    upstream = torch.rand(3, 50, generator=gen)  # a loss mask / token weighting
    ref = _loss_and_grads(_unfused, hidden, weight, labels, upstream, autocast)
    fused = _loss_and_grads(
        lambda h, w, y: linear_cross_entropy(h, w, y, chunk_tokens=64),
        hidden,
        weight,
        labels,
        upstream,
        autocast,
    )
    rtol = 1e-2 if autocast else 1e-5  # bf16: the gradient is rounded once in either path
    for name, a, b in zip(("loss", "grad hidden", "grad weight"), ref, fused, strict=True):
        assert b.dtype == a.dtype, name
        assert (a - b).norm() <= rtol * a.norm(), name


def test_gpt_model_with_fusion_matches_unfused() -> None:
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
        max_position_embeddings=16, attention_dropout=0.0, hidden_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    plain = GPTModel(config)
    fused = GPTModel(config)
    fused.load_state_dict(plain.state_dict())
    apply_cross_entropy_fusion(fused)
    tokens = torch.randint(0, 128, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    losses = [m(tokens, positions, labels=tokens.roll(-1, 1)) for m in (plain, fused)]
    for loss in losses:
        loss.sum().backward()
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    logits = fused(tokens, positions)  # no labels: logits as before
    assert logits.shape == (2, 16, 128)


def test_out_of_range_label_is_refused() -> None:
    with pytest.raises(ValueError, match=r"token ids in \[0, 5\)"):
        linear_cross_entropy(torch.zeros(2, 4), torch.zeros(5, 4), torch.tensor([1, 5]))


def test_backward_allocates_nothing_of_the_logits_size() -> None:
    """Backward scales the small operands by the incoming gradient: no op in it allocates a
    second [tokens, vocab] buffer (the stored gradient is the only one)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab = 64, 16, 1000
    h = torch.randn(tokens, hidden_size, generator=gen).requires_grad_()
    w = torch.randn(vocab, hidden_size, generator=gen).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)
    loss = linear_cross_entropy(h, w, labels, chunk_tokens=32)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        (loss * torch.rand(tokens, generator=gen)).sum().backward()
    largest = max(event.self_cpu_memory_usage for event in prof.key_averages())
    assert 0 < largest < tokens * vocab * 4 // 2  # the largest: grad_weight, vocab x hidden
