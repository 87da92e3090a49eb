"""The MoE layer: sequential and grouped experts agree, and it equals megatron-core 0.16's
`MoELayer` (CPU, same weights and tokens, forward and gradients) and transformers'
Mixtral / Qwen3-MoE / Qwen2-MoE sparse blocks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from mg.core.models import TransformerConfig
from mg.core.models.gpt import GPTModel
from mg.core.models.moe import AuxLossBackward, MoELayer

BASE = dict(num_layers=2, hidden_size=16, num_attention_heads=4, vocab_size=64, ffn_hidden_size=32)


def _config(**fields) -> TransformerConfig:
    moe = dict(num_moe_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2)
    return TransformerConfig(**{**BASE, **moe, **fields})


def _layer(config: TransformerConfig, seed: int = 0) -> MoELayer:
    layer = MoELayer(config)
    torch.manual_seed(seed)  # after construction: nn.Linear draws its own init there
    layer.init_weights(0.2, 0.1)
    return layer.train()


def _run(layer: torch.nn.Module, x: torch.Tensor, out_grad: torch.Tensor) -> tuple:
    x = x.clone().requires_grad_()
    out = layer(x)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(out_grad)
    return out.detach(), x.grad


@pytest.mark.parametrize(
    "fields",
    [
        dict(activation="swiglu", add_bias_linear=False, moe_aux_loss_coeff=0.01),
        dict(activation="gelu", add_bias_linear=True, moe_shared_expert_intermediate_size=12),
    ],
    ids=["swiglu", "gelu-bias-shared"],
)
def test_grouped_experts_equal_sequential(fields):
    sequential = _layer(_config(**fields))
    grouped = _layer(_config(**fields, moe_grouped_gemm=True))
    names = set(grouped.state_dict())
    assert "experts.linear_fc1.weight3" in names and "experts.linear_fc2.weight0" in names
    # same values, names mapped local_experts.E.linear_fcN.weight -> linear_fcN.weightE
    for e in range(4):
        for fc in ("linear_fc1", "linear_fc2"):
            torch.testing.assert_close(
                getattr(getattr(grouped.experts, fc), f"weight{e}"),
                getattr(sequential.experts.local_experts[e], fc).weight,
                rtol=0,
                atol=0,
            )
    x, g = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    out_s, dx_s = _run(sequential, x, g)
    out_g, dx_g = _run(grouped, x, g)
    torch.testing.assert_close(out_g, out_s, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx_g, dx_s, rtol=1e-6, atol=1e-6)
    for e in range(4):
        torch.testing.assert_close(
            grouped.experts.linear_fc1.get_parameter(f"weight{e}").grad,
            sequential.experts.local_experts[e].linear_fc1.weight.grad,
            rtol=1e-5,
            atol=1e-6,
        )


def test_gpt_layers_follow_moe_layer_freq_and_megatron_names():
    torch.manual_seed(0)
    model = GPTModel(_config(moe_layer_freq=[0, 1], add_bias_linear=False))
    names = set(model.state_dict())
    assert "decoder.layers.0.mlp.linear_fc1.weight" in names
    assert "decoder.layers.1.mlp.router.weight" in names
    assert "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight" in names
    ids = torch.randint(0, 64, (2, 6))
    assert model(ids).shape == (2, 6, 64)


def test_capacity_padding_keeps_outputs_of_kept_tokens():
    """Padding rows carry probability 0: padded and unpadded drop give the same output."""
    dropped = _layer(_config(moe_expert_capacity_factor=0.5, add_bias_linear=False))
    padded = _layer(
        _config(
            moe_expert_capacity_factor=0.5,
            moe_pad_expert_input_to_capacity=True,
            add_bias_linear=False,
        )
    )
    x = torch.randn(2, 8, 16)
    torch.testing.assert_close(padded(x), dropped(x))


# megatron-core 0.16.1's MoELayer on CPU ------------------------------------------------


@pytest.fixture(autouse=True)
def _unit_aux_loss_scale():
    """The balancing losses' gradient at scale 1, as megatron-core's is by default (a
    training step elsewhere in the session leaves its loss scale / micro-batches)."""
    AuxLossBackward.scale = 1.0
    yield
    AuxLossBackward.scale = 1.0


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    from mg.core.testing.megatron_reference import megatron_on_cpu

    pytest.importorskip("megatron.core")
    import megatron.core.transformer.moe.moe_utils as moe_utils

    with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
        # 0.16.1 reads this name unguarded when Transformer Engine is absent
        patch = pytest.MonkeyPatch()
        patch.setattr(moe_utils, "te_general_gemm", None, raising=False)
        yield
        patch.undo()


_MOE_FIELDS = [f.name for f in dataclasses.fields(TransformerConfig) if f.name.startswith("moe_")]


def _megatron_moe_layer(ours: TransformerConfig):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import (
        TransformerConfig as MegatronTransformerConfig,
    )

    gated = ours.gated_linear_unit
    config = MegatronTransformerConfig(
        num_layers=ours.num_layers,
        hidden_size=ours.hidden_size,
        num_attention_heads=ours.num_attention_heads,
        ffn_hidden_size=ours.ffn_hidden_size,
        gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
        add_bias_linear=ours.add_bias_linear,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        transformer_impl="local",
        num_moe_experts=ours.num_moe_experts,
        **{name: getattr(ours, name) for name in _MOE_FIELDS},
    )
    spec = get_gpt_layer_local_spec(
        num_experts=ours.num_moe_experts, moe_grouped_gemm=ours.moe_grouped_gemm
    )
    return build_module(spec.submodules.mlp, config=config, layer_number=1).train()


MEGATRON_CASES = {
    "softmax-aux-z": dict(
        activation="swiglu", add_bias_linear=False, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3
    ),
    # (expert biases are left out: 0.16.1's expert MLP adds its bias in place on a view
    # of _ReduceFromModelParallelRegion's output, which autograd refuses at TP = 1)
    "sigmoid-aux-scaling": dict(
        activation="gelu",
        add_bias_linear=False,
        moe_router_score_function="sigmoid",
        moe_router_topk_scaling_factor=2.0,
        moe_aux_loss_coeff=0.02,
    ),
    "presoftmax-seqaux-shared-gate": dict(
        activation="swiglu",
        add_bias_linear=False,
        moe_router_pre_softmax=True,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=0.01,
        moe_shared_expert_intermediate_size=12,
        moe_shared_expert_gate=True,
    ),
    "capacity-probs": dict(
        activation="swiglu",
        add_bias_linear=False,
        moe_aux_loss_coeff=0.01,
        moe_expert_capacity_factor=0.75,
    ),
    "sigmoid-expert-bias-groups": dict(
        activation="swiglu",
        add_bias_linear=False,
        num_moe_experts=8,
        moe_router_topk=4,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_dtype="fp32",
    ),
}


@pytest.mark.compat
@pytest.mark.parametrize("name", sorted(MEGATRON_CASES))
def test_equals_megatron_core_moe_layer(megatron, name):
    config = _config(**MEGATRON_CASES[name])
    ours = _layer(config)
    if ours.router.expert_bias is not None:  # a bias that changes some choices
        ours.router.expert_bias.copy_(torch.linspace(-0.05, 0.05, config.num_moe_experts))
    reference = _megatron_moe_layer(config)
    theirs = {k for k in reference.state_dict() if not k.endswith("_extra_state")}
    assert theirs == set(ours.state_dict())
    reference.load_state_dict(ours.state_dict(), strict=False)

    torch.manual_seed(1)
    x, g = torch.randn(3, 7, 16), torch.randn(3, 7, 16)
    out, dx = _run(ours, x, g)
    # Megatron's activations are [s, b, h]
    ref_out, ref_dx = _run(reference, x.transpose(0, 1).contiguous(), g.transpose(0, 1))
    torch.testing.assert_close(out, ref_out.transpose(0, 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx.transpose(0, 1), rtol=1e-5, atol=1e-6)
    ref_params = dict(reference.named_parameters())
    for key, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[key].grad, rtol=1e-5, atol=1e-6)
    if ours.router.expert_bias is not None:
        torch.testing.assert_close(
            ours.router.local_tokens_per_expert, reference.router.local_tokens_per_expert
        )


# transformers' sparse MoE blocks -------------------------------------------------------


def _hf_experts_into(layer: MoELayer, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    for e, expert in enumerate(layer.experts.local_experts):
        expert.linear_fc1.weight.copy_(gate_up[e])
        expert.linear_fc2.weight.copy_(down[e])


@pytest.mark.compat
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen3_moe_unnormalised", "qwen2_moe"])
@torch.no_grad()
def test_equals_transformers_sparse_block(family):
    transformers = pytest.importorskip("transformers")
    common = dict(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_hidden_layers=1)
    fields = dict(activation="swiglu", add_bias_linear=False, moe_router_topk=2)
    if family == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

        hf_config = transformers.MixtralConfig(
            **common, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0
        )
        block = MixtralSparseMoeBlock(hf_config)
        config = _config(**fields, moe_ffn_hidden_size=24)
    elif family.startswith("qwen3_moe"):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        normalised = family == "qwen3_moe"
        hf_config = transformers.Qwen3MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            norm_topk_prob=normalised,
        )
        block = Qwen3MoeSparseMoeBlock(hf_config)
        # renormalised top-k of the full softmax is the softmax over the top-k logits
        config = _config(**fields, moe_router_pre_softmax=not normalised)
    else:
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

        hf_config = transformers.Qwen2MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=8,
            shared_expert_intermediate_size=12,
            norm_topk_prob=False,
        )
        block = Qwen2MoeSparseMoeBlock(hf_config)
        config = _config(
            **fields,
            moe_router_pre_softmax=True,
            moe_shared_expert_intermediate_size=12,
            moe_shared_expert_gate=True,
        )
    torch.manual_seed(0)
    for p in block.parameters():
        p.normal_(0.0, 0.3)
    layer = MoELayer(config).eval()
    layer.router.weight.copy_(block.gate.weight)
    _hf_experts_into(layer, block.experts.gate_up_proj, block.experts.down_proj)
    if family == "qwen2_moe":
        shared = layer.shared_experts
        mlp = block.shared_expert
        shared.linear_fc1.weight.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        shared.linear_fc2.weight.copy_(mlp.down_proj.weight)
        shared.gate_weight.copy_(block.shared_expert_gate.weight)
    x = torch.randn(2, 9, 16)
    torch.testing.assert_close(layer(x), block.eval()(x), rtol=1e-5, atol=1e-6)


def test_grouped_mm_kernel_equals_the_expert_loop():
    """The CUDA path (one torch._grouped_mm) checked on CPU, where the kernel also runs;
    an expert with no tokens included, gradients through the stacked weights."""
    from mg.core.models.moe.experts import grouped_linear, grouped_mm_linear

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch without _grouped_mm")
    torch.manual_seed(0)
    x = torch.randn(10, 8, requires_grad=True)
    weights = [torch.randn(4, 8, requires_grad=True) for _ in range(3)]
    counts = [3, 0, 7]
    out = grouped_mm_linear(x, weights, counts)
    out.sum().backward()  # an expanded gradient: the kernel needs it contiguous
    grads = [x.grad.clone()] + [w.grad.clone() for w in weights]
    for t in [x, *weights]:
        t.grad = None
    ref = grouped_linear(x, weights, counts)  # the per-expert loop on CPU
    ref.sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, [x.grad] + [w.grad for w in weights], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_moe_gpt_decodes_token_by_token_like_a_full_forward():
    """Routing is per token, so cached decoding (mg-serve's path) equals the full forward."""
    from mg.core.models.kv_cache import KVCache

    config = _config(
        activation="swiglu",
        add_bias_linear=False,
        position_embedding_type="rope",
        normalization="RMSNorm",
        attention_dropout=0.0,
        hidden_dropout=0.0,
        moe_shared_expert_intermediate_size=12,
        moe_grouped_gemm=True,
    )
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    ids = torch.randint(0, 64, (1, 14), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cache = KVCache.for_model(model, num_slots=1, max_length=16)
    cache.bind(torch.tensor([0]), torch.tensor([0]))
    steps = [model(ids[:, :8], torch.arange(8)[None], inference_cache=cache)]
    for pos in range(8, 14):
        cache.bind(torch.tensor([0]), torch.tensor([pos]))
        steps.append(model(ids[:, pos : pos + 1], torch.tensor([[pos]]), inference_cache=cache))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
