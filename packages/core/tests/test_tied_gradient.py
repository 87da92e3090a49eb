"""The tied weight's gradient summed in one tensor equals autograd's sum of the head's and
the lookup's gradients, whichever form the head's part waits in."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mg.core.models.tied_gradient import TiedGradient, tied_logits, tied_lookup

VOCAB = 40


def _loss(ids, weight, tied):
    hidden = tied_lookup(ids, weight, tied) if tied else F.embedding(ids, weight)
    hidden = torch.tanh(hidden) * 1.5  # something between the lookup and the head
    logits = tied_logits(hidden, weight, tied) if tied else F.linear(hidden, weight)
    return F.cross_entropy(logits.reshape(-1, VOCAB), ids.roll(-1, dims=1).reshape(-1))


@pytest.mark.parametrize("tokens,hidden", [(6, 16), (64, 8)], ids=["factors", "summed"])
def test_the_gradient_is_autograds_sum(tokens, hidden):
    torch.manual_seed(0)
    ids = torch.randint(0, VOCAB, (2, tokens // 2))
    ids[0, :2] = 3  # a row looked up more than once
    plain = torch.randn(VOCAB, hidden, requires_grad=True)
    fused = plain.detach().clone().requires_grad_()
    tied = TiedGradient()
    for _ in range(2):  # two micro-batches: the second adds onto the first's gradient
        _loss(ids, plain, None).backward()
        _loss(ids, fused, tied).backward()
        held = tied.summed is not None or tied.factors
        assert not held, "the lookup's backward takes every part"
    torch.testing.assert_close(fused.grad, plain.grad, rtol=1e-6, atol=1e-6)
    assert fused.grad.abs().sum() > 0


def test_the_head_holds_the_smaller_form():
    tied = TiedGradient()
    tied.add_head(torch.randn(4, 40), torch.randn(4, 16))  # 4 tokens < 16 hidden: g and x
    assert tied.summed is None and len(tied.factors) == 1
    tied.add_head(torch.randn(32, 40), torch.randn(32, 16))  # 32 tokens: gᵀx, 40 x 16
    assert tied.summed.shape == (40, 16)
    total = tied.take()
    assert total.shape == (40, 16) and tied.summed is None and not tied.factors


def test_without_a_gradient_the_plain_ops_run():
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    ids = torch.randint(0, VOCAB, (1, 5))
    tied = TiedGradient()
    with torch.no_grad():
        hidden = tied_lookup(ids, weight, tied)
        logits = tied_logits(hidden, weight, tied)
    assert logits.grad_fn is None
    torch.testing.assert_close(logits, F.linear(F.embedding(ids, weight), weight))


def test_a_lookup_without_a_head_gives_its_rows_only():
    weight = torch.randn(VOCAB, 8, requires_grad=True)
    ids = torch.tensor([[1, 1, 5]])
    tied_lookup(ids, weight, TiedGradient()).sum().backward()
    expected = torch.zeros(VOCAB, 8)
    expected[1] = 2.0
    expected[5] = 1.0
    torch.testing.assert_close(weight.grad, expected)
