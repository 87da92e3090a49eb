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


def _moe_model(**fields):
    from mg.core.models.moe import AuxLossBackward

    AuxLossBackward.scale = 1.0
    moe = dict(
        num_moe_experts=4,
        moe_ffn_hidden_size=8,
        moe_router_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_load_balancing_type="global_aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_z_loss_coeff=1e-3,
    )
    config = presets.tiny_llama(num_layers=2, **(moe | fields))
    torch.manual_seed(0)
    return GPTModel(config)


@pytest.mark.parametrize("kind", ["moe", "full"])
def test_moe_recompute_counts_each_forward_once(kind):
    """--moe-layer-recompute and full recompute: the same loss and gradients over two
    micro-batches (the global aux loss averages the counts of both: the recomputation uses
    its forward's), and the router's token counts, logged losses and averaging window are
    those of two forwards, not four."""
    from mg.core.models.moe import TopKRouter
    from mg.core.models.recompute import apply_moe_layer_recompute

    def two_micro_batches(model):
        model.zero_grad()
        torch.manual_seed(3)
        for _ in range(2):
            ids = torch.randint(0, model.config.vocab_size, (2, 16))
            model(ids, labels=ids).mean().backward()
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        stats = [
            (r.local_tokens_per_expert.clone(), r.ga_steps.clone(), r.pop_losses()) for r in routers
        ]
        return {n: p.grad.clone() for n, p in model.named_parameters()}, stats

    grads, stats = two_micro_batches(_moe_model())
    model = _moe_model()
    if kind == "moe":
        apply_moe_layer_recompute(model)
    else:
        apply_activation_recompute(model, granularity="full", num_layers=1)
    grads_rc, stats_rc = two_micro_batches(model)
    for name, grad in grads.items():  # the same up to the order autograd sums branches in
        torch.testing.assert_close(grads_rc[name], grad, rtol=1e-5, atol=1e-8, msg=name)
    for before, after in zip(stats, stats_rc, strict=True):
        (counts, steps, losses), (counts_rc, steps_rc, losses_rc) = before, after
        assert counts.sum() == 2 * 32 * 2 and torch.equal(counts, counts_rc)  # 2 × T × k
        assert steps == steps_rc == 2
        assert losses.keys() == losses_rc.keys() == {"global_load_balancing_loss", "z_loss"}
        for name in losses:
            torch.testing.assert_close(losses_rc[name], losses[name], rtol=1e-6, atol=0)
    assert all(not r._replay for r in model.modules() if isinstance(r, TopKRouter))
