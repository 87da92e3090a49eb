"""Activation recompute changes memory, not results: gradients are identical."""

import pytest
import torch

from mg.core.models import GPTModel, apply_activation_recompute, presets

SETTINGS = [
    dict(granularity="selective"),
    dict(granularity="full", method="uniform", num_layers=1),
    dict(granularity="full", method="uniform", num_layers=2),
    dict(granularity="full", method="block", num_layers=2),
]


def _loss_and_grads(model, ids, labels):
    model.zero_grad()
    loss = model(ids, labels=labels).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: "-".join(map(str, s.values())))
def test_gradients_identical_with_and_without_recompute(setting):
    config = presets.tiny_llama(num_layers=3, attention_dropout=0.1, hidden_dropout=0.1)
    torch.manual_seed(0)
    model = GPTModel(config)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    labels = torch.randint(0, config.vocab_size, (2, 16))
    names_before = list(model.state_dict())

    torch.manual_seed(1)  # dropout on: recompute must replay the same masks
    loss, grads = _loss_and_grads(model, ids, labels)
    apply_activation_recompute(model, **setting)
    torch.manual_seed(1)
    loss_rc, grads_rc = _loss_and_grads(model, ids, labels)

    assert torch.equal(loss, loss_rc)
    for name, grad in grads.items():
        assert torch.equal(grad, grads_rc[name]), name
    assert list(model.state_dict()) == names_before  # Megatron names untouched


def test_recompute_is_really_used():
    config = presets.tiny_llama(num_layers=2)
    model = apply_activation_recompute(GPTModel(config), granularity="full", num_layers=1)
    calls = []
    layer = model.decoder.layers[0]
    layer.register_forward_pre_hook(lambda *args: calls.append(1))
    model(
        torch.randint(0, config.vocab_size, (1, 8)), labels=torch.zeros(1, 8, dtype=int)
    ).sum().backward()
    assert len(calls) == 2  # forward, then again during backward


def test_invalid_arguments():
    model = GPTModel(presets.tiny_gpt2())
    with pytest.raises(ValueError, match="granularity"):
        apply_activation_recompute(model, granularity="partial")
    with pytest.raises(ValueError, match="method"):
        apply_activation_recompute(model, granularity="full", method="random")
    apply_activation_recompute(model)
    with pytest.raises(ValueError, match="already applied"):
        apply_activation_recompute(model)
