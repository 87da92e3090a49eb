"""The MoE router against values worked out by hand (top-k, scores, losses, capacity, bias)."""

from __future__ import annotations

import math

import pytest
import torch

from mg.core.models import TransformerConfig
from mg.core.models.moe.router import (
    AuxLossBackward,
    TopKRouter,
    drop_to_capacity,
    expert_capacity,
    group_limited_topk,
    switch_load_balancing_loss,
    topk_routing,
    z_loss,
)


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_softmax_over_the_selected_logits():
    probs, routing_map = topk_routing(torch.tensor([[1.0, 2.0, 3.0, 0.0]]), 2)
    e = math.e
    assert routing_map.tolist() == [[False, True, True, False]]
    torch.testing.assert_close(probs, torch.tensor([[0.0, 1 / (1 + e), e / (1 + e), 0.0]]))


def test_pre_softmax_is_over_all_experts_and_scaling_multiplies():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    probs, _ = topk_routing(logits, 2, pre_softmax=True, scaling_factor=2.5)
    z = sum(math.exp(v) for v in (1, 2, 3, 0))
    expected = torch.tensor([[0.0, math.exp(2) / z, math.exp(3) / z, 0.0]]) * 2.5
    torch.testing.assert_close(probs, expected)


def test_sigmoid_with_expert_bias_changes_the_choice_not_the_weights():
    logits = torch.tensor([[0.0, 0.5, 1.0, -1.0]])
    bias = torch.tensor([0.6, 0.0, 0.0, 0.0])
    probs, routing_map = topk_routing(logits, 2, score_function="sigmoid", expert_bias=bias)
    assert routing_map.tolist() == [[True, False, True, False]]  # 0.5 + 0.6 beats sigmoid(0.5)
    s0, s2 = 0.5, _sigmoid(1.0)
    torch.testing.assert_close(probs, torch.tensor([[s0 / (s0 + s2), 0.0, s2 / (s0 + s2), 0.0]]))


def test_group_limited_routing_picks_within_the_best_group():
    # groups {0,1} and {2,3}; top-1 group by its best 2 scores: 0.9 + 0.0 < 0.5 + 0.45
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.45]])
    values, indices = group_limited_topk(scores, topk=2, num_groups=2, group_topk=1)
    assert sorted(indices.tolist()[0]) == [2, 3]
    # sigmoid keeps the order of group sums here: .711 + .5 < .622 + .611
    _, routing_map = topk_routing(scores, 2, score_function="sigmoid", num_groups=2, group_topk=1)
    assert routing_map.tolist() == [[False, False, True, True]]


def test_capacity_drops_by_probability_or_by_position_and_pads():
    # 4 tokens all routed (top-1) to expert 0 of 2: capacity ceil(4·1/2·1.0) = 2
    probs = torch.tensor([[0.6, 0.0], [0.9, 0.0], [0.7, 0.0], [0.8, 0.0]])
    routing_map = probs > 0
    assert expert_capacity(4, 2, 1, 1.0) == 2
    by_probs, map_probs = drop_to_capacity(probs, routing_map, 1, 1.0, "probs")
    assert map_probs[:, 0].tolist() == [False, True, False, True]
    torch.testing.assert_close(by_probs[:, 0], torch.tensor([0.0, 0.9, 0.0, 0.8]))
    _, map_position = drop_to_capacity(probs, routing_map, 1, 1.0, "position")
    assert map_position[:, 0].tolist() == [True, True, False, False]
    padded_probs, padded = drop_to_capacity(probs, routing_map, 1, 1.0, "position", True)
    assert padded.sum(dim=0).tolist() == [2, 2]  # expert 1 gets two rows of weight 0
    assert padded[:, 1].tolist() == [True, True, False, False]
    assert padded_probs[:, 1].tolist() == [0.0] * 4
    # a capacity above the token count keeps everything
    assert drop_to_capacity(probs, routing_map, 1, 3.0)[1].equal(routing_map)


def test_switch_load_balancing_loss_by_hand():
    # T = 2 tokens, E = 2, k = 1, both to expert 0 with score s: loss = E·c/(k·T²)·(2s·2) = 2cs
    s = math.e / (1 + math.e)
    scores = torch.tensor([[s, 1 - s], [s, 1 - s]])
    loss = switch_load_balancing_loss(scores, torch.tensor([2.0, 0.0]), 2, 1, 2, 0.1)
    assert loss.item() == pytest.approx(2 * 0.1 * s)
    # perfectly balanced uniform routing gives coeff exactly
    uniform = torch.full((4, 4), 0.25)
    balanced = switch_load_balancing_loss(uniform, torch.full((4,), 2.0), 4, 2, 4, 0.3)
    assert balanced.item() == pytest.approx(0.3)


def test_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = 0.01 * (math.log(2) ** 2 + math.log(4) ** 2) / 2
    assert z_loss(logits, 0.01).item() == pytest.approx(expected)


def _config(**moe) -> TransformerConfig:
    base = dict(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16)
    base.update(add_bias_linear=False, num_moe_experts=4, moe_router_topk=2)
    return TransformerConfig(**{**base, **moe})


def _router(**moe) -> TopKRouter:
    torch.manual_seed(0)
    router = TopKRouter(_config(**moe))
    router.init_weights(0.5)
    return router.train()


def test_router_aux_and_z_loss_gradients_are_their_own():
    """With the main loss ignoring the router, the weight's gradient is exactly that of
    aux loss + z-loss computed explicitly (AuxLossBackward scale 1)."""
    router = _router(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01)
    tokens = torch.randn(6, 8)
    probs, _ = router(tokens, seq_length=3)
    (probs * 0).sum().backward()
    from_router = router.weight.grad.clone()

    weight = router.weight.detach().clone().requires_grad_()
    logits = tokens @ weight.T
    scores = torch.softmax(logits, dim=-1)
    chosen = torch.zeros_like(scores).scatter(1, scores.topk(2, dim=1)[1], 1.0)
    aux = switch_load_balancing_loss(scores, chosen.sum(0), 6, 2, 4, 0.1)
    (aux + z_loss(logits, 0.01)).backward()
    torch.testing.assert_close(from_router, weight.grad)
    assert router.losses["load_balancing_loss"].item() == pytest.approx(aux.item() / 0.1)
    assert set(router.losses) == {"load_balancing_loss", "z_loss"}


def test_aux_loss_gradient_scale_follows_the_training_loop():
    router = _router(moe_aux_loss_coeff=0.1)
    tokens = torch.randn(6, 8)
    router(tokens, seq_length=6)[0].mul(0).sum().backward()
    unit = router.weight.grad.clone()
    router.weight.grad = None
    AuxLossBackward.scale = 0.25
    try:
        router(tokens, seq_length=6)[0].mul(0).sum().backward()
    finally:
        AuxLossBackward.scale = 1.0
    torch.testing.assert_close(router.weight.grad, unit * 0.25)


def test_sequence_aux_loss_is_the_mean_over_sequences():
    router = _router(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="seq_aux_loss")
    s, b = 5, 2
    tokens = torch.randn(s * b, 8)  # rows in [s, b] order
    router(tokens, seq_length=s)
    logits = tokens @ router.weight.detach().T
    per_sequence = []
    for i in range(b):
        scores = torch.softmax(logits.view(s, b, 4)[:, i], dim=-1)
        chosen = torch.zeros_like(scores).scatter(1, scores.topk(2, dim=1)[1], 1.0)
        per_sequence.append(switch_load_balancing_loss(scores, chosen.sum(0), s, 2, 4, 1.0))
    expected = sum(per_sequence) / b
    assert router.losses["seq_load_balancing_loss"].item() == pytest.approx(expected.item())


def test_no_losses_in_eval_or_without_grad():
    router = _router(moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01).eval()
    router(torch.randn(4, 8), seq_length=4)
    assert router.losses == {}


def test_expert_bias_update_by_hand():
    router = _router(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    assert "expert_bias" in router.state_dict()
    assert "local_tokens_per_expert" not in router.state_dict()
    router.local_tokens_per_expert.copy_(torch.tensor([3.0, 1.0, 0.0, 4.0]))  # mean 2
    router.update_expert_bias()
    torch.testing.assert_close(router.expert_bias, torch.tensor([-1.0, 1.0, 1.0, -1.0]) * 1e-3)
    assert router.local_tokens_per_expert.sum() == 0
    # counting: every token adds its k experts
    router(torch.randn(5, 8), seq_length=5)
    assert router.local_tokens_per_expert.sum().item() == 10


def test_router_dtype_fp32_from_bf16_activations():
    router = _router(moe_router_dtype="fp32")
    probs, _ = router(torch.randn(4, 8, dtype=torch.bfloat16), seq_length=4)
    assert probs.dtype == torch.float32


def test_sinkhorn_routing_selects_topk_and_takes_no_aux_loss():
    router = _router(moe_router_load_balancing_type="sinkhorn")
    probs, routing_map = router(torch.randn(8, 8), seq_length=8)
    assert routing_map.sum(dim=1).tolist() == [2] * 8
    assert ((probs > 0) == routing_map).all()


def test_force_load_balancing_routes_by_random_logits_with_a_straight_through_gradient():
    """--moe-router-force-load-balancing: identical tokens (which a learned router sends to
    the same two experts) spread over all four experts about evenly, and the gating
    weight's gradient is the one the random logits pass straight through."""
    router = _router(moe_router_force_load_balancing=True)
    tokens = torch.randn(1, 8).expand(4000, 8).contiguous()
    torch.manual_seed(1)
    probs, routing_map = router(tokens, seq_length=4000)
    counts = routing_map.sum(0).float()
    assert counts.sum() == 8000
    assert (counts - 2000).abs().max() < 150  # a learned router: [4000, 4000, 0, 0]
    torch.manual_seed(1)
    random_logits = torch.randn(4000, 4)
    scores = torch.softmax(random_logits, dim=-1)
    top, index = scores.topk(2, dim=-1)
    expected = torch.zeros_like(scores).scatter(1, index, top / top.sum(-1, keepdim=True))
    torch.testing.assert_close(probs, expected)
    upstream = torch.randn_like(probs)
    (probs * upstream).sum().backward()
    logits = random_logits.clone().requires_grad_()
    s = torch.softmax(logits, dim=-1)
    t = s.gather(1, index)
    (torch.zeros_like(s).scatter(1, index, t / t.sum(-1, keepdim=True)) * upstream).sum().backward()
    torch.testing.assert_close(router.weight.grad, logits.grad.T @ tokens)
