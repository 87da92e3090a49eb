"""The construction steps compose: each pair gives the numbers of its parts.

`mg.core.parallel.construct` runs one ordered list of steps. These tests build a
tiny GPT through it with two steps at once and check that neither undoes the
other: recompute still recomputes the attention Transformer Engine swapped in
(the stand-in TE of `mg.core.testing.te_standin`, TE's API in plain PyTorch),
compiled TE layers give eager TE's outputs, MoE layers recompute without
counting their tokens twice, and the FP8 exclusion of the first and last layers
holds in their recomputation too. Tensor parallelism × recompute runs on two
ranks in test_construct_parallel.py.

Recompute replays the same arithmetic, so losses and gradients are compared for
equality (within float rounding of a second forward: exactly equal here).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.recompute import Recomputed, UniformlyRecomputedDecoder
from mg.core.models.recompute_state import recomputing
from mg.core.models.te_spec import FP8Options, fp8_autocast
from mg.core.parallel.construct import (
    STEPS,
    ConstructOptions,
    RecomputeOptions,
    construct,
    planned_steps,
)
from mg.core.parallel.layout import ParallelLayout
from mg.core.testing import te_standin
from mg.core.testing.megatron_reference import tiny_config

CPU = torch.device("cpu")
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
LABELS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(4))
RECOMPUTES = {
    "selective": RecomputeOptions("selective"),
    "full uniform": RecomputeOptions("full", "uniform", 2),
    "full block": RecomputeOptions("full", "block", 1),
}


@pytest.fixture
def fake_te(monkeypatch):
    return te_standin.install(monkeypatch)


@pytest.fixture
def attention_calls(monkeypatch) -> list[bool]:
    """`recomputing()` at each call of the stand-in TE attention's forward."""
    calls: list[bool] = []
    forward = te_standin.DotProductAttention.forward

    def counted(self, *args, **kwargs):
        calls.append(recomputing())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(te_standin.DotProductAttention, "forward", counted)
    return calls


def _te(config: TransformerConfig) -> TransformerConfig:
    return dataclasses.replace(config, transformer_impl="transformer_engine")


def _build(config: TransformerConfig, **options) -> torch.nn.Module:
    """The model through `construct` on one process, initialised from seed 0."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPTModel(config)
    return construct(model, ConstructOptions(layout=ParallelLayout(), device=CPU, **options))


def _loss_and_grads(model: torch.nn.Module, fp8: FP8Options | None = None):
    with fp8_autocast(fp8):
        loss = model(IDS, labels=LABELS).sum()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=0)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=0, atol=0, msg=name)


def test_the_order_is_written_once() -> None:
    names = [step.name for step in STEPS]
    assert names == [
        "vocab mask",
        "cross-entropy fusion",
        "FP8 linears (torchao)",
        "tensor parallel",
        "context parallel",
        "pipeline split",
        "materialize",
        "expert parallel",
        "MoE aux-loss groups",
        "Transformer Engine",
        "recompute",
        "compile",
        "fully sharded data parallel",
    ]
    options = ConstructOptions(
        layout=ParallelLayout(),
        device=CPU,
        transformer_engine=True,
        recompute=RECOMPUTES["selective"],
        compile=True,
    )
    assert planned_steps(options) == ["materialize", "Transformer Engine", "recompute", "compile"]


@pytest.mark.parametrize("recompute", sorted(RECOMPUTES))
def test_recompute_wraps_transformer_engines_attention(fake_te, attention_calls, recompute):
    """TE × recompute: the attention TE swapped in runs again in the backward pass, and
    the loss and gradients are those without recompute."""
    config = _te(tiny_config("llama", 2))
    plain = _loss_and_grads(_build(config, transformer_engine=True))
    assert attention_calls == [False, False]  # one forward per layer, nothing recomputed
    attention_calls.clear()
    model = _build(config, transformer_engine=True, recompute=RECOMPUTES[recompute])
    cores = [layer.self_attention.core_attention for layer in model.decoder.layers]
    assert all(isinstance(core, te_standin.DotProductAttention) for core in cores)
    if recompute == "selective":
        assert all(isinstance(core, Recomputed) for core in cores)
    elif recompute == "full uniform":
        assert isinstance(model.decoder, UniformlyRecomputedDecoder)
    else:
        assert isinstance(model.decoder.layers[0], Recomputed)
        assert not isinstance(model.decoder.layers[1], Recomputed)
    _assert_same(_loss_and_grads(model), plain)
    recomputed = 1 if recompute == "full block" else 2  # block: the first layer only
    assert attention_calls.count(False) == 2 and attention_calls.count(True) == recomputed
    # the parameter names are Megatron's TE-spec names, no wrapper in them
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in dict(
        model.named_parameters()
    )


@pytest.mark.slow
def test_compiled_transformer_engine_layers_match_eager(fake_te) -> None:
    """TE × compile: compiling every layer after the swap gives eager TE's numbers (without
    dropout: compiled dropout draws from inductor's own generator)."""
    no_dropout = {"attention_dropout": 0.0, "hidden_dropout": 0.0}
    config = dataclasses.replace(_te(tiny_config("gpt2", 2)), **no_dropout)
    eager = _loss_and_grads(_build(config, transformer_engine=True))
    model = _build(config, transformer_engine=True, compile=True)
    assert all(layer._compiled_call_impl is not None for layer in model.decoder.layers)
    compiled = _loss_and_grads(model)
    torch.testing.assert_close(compiled[0], eager[0], rtol=1e-5, atol=1e-5)
    for name, grad in eager[1].items():
        torch.testing.assert_close(compiled[1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_moe_layers_recompute_and_count_their_tokens_once() -> None:
    """MoE × recompute (the MoE layer and the attention core): the same loss and
    gradients, and the router's token counts for the expert bias are one forward's."""
    config = dataclasses.replace(
        tiny_config("llama", 2),
        num_moe_experts=4,
        moe_ffn_hidden_size=32,
        moe_router_topk=2,
        moe_router_enable_expert_bias=True,
        moe_router_score_function="sigmoid",
        moe_aux_loss_coeff=1e-2,
    )
    plain_model = _build(config)
    plain = _loss_and_grads(plain_model)
    model = _build(config, recompute=RECOMPUTES["selective"], moe_layer_recompute=True)
    _assert_same(_loss_and_grads(model), plain)

    def counts(m):
        return [b.clone() for n, b in m.named_buffers() if n.endswith("local_tokens_per_expert")]

    assert counts(model) and all(
        torch.equal(a, b) for a, b in zip(counts(model), counts(plain_model), strict=True)
    )


def test_first_and_last_layers_stay_outside_fp8_when_recomputed(fake_te) -> None:
    """FP8 × first/last layers in bf16 × recompute: the layers kept out of FP8 run
    without it in their recomputation too, and the numbers are unchanged."""
    config = _te(tiny_config("llama", 4))
    fp8 = FP8Options(bf16_layers=(0, 3))
    plain = _loss_and_grads(_build(config, transformer_engine=True, fp8=fp8), fp8)
    assert [on for on, _ in fake_te.autocasts] == [True, False, False]
    fake_te.autocasts.clear()
    recomputed = RecomputeOptions("full", "block", 4)  # every layer stores its input only
    model = _build(config, transformer_engine=True, fp8=fp8, recompute=recomputed)
    _assert_same(_loss_and_grads(model, fp8), plain)
    # the forward (FP8 on, layers 1 and 4 off), then layers 4 and 1 again in the backward
    assert [on for on, _ in fake_te.autocasts] == [True, False, False, False, False]
