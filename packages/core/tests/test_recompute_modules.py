"""Megatron's selective `recompute_modules`, each of them: the same loss and gradients as
without recompute (fp32, dropout on: the recomputations replay it), and less activation
memory held between the forward and the backward pass (the bytes of the tensors autograd
keeps for the backward pass, parameters aside, measured once the forward has returned:
an output-discarding checkpoint's freed outputs hold none)."""

from __future__ import annotations

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.core.models.moe import AuxLossBackward
from mg.core.models.recompute import RECOMPUTE_MODULES, apply_recompute_modules

MLA = dict(
    multi_latent_attention=True,
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=24,  # the query's and key's head size: SDPA's flash kernel (on the CPU too),
    qk_layernorm=True,  # which saves the query, key and value themselves
    position_embedding_type="rope",
)
MOE = dict(
    num_moe_experts=4,
    moe_ffn_hidden_size=16,
    moe_router_topk=2,
    moe_layer_freq=[0, 1],  # a dense layer, then an MoE layer
    moe_grouped_gemm=True,
    moe_shared_expert_intermediate_size=16,
    moe_aux_loss_coeff=1e-2,
)


def _config(te: bool = False, **fields):
    """DeepSeek-V3's kind in small: MLA with latent norms, a dense layer then an MoE layer
    with grouped-GEMM and shared experts."""
    impl = "transformer_engine" if te else "local"
    shape = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=4)
    dropout = dict(attention_dropout=0.1, hidden_dropout=0.1)
    return presets.tiny_llama(transformer_impl=impl, **(shape | dropout | MLA | MOE | fields))


def _model(config) -> GPTModel:
    AuxLossBackward.scale = 1.0
    torch.manual_seed(0)
    return GPTModel(config)


def _tokens(config) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (2, 33), generator=torch.Generator().manual_seed(5))


def _loss_and_grads(model: GPTModel, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    torch.manual_seed(1)  # the same dropout masks in both runs
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _held_bytes(model: GPTModel, tokens: torch.Tensor) -> int:
    """Bytes of the tensors autograd keeps for the backward pass once the forward has
    returned (each storage once; parameters not counted)."""
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    storages = {}
    for tensor in saved:
        storage = tensor.untyped_storage()
        if storage._cdata not in params:
            storages[storage._cdata] = storage.nbytes()
    loss.backward()  # the discarded outputs come back for it
    return sum(storages.values())


# bitwise where the recomputed region's gradients are summed with the other branches'
# in the order they were without recompute. Elsewhere the order differs (1e-7 relative):
# a norm's input gradient is summed inside the region before the residual branch's is
# added (without recompute the terms interleave), and a checkpointed MoE layer or shared
# experts hand theirs back from inside the checkpoint.
BITWISE = {"core_attn", "moe_act", "mla_up_proj", "mlp"}


@pytest.mark.parametrize("name", RECOMPUTE_MODULES)
def test_each_module_recomputes_to_the_same_loss_and_gradients(name: str) -> None:
    config = _config()
    tokens = _tokens(config)
    model = _model(config)
    loss, grads = _loss_and_grads(model, tokens)
    apply_recompute_modules(model, [name])
    loss_rc, grads_rc = _loss_and_grads(model, tokens)
    if name in BITWISE:
        assert torch.equal(loss_rc, loss)
        for key, grad in grads.items():
            assert torch.equal(grads_rc[key], grad), key
    else:
        torch.testing.assert_close(loss_rc, loss, rtol=1e-6, atol=0)
        for key, grad in grads.items():
            torch.testing.assert_close(grads_rc[key], grad, rtol=1e-5, atol=1e-8, msg=key)


@pytest.mark.parametrize("name", RECOMPUTE_MODULES)
def test_each_module_holds_less_activation_memory(name: str) -> None:
    config = _config(attention_dropout=0.0, hidden_dropout=0.0)
    tokens = _tokens(config)
    model = _model(config)
    before = _held_bytes(model, tokens)
    apply_recompute_modules(model, [name])
    after = _held_bytes(model, tokens)
    assert after < before, (name, after, before)


def test_all_modules_together_under_the_te_spec_match(monkeypatch) -> None:
    """Every module at once, on the TE-spec model with Transformer Engine's modules swapped
    in first (the stand-in package), as the construction pipeline orders them: the same
    loss and gradients as without recompute, and the switches survive the swap."""
    from mg.core.models.te_spec import apply_transformer_engine
    from mg.core.testing import te_standin

    te_standin.install(monkeypatch)
    config = _config(te=True)
    tokens = _tokens(config)
    model = _model(config)
    apply_transformer_engine(model)
    loss, grads = _loss_and_grads(model, tokens)
    apply_recompute_modules(model, RECOMPUTE_MODULES)
    layer = model.decoder.layers[1]
    assert layer.self_attention.recompute_up_proj and layer.mlp.experts.recompute_activation
    assert layer.recompute_input_layernorm and layer.recompute_pre_mlp_layernorm
    assert isinstance(layer.self_attention.core_attention, te_standin.DotProductAttention)
    assert getattr(layer.self_attention.core_attention, "_mg_recompute", False)
    assert getattr(model.decoder.layers[0].mlp, "_mg_module_recompute", False)
    loss_rc, grads_rc = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss_rc, loss, rtol=1e-6, atol=0)
    for key, grad in grads.items():
        torch.testing.assert_close(grads_rc[key], grad, rtol=1e-5, atol=1e-8, msg=key)


def test_megatrons_rules() -> None:
    with pytest.raises(ValueError, match="mla_up_proj needs multi-latent attention"):
        apply_recompute_modules(GPTModel(presets.tiny_llama()), ["mla_up_proj"])
    sequential = _model(_config(moe_grouped_gemm=False))
    with pytest.raises(ValueError, match="moe_act needs the grouped-GEMM experts"):
        apply_recompute_modules(sequential, ["moe_act"])
    with pytest.raises(ValueError, match="not among"):
        apply_recompute_modules(sequential, ["attention"])


def test_no_gradients_no_checkpoint() -> None:
    """Evaluation (no autograd): the discarding regions run as plain calls."""
    config = _config(attention_dropout=0.0, hidden_dropout=0.0)
    tokens = _tokens(config)
    model = _model(config).eval()
    with torch.no_grad():
        before = model(tokens)
        apply_recompute_modules(model, ["layernorm", "mla_up_proj", "moe_act"])
        assert torch.equal(model(tokens), before)


def test_construction_pipeline_applies_them_after_transformer_engine(monkeypatch) -> None:
    """Through `construct` (Transformer Engine's step, then recompute's): TE's modules are
    in place, each recompute switch is on, and the loss and gradients are those of the
    same construction without recompute."""
    from mg.core.parallel.construct import ConstructOptions, RecomputeOptions, construct
    from mg.core.parallel.layout import ParallelLayout
    from mg.core.testing import te_standin

    te_standin.install(monkeypatch)
    config = _config(te=True, attention_dropout=0.0, hidden_dropout=0.0)
    tokens = _tokens(config)

    def build(recompute: RecomputeOptions | None) -> GPTModel:
        AuxLossBackward.scale = 1.0
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPTModel(config)
        options = ConstructOptions(
            layout=ParallelLayout(),
            device=torch.device("cpu"),
            transformer_engine=True,
            recompute=recompute,
            moe_layer_recompute=recompute is not None,
        )
        return construct(model, options)

    plain = build(None)
    modules = tuple(m for m in RECOMPUTE_MODULES if m != "moe")
    model = build(RecomputeOptions("selective", modules=modules))
    dense, moe = model.decoder.layers
    assert isinstance(dense.self_attention.linear_kv_up_proj, te_standin.LayerNormLinear)
    assert isinstance(dense.mlp.linear_fc1, te_standin.LayerNormLinear)
    assert dense.self_attention.recompute_up_proj and moe.mlp.experts.recompute_activation
    assert getattr(dense.mlp, "_mg_module_recompute", False)
    assert getattr(moe.mlp, "_mg_moe_recompute", False)
    assert getattr(moe.mlp.shared_experts, "_mg_module_recompute", False)
    loss, grads = _loss_and_grads(plain, tokens)
    loss_rc, grads_rc = _loss_and_grads(model, tokens)
    torch.testing.assert_close(loss_rc, loss, rtol=1e-6, atol=0)
    for key, grad in grads.items():
        torch.testing.assert_close(grads_rc[key], grad, rtol=1e-5, atol=1e-8, msg=key)


@pytest.mark.parametrize("name", ["layernorm", "mla_up_proj", "moe_act"])
def test_output_discarding_recompute_under_autocast(name: str) -> None:
    """bf16 autocast (the backward pass runs outside it): the recomputation runs under the
    forward's autocast, so it refills the outputs with the forward's values and dtypes.
    The same loss; the same gradients but for a norm's (summed in another order: one
    bf16 rounding)."""
    config = _config(attention_dropout=0.0, hidden_dropout=0.0)
    tokens = _tokens(config)

    def run(model: GPTModel) -> tuple[torch.Tensor, dict]:
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16):
            loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    model = _model(config)
    loss, grads = run(model)
    apply_recompute_modules(model, [name])
    loss_rc, grads_rc = run(model)
    assert torch.equal(loss_rc, loss)
    for key, grad in grads.items():
        if name == "layernorm":
            scale = float(grad.abs().max()) or 1.0
            assert float((grads_rc[key] - grad).abs().max()) <= 2**-6 * scale, key
        else:
            assert torch.equal(grads_rc[key], grad), key
