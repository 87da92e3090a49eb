"""Multi-token prediction: the MTP losses and gradients equal megatron-core 0.16.1's.

Megatron-Core's GPTModel (local spec) with its `MultiTokenPredictionBlock` builds on
CPU (gloo, one process; `mg.core.testing.megatron_reference` patches its three CUDA
assumptions). Its weights load into our GPTModel with `strict=True` (the `mtp.layers.{k}`
names and shapes are Megatron's); Megatron reports each depth's masked mean loss to its
`MTPLossLoggingHelper` tracker in training mode, and its `MTPLossAutoScaler` adds the
depths' gradients (scaling factor / D each) to the main loss's, which we compare too.
"""

import pytest
import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.mtp import roll_left

CONFIGS = {
    # Llama-like: RoPE, RMSNorm, SwiGLU, untied, GQA (DeepSeek-V3's dense parts)
    "llama": dict(
        position_embedding_type="rope",
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        num_query_groups=2,
        untie_embeddings_and_output_weights=True,
    ),
    # GPT-2-like: learned positions (rolled with the tokens), LayerNorm, tied output
    "gpt2": dict(normalization="LayerNorm"),
}


def tiny(shape: str, depths: int = 2) -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        ffn_hidden_size=48,
        vocab_size=64,
        seq_length=12,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        mtp_num_layers=depths,
        mtp_loss_scaling_factor=0.3,
        **CONFIGS[shape],
    )


def mtp_objective(model: GPTModel, ids, labels, mask) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Megatron's objective: masked mean + factor/D × Σ_k (depth k's masked mean)."""
    main, mtp = model(ids, labels=labels, return_mtp=True)
    assert mtp.scaling_factor == model.config.mtp_loss_scaling_factor
    total = (main * mask).sum() / mask.sum()
    means = []
    mask_k = mask
    for depth in mtp.per_token:  # by hand, then as MTPLosses.depth_means does it
        mask_k = roll_left(mask_k)
        means.append((depth * mask_k).sum() / mask_k.sum())
    torch.testing.assert_close(torch.stack(mtp.depth_means(mask)), torch.stack(means))
    scale = mtp.scaling_factor / len(means)
    return total + scale * sum(means), means


def test_block_shapes_names_and_init():
    config = tiny("llama")
    torch.manual_seed(0)
    model = GPTModel(config)
    names = [n for n in model.state_dict() if n.startswith("mtp.layers.1.")]
    assert "mtp.layers.1.eh_proj.weight" in names
    assert model.mtp.layers[1].eh_proj.weight.shape == (32, 64)
    assert model.mtp.layers[1].transformer_layer.layer_number == 4  # num_layers + k
    assert {"mtp.layers.1.enorm.weight", "mtp.layers.1.hnorm.weight"} <= set(names)
    assert "mtp.layers.1.final_layernorm.weight" in names
    # Megatron's init: eh_proj N(0, σ), the layer's output projections σ/√(2L)
    std = model.mtp.layers[0].eh_proj.weight.std().item()
    assert 0.017 < std < 0.023
    proj = model.mtp.layers[0].transformer_layer.self_attention.linear_proj.weight.std().item()
    assert 0.007 < proj < 0.013  # 0.02 / √4
    ids = torch.randint(0, 64, (2, 12))
    assert model(ids).shape == (2, 12, 64)  # logits: the MTP block does not change them


def test_rolled_targets_by_hand():
    """Depth k at position i is scored against labels[i + k]: check it with the head."""
    config = tiny("llama", depths=1)
    torch.manual_seed(1)
    model = GPTModel(config).eval()
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    labels = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        _, mtp = model(ids, labels=labels, return_mtp=True)
        positions = torch.arange(12).expand(1, 12)
        hidden = model.run_decoder(model.embedding(ids, positions), positions, None)
        embedded = model.embedding(roll_left(ids), roll_left(positions))
        rotary = model.rotary_pos_emb(positions)
        depth = model.mtp.layers[0](hidden, embedded, rotary, None)
        logits = depth @ model.output_layer.weight.T
        expected = torch.nn.functional.cross_entropy(
            logits[0], roll_left(labels)[0], reduction="none"
        )
    torch.testing.assert_close(mtp.per_token[0, 0], expected, rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    pytest.importorskip("megatron.core")
    from mg.core.testing.megatron_reference import megatron_on_cpu

    with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
        yield


def megatron_mtp_model(ours: TransformerConfig):
    """Megatron-Core's GPTModel with an MTP block (local spec), dropout off."""
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_mtp_block_spec,
    )
    from megatron.core.models.gpt.gpt_model import GPTModel as MegatronGPTModel
    from megatron.core.transformer.transformer_config import (
        TransformerConfig as MegatronTransformerConfig,
    )

    gated = ours.gated_linear_unit
    config = MegatronTransformerConfig(
        num_layers=ours.num_layers,
        hidden_size=ours.hidden_size,
        num_attention_heads=ours.num_attention_heads,
        num_query_groups=ours.num_query_groups,
        ffn_hidden_size=ours.ffn_hidden_size,
        kv_channels=ours.kv_channels,
        normalization=ours.normalization,
        layernorm_epsilon=ours.layernorm_epsilon,
        gated_linear_unit=gated,
        activation_func=F.silu if gated else F.gelu,
        add_bias_linear=ours.add_bias_linear,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        transformer_impl="local",
        mtp_num_layers=ours.mtp_num_layers,
        mtp_loss_scaling_factor=ours.mtp_loss_scaling_factor,
    )
    spec = get_gpt_layer_local_spec(normalization=ours.normalization)
    return MegatronGPTModel(
        config,
        spec,
        vocab_size=ours.vocab_size,
        max_sequence_length=ours.max_position_embeddings,
        position_embedding_type=ours.position_embedding_type,
        share_embeddings_and_output_weights=not ours.untie_embeddings_and_output_weights,
        mtp_block_spec=get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False),
    )


@pytest.mark.compat
@pytest.mark.parametrize("shape", sorted(CONFIGS))
def test_against_megatron_core_mtp(megatron, shape):
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    config = tiny(shape)
    torch.manual_seed(0)
    reference = megatron_mtp_model(config).train()
    with torch.no_grad():  # random norms and biases too, so their names are checked
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    weights = {k: v for k, v in reference.state_dict().items() if not k.endswith("_extra_state")}
    ours = GPTModel(config).train()
    ours.load_state_dict(weights, strict=True)

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    mask = torch.ones(2, 12)
    mask[1, 7:] = 0  # padding: each depth's mask is this one rolled
    positions = torch.arange(12).expand(2, 12)

    MTPLossLoggingHelper.tracker.clear()
    main = reference(ids, positions, None, labels=labels, loss_mask=mask)
    ((main * mask).sum() / mask.sum()).backward()  # the MTP gradients ride on this
    expected_means = MTPLossLoggingHelper.tracker["values"].clone()
    MTPLossLoggingHelper.tracker.clear()

    objective, means = mtp_objective(ours, ids, labels, mask)
    objective.backward()
    print(
        f"{shape}: MTP losses ours {[f'{m.item():.6f}' for m in means]}, megatron {expected_means}"
    )
    torch.testing.assert_close(torch.stack(means).detach(), expected_means, rtol=0, atol=1e-5)
    expected_grads = {n: p.grad for n, p in reference.named_parameters()}
    worst = 0.0
    for name, param in ours.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-4, atol=1e-6)
        worst = max(worst, (param.grad - expected_grads[name]).abs().max().item())
    assert any(n.startswith("mtp.") for n in expected_grads)
    print(f"{shape}: max |grad diff| = {worst:.3g}")


@pytest.mark.compat
def test_torch_dist_keys_match_megatron_core(megatron):
    """Every parameter's `torch_dist` key (`megatron_sharded_key`) is the one megatron-core's
    `sharded_state_dict` writes: an MTP depth's layer keyed by depth with no layer axis, its
    norms under the fused names, the decoder's layers stacked as before."""
    import torch.distributed as dist

    from mg.core.checkpoint.megatron_sharded_keys import key_layout, megatron_sharded_key

    config = tiny("llama")
    sharded = megatron_mtp_model(config).sharded_state_dict(
        metadata={"dp_cp_group": dist.group.WORLD}
    )
    theirs = {}
    for name, entry in sharded.items():
        if not name.endswith("_extra_state"):
            built = entry.build() if hasattr(entry, "build") else [entry]
            theirs[name] = list(built.values()) if isinstance(built, dict) else list(built)
    ours = dict(GPTModel(config).named_parameters())
    assert set(ours) == set(theirs)
    layout = key_layout(config)
    checked = 0
    for name, param in ours.items():
        mapped = megatron_sharded_key(name, layout)
        for entry in theirs[name]:
            assert entry.key == mapped.key, name
            assert entry.prepend_axis_num == mapped.prepend_axis_num, name
            assert entry.global_shape[mapped.prepend_axis_num :] == tuple(param.shape), name
            checked += name.startswith("mtp.")
    assert checked >= 2 * 8
    key = megatron_sharded_key("mtp.layers.1.transformer_layer.input_layernorm.weight", layout)
    assert key.key == "mtp.layers.1.transformer_layer.self_attention.linear_qkv.layer_norm_weight"


@pytest.mark.parametrize("moe", [False, True])
def test_parameter_count_stage_split_and_flops(moe):
    """num_parameters and stage_parameters count the MTP block as the built model holds it
    (the last pipeline stage: the block and its embedding copy); the FLOPs add Megatron's
    MTP terms, computed here by hand."""
    from mg.core.models.flops import num_floating_point_operations, num_parameters
    from mg.core.models.memory import stage_parameters
    from mg.core.parallel.pipeline import split_model

    extra = dict(num_moe_experts=4, moe_ffn_hidden_size=24, moe_layer_freq=[0, 1]) if moe else {}
    config = TransformerConfig(**{**tiny("llama").__dict__, **extra})
    with torch.device("meta"):
        model = GPTModel(config)
    assert num_parameters(config) == sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    assert num_parameters(config, include_mtp=False) == num_parameters(config) - mtp
    chunks = [split_model(model, rank, 2)[0] for rank in range(2)]
    stages = [sum(p.numel() for p in chunk.parameters()) for chunk in chunks]
    assert stage_parameters(config, pp=2) == stages

    b, s, h, v, d = 3, config.seq_length, 32, 64, 2
    plain = TransformerConfig(**{**config.__dict__, "mtp_num_layers": None})
    q, g, gamma = 1.0, 0.5, 1.5  # kv_channels·heads/h, groups/heads, SwiGLU
    ffn = 24 * 2 if moe else 48  # the last layer's kind: MoE top-2 × 24, or dense 48
    layer = 12 * b * s * h * h * ((1 + g + s / (2 * h)) * q + ffn / h * gamma)
    by_hand = d * layer + 6 * b * s * d * (3 * h + 2 * h * h) + 6 * b * s * h * v * d
    extra_flops = num_floating_point_operations(config, b) - num_floating_point_operations(plain, b)
    assert extra_flops == pytest.approx(by_hand, rel=1e-12)
