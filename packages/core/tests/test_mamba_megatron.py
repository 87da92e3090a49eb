"""Against megatron-core 0.16.1's MambaModel: layer allocation, state-dict names and shapes,
and the logits of a hybrid made of attention and MLP layers.

megatron-core's only Mamba layer spec is the Transformer Engine one, and its
`MambaMixer` refuses to build without mamba_ssm and einops (its forward needs
their CUDA/Triton kernels). So the reference here is megatron-core's own
MambaModel / MambaStack / MambaLayer / MambaMixer classes assembled with its
local (non-TE) linears and norms — the same slots the TE spec fills — with
the mixer's import guards lifted and its gated-norm class (a mamba_ssm kernel)
stood in for by a module holding the same `weight`. That checks our names and
shapes against what megatron-core builds; the forward is compared on patterns
without Mamba layers (which megatron-core can run on CPU), the Mamba layers'
numerics against transformers (test_mamba_model.py). The TE spec's names are
ours after `megatron_te_names` (norms fused into the next linear).
"""

import contextlib

import pytest
import torch
from torch import nn

pytest.importorskip("megatron.core")

from mg.core.models.mamba import (  # noqa: E402
    MambaConfig,
    MambaModel,
    allocate_layers,
    from_megatron_te_names,
    megatron_te_names,
)
from mg.core.testing.megatron_reference import megatron_on_cpu  # noqa: E402

pytestmark = pytest.mark.compat


class _NoRngTracker:
    def fork(self, name=None):
        return contextlib.nullcontext()


class _GatedNormWeights(nn.Module):
    """Holds mamba_ssm RMSNormGated's one parameter (`weight` [d_inner]), no kernel."""

    def __init__(self, hidden, eps, group_size, norm_before_gate, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))


@pytest.fixture(scope="module")
def megatron(tmp_path_factory):
    import megatron.core.ssm.mamba_block as mamba_block
    import megatron.core.ssm.mamba_context_parallel as mamba_cp
    import megatron.core.ssm.mamba_mixer as mamba_mixer
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    patches = pytest.MonkeyPatch()
    patches.setattr(mamba_mixer, "HAVE_MAMBA_SSM", True)
    patches.setattr(mamba_mixer, "HAVE_EINOPS", True)
    patches.setattr(mamba_cp, "HAVE_EINOPS", True)
    patches.setattr(mamba_mixer, "ExtendedRMSNorm", _GatedNormWeights)
    patches.setattr(mamba_mixer, "get_cuda_rng_tracker", lambda *a, **k: _NoRngTracker())
    patches.setattr(mamba_block, "TENorm", WrappedTorchNorm)  # the final norm
    with megatron_on_cpu(tmp_path_factory.mktemp("pg")):
        yield
    patches.undo()


# The Transformer Engine spec's names of the local slots' norms (its fused linears)
_TE_KEYS = {
    "mamba": {"norm.": "mixer.in_proj.layer_norm_"},
    "attention": {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
    "mlp": {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"},
}


def _megatron_mamba_model(ours: MambaConfig, te_keys: bool = False):
    """megatron-core's MambaModel with our config's shapes; `te_keys`: its sharded keys
    those of Megatron-LM's Transformer Engine spec (norms under their fused linears)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.models.mamba.mamba_model import MambaModel as MegatronMambaModel
    from megatron.core.ssm.mamba_block import MambaStack, MambaStackSubmodules
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import (
        TransformerLayer,
        TransformerLayerSubmodules,
    )

    mixer = ModuleSpec(
        module=MambaMixer,
        submodules=MambaMixerSubmodules(in_proj=ColumnParallelLinear, out_proj=RowParallelLinear),
    )
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=DotProductAttention,
            linear_proj=RowParallelLinear,
        ),
    )
    mlp = ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
    )
    spec = ModuleSpec(
        module=MambaStack,
        submodules=MambaStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=WrappedTorchNorm,
                    mixer=mixer,
                    mamba_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map=_TE_KEYS["mamba"] if te_keys else {},
                ),
            ),
            attention_layer=ModuleSpec(
                module=TransformerLayer,
                submodules=TransformerLayerSubmodules(
                    input_layernorm=WrappedTorchNorm,
                    self_attention=attention,
                    self_attn_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map=_TE_KEYS["attention"] if te_keys else {},
                ),
            ),
            mlp_layer=ModuleSpec(
                module=MLPLayer,
                submodules=TransformerLayerSubmodules(
                    pre_mlp_layernorm=WrappedTorchNorm,
                    mlp=mlp,
                    mlp_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map=_TE_KEYS["mlp"] if te_keys else {},
                ),
            ),
        ),
    )
    config = TransformerConfig(
        num_layers=ours.num_layers,
        hidden_size=ours.hidden_size,
        num_attention_heads=ours.num_attention_heads,
        num_query_groups=ours.num_query_groups,
        ffn_hidden_size=ours.ffn_hidden_size,
        mamba_state_dim=ours.mamba_state_dim,
        mamba_head_dim=ours.mamba_head_dim,
        mamba_num_groups=ours.mamba_num_groups,
        mamba_num_heads=ours.mamba_num_heads,
        normalization=ours.normalization,
        layernorm_epsilon=ours.layernorm_epsilon,
        add_bias_linear=ours.add_bias_linear,
        gated_linear_unit=ours.gated_linear_unit,
        activation_func=torch.nn.functional.silu
        if ours.gated_linear_unit
        else torch.nn.functional.gelu,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        is_hybrid_model=True,
    )
    return MegatronMambaModel(
        config,
        spec,
        vocab_size=ours.vocab_size,
        max_sequence_length=ours.max_position_embeddings,
        hybrid_attention_ratio=ours.hybrid_attention_ratio,
        hybrid_mlp_ratio=ours.hybrid_mlp_ratio,
        hybrid_override_pattern=ours.hybrid_override_pattern,
        share_embeddings_and_output_weights=not ours.untie_embeddings_and_output_weights,
        position_embedding_type=ours.position_embedding_type,
    ).eval()


def _config(**overrides) -> MambaConfig:
    fields = dict(
        num_layers=5,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=128,
        seq_length=16,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=16,
        normalization="RMSNorm",
        activation="swiglu",
        add_bias_linear=False,
        hybrid_override_pattern="M*-M-",
        untie_embeddings_and_output_weights=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return MambaConfig(**fields)


CASES = [
    (10, 0.2, 0.0, None),
    (48, 0.1, 0.0, None),
    (48, 0.5, 0.2, None),
    (10, 0.1, 0.1, None),
    (10, 0.3, 0.3, None),
    (10, 0.0, 0.5, None),
    (56, 0.08, 0.5, None),  # Megatron's 8B hybrid (examples/mamba)
    (48, 0.25, 0.25, "MM-*MM-*MM*-MM*-MM*-MM*-M*M-M*M-M*M-M*M-*MM-*MM-"),
    (9, 0.0, 0.0, "M*-M*-M*-"),
    (
        56,
        0.0,
        0.0,
        "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-M-M-",
    ),  # Nemotron-H 8B
]


@pytest.mark.parametrize("total,attention,mlp,pattern", CASES)
def test_layer_allocation_equals_megatron(total, attention, mlp, pattern):
    from megatron.core.ssm.mamba_hybrid_layer_allocation import allocate_layers as reference

    assert allocate_layers(total, attention, mlp, pattern) == reference(
        total, attention, mlp, pattern
    )


def test_megatron_8b_hybrid_counts():
    """REFERENCE.md: Megatron's 8B hybrid has 56 layers, 24 Mamba, 4 attention, 28 MLP."""
    layers = allocate_layers(56, 0.08, 0.5)
    assert (layers.count("M"), layers.count("*"), layers.count("-")) == (24, 4, 28)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"hybrid_override_pattern": None, "hybrid_attention_ratio": 0.2, "hybrid_mlp_ratio": 0.4},
        {"untie_embeddings_and_output_weights": False, "hybrid_override_pattern": "MMM*M"},
    ],
)
def test_state_dict_names_and_shapes_equal_megatron(megatron, overrides):
    config = _config(**overrides)
    reference = _megatron_mamba_model(config)
    assert reference.decoder.layer_type_list == list(config.layer_pattern)
    theirs = {
        k: tuple(v.shape)
        for k, v in reference.state_dict().items()
        if not k.endswith("_extra_state")
    }
    ours = {k: tuple(v.shape) for k, v in MambaModel(config).state_dict().items()}
    assert ours == theirs


def test_te_spec_names():
    config = _config()
    names = set(megatron_te_names(MambaModel(config).state_dict()))
    assert "decoder.layers.0.mixer.in_proj.layer_norm_weight" in names
    assert "decoder.layers.0.mixer.norm.weight" in names  # the gated norm keeps its name
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in names
    assert "decoder.layers.2.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.final_norm.weight" in names
    assert not any(
        ".norm.weight" in n and ".mixer." not in n for n in names - {"decoder.final_norm.weight"}
    )
    state = MambaModel(config).state_dict()
    assert set(from_megatron_te_names(megatron_te_names(state))) == set(state)


def test_attention_and_mlp_layers_equal_megatron(megatron):
    """A hybrid of attention and MLP layers only (megatron-core runs these on CPU): logits
    within 1e-4 of megatron-core's MambaModel on the same weights."""
    config = _config(hybrid_override_pattern="*-*--", position_embedding_type="rope")
    torch.manual_seed(0)
    reference = _megatron_mamba_model(config)
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    weights = {k: v for k, v in reference.state_dict().items() if not k.endswith("_extra_state")}
    ours = MambaModel(config).eval()
    ours.load_state_dict(weights, strict=True)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    with torch.no_grad():
        expected = reference(ids, positions, None)
        got = ours(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_torch_dist_in_megatron_layout_megatron_core_loads(megatron, tmp_path, monkeypatch):
    """Our hybrid's `torch_dist` save is in Megatron-Core's layout (what mg-train writes):
    each layer keyed by number, the mixer's in_proj and conv1d split into their named row
    blocks (`mixer.in_proj.weight.z` … `.dt`), the norms under the TE spec's fused names.
    The stored keys and global shapes are megatron-core's own `sharded_state_dict()`'s,
    its `dist_checkpointing.load` fills its MambaModel with our weights bit for bit, and
    mg reads the folder back to the same tensors under our names."""
    from mg.core.checkpoint.dist_format import load_full_state, save_dist_checkpoint
    from mg.core.checkpoint.megatron_dist import megatron_model_state
    from mg.core.checkpoint.megatron_sharded_keys import key_layout
    from mg.core.checkpoint.reader_guard import read_dcp_metadata
    from mg.core.testing.megatron_dist_checkpoint import (
        dist_checkpointing_cpu_patches,
        load_into_megatron,
        megatron_sharded_keys,
    )

    config = _config(hybrid_override_pattern="M*-M-", untie_embeddings_and_output_weights=True)
    torch.manual_seed(0)
    ours = MambaModel(config)
    weights = ours.state_dict()
    state = megatron_model_state(weights, key_layout(config), extra_state=True)
    save_dist_checkpoint(tmp_path / "ckpt", 1, {**state.tensors, **state.objects}, {})
    folder = tmp_path / "ckpt" / "iter_0000001"
    stored = {
        key: tuple(meta.size)
        for key, meta in read_dcp_metadata(folder).state_dict_metadata.items()
        if hasattr(meta, "size") and "/" not in key
    }
    inner, groups = config.mamba_d_inner, config.mamba_num_groups * config.mamba_state_dim
    assert stored["decoder.layers.0.mixer.in_proj.weight.z"] == (inner, config.hidden_size)
    assert stored["decoder.layers.3.mixer.conv1d.weight.B"] == (groups, 1, 4)

    theirs = _megatron_mamba_model(config, te_keys=True)
    tensors, objects = megatron_sharded_keys(theirs)
    assert stored == tensors
    assert objects <= set(read_dcp_metadata(folder).state_dict_metadata)
    dist_checkpointing_cpu_patches(monkeypatch)
    load_into_megatron(folder, theirs)
    loaded = {k: v for k, v in theirs.state_dict().items() if not k.endswith("_extra_state")}
    assert loaded.keys() == weights.keys()
    for name, tensor in loaded.items():
        assert torch.equal(tensor, weights[name]), name
    back = load_full_state(folder)
    assert list(back) == list(weights)
    assert all(torch.equal(back[k], weights[k]) for k in weights)
