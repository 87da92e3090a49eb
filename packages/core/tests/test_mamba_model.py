"""The Mamba-2 model against transformers' Mamba2ForCausalLM (torch path) on the same weights,
and the hybrid stack's layer pattern, shapes and init."""

import pytest
import torch

from mg.core.models import ConfigError
from mg.core.models.hf_mapping import hf_to_megatron, megatron_to_hf
from mg.core.models.mamba import MambaConfig, MambaModel
from mg.core.models.mamba.hf import MAMBA2, mamba2_config_from_hf, mamba2_config_to_hf

transformers = pytest.importorskip("transformers")


def _pair(groups: int, tied: bool, chunk_ours: int, chunk_hf: int, layers: int = 3):
    torch.manual_seed(0)
    hf_config = transformers.Mamba2Config(
        num_heads=8,
        head_dim=16,
        vocab_size=100,
        hidden_size=64,
        state_size=16,
        num_hidden_layers=layers,
        n_groups=groups,
        chunk_size=chunk_hf,
        tie_word_embeddings=tied,
    )
    hf = transformers.Mamba2ForCausalLM(hf_config).eval()
    with torch.no_grad():  # non-trivial norms, skips and conv biases, so all are checked
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".D") or "conv1d.bias" in name:
                p.add_(torch.randn_like(p) * 0.1)
    config = MambaConfig(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=1,
        vocab_size=100,
        mamba_num_heads=8,
        mamba_head_dim=16,
        mamba_num_groups=groups,
        mamba_state_dim=16,
        mamba_chunk_size=chunk_ours,
        normalization="RMSNorm",
        add_bias_linear=False,
        untie_embeddings_and_output_weights=not tied,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    ours = MambaModel(config).eval()
    ours.load_state_dict(hf_to_megatron(hf.state_dict(), config, MAMBA2), strict=True)
    return hf, ours


@pytest.mark.parametrize(
    "groups,tied,chunk_ours,chunk_hf",
    [(2, False, 16, 8), (1, True, 8, 256), (8, False, 64, 16)],
)
def test_logits_equal_transformers_mamba2(groups, tied, chunk_ours, chunk_hf):
    """fp32 logits within 1e-4 of Mamba2ForCausalLM's torch fallback; 21 tokens, so
    neither side's chunk divides the sequence."""
    hf, ours = _pair(groups, tied, chunk_ours, chunk_hf)
    ids = torch.randint(0, 100, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def test_hf_round_trip_is_bit_exact_and_config_survives(tmp_path):
    """Mamba2ForCausalLM → ours → HF tensors identical; our config → config.json →
    Mamba2ForCausalLM loads the exported weights and gives the same logits."""
    hf, ours = _pair(2, False, 16, 8, layers=2)
    config = mamba2_config_from_hf(hf.config, mamba_chunk_size=16)
    assert config.to_dict() == ours.config.to_dict() | {
        "init_method_std": hf.config.initializer_range,
        "extra": {"hf_model_type": "mamba2"},
    }
    back = megatron_to_hf(hf_to_megatron(hf.state_dict(), config, MAMBA2), config, MAMBA2)
    expected = hf.state_dict()
    assert set(back) == set(expected)
    assert all(torch.equal(back[k], expected[k]) for k in expected)

    exported = transformers.Mamba2Config(**mamba2_config_to_hf(ours.config))
    again = transformers.Mamba2ForCausalLM(exported).eval()
    again.load_state_dict(megatron_to_hf(ours.state_dict(), ours.config, MAMBA2), strict=True)
    ids = torch.randint(0, 100, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, ours(ids), rtol=0, atol=1e-4)


def test_hf_config_refusals():
    base = transformers.Mamba2Config(
        num_heads=8, head_dim=16, hidden_size=64, state_size=16, n_groups=2
    ).to_dict()
    with pytest.raises(ValueError, match="use_bias"):
        mamba2_config_from_hf(base | {"use_bias": True})
    with pytest.raises(ValueError, match="time_step_limit"):
        mamba2_config_from_hf(base | {"time_step_limit": (0.0, 0.1)})
    hybrid = _hybrid_config()
    with pytest.raises(ValueError, match="Mamba layers only"):
        mamba2_config_to_hf(hybrid)


def test_loss_equals_cross_entropy_of_logits():
    _, ours = _pair(2, False, 16, 8, layers=1)
    ids = torch.randint(0, 100, (2, 9))
    labels = torch.randint(0, 100, (2, 9))
    logits = ours(ids)
    loss = ours(ids, labels=labels)
    expected = torch.nn.functional.cross_entropy(
        logits.flatten(0, 1), labels.flatten(), reduction="none"
    ).view(2, 9)
    torch.testing.assert_close(loss, expected)


def _hybrid_config(**overrides) -> MambaConfig:
    fields = dict(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=128,
        mamba_head_dim=16,
        mamba_num_groups=2,
        mamba_state_dim=16,
        normalization="RMSNorm",
        add_bias_linear=False,
        hybrid_override_pattern="M*M-",
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    fields.update(overrides)
    return MambaConfig(**fields)


def test_hybrid_layers_follow_the_pattern():
    model = MambaModel(_hybrid_config())
    kinds = [type(layer).__name__ for layer in model.decoder.layers]
    assert kinds == ["MambaLayer", "AttentionLayer", "MambaLayer", "MLPLayer"]
    # GPT's own attention and MLP modules, not copies
    from mg.core.models.gpt import MLP, SelfAttention

    assert isinstance(model.decoder.layers[1].self_attention, SelfAttention)
    assert isinstance(model.decoder.layers[3].mlp, MLP)
    ids = torch.randint(0, 128, (2, 11))
    assert model(ids).shape == (2, 11, 128)


def test_init_follows_megatron():
    """σ = 0.02 on in_proj, σ/√L on out_proj (hybrid: multiplier 1), A = exp(A_log) in
    [1, 16], softplus(dt_bias) in [0.001, 0.1], D = 1, norms 1."""
    torch.manual_seed(0)
    config = _hybrid_config(
        num_layers=4, hidden_size=256, mamba_head_dim=32, hybrid_override_pattern="MMMM"
    )
    model = MambaModel(config)
    mixer = model.decoder.layers[0].mixer
    assert mixer.in_proj.weight.std().item() == pytest.approx(0.02, rel=0.03)
    assert mixer.out_proj.weight.std().item() == pytest.approx(0.02 / 2, rel=0.03)
    A = mixer.A_log.exp()
    assert A.min() >= 1 and A.max() <= 16
    dt = torch.nn.functional.softplus(mixer.dt_bias)
    assert dt.min() >= 0.001 - 1e-6 and dt.max() <= 0.1 + 1e-6
    assert torch.equal(mixer.D, torch.ones(16)) and torch.equal(mixer.norm.weight, torch.ones(512))


def test_builds_on_meta_and_materialises_the_same():
    torch.manual_seed(3)
    direct = MambaModel(_hybrid_config())
    with torch.device("meta"):
        meta = MambaModel(_hybrid_config())
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.init_weights()
    expected = direct.state_dict()
    for name, value in meta.state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"hybrid_override_pattern": "M*E-"}, "MoE layers ('E') are not supported yet"),
        ({"hybrid_override_pattern": "M*M"}, "has 3 layers, --num-layers is 4"),
        ({"hybrid_override_pattern": "M*X-"}, "'X' is not a layer type"),
        ({"mamba_num_groups": 3}, "do not divide into 3 groups"),
        (
            {"hybrid_attention_ratio": 0.5, "hybrid_override_pattern": "M*M-"},
            "does not have the layer counts",
        ),
    ],
)
def test_config_errors_name_the_flag(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _hybrid_config(**overrides)


def test_config_round_trips_through_a_dict():
    config = _hybrid_config(hybrid_attention_ratio=0.25, hybrid_override_pattern=None)
    again = MambaConfig.from_dict(config.to_dict())
    assert again == config and again.layer_pattern == config.layer_pattern
    assert config.mamba_num_heads == 2 * 64 // 16


def test_mamba_ssm_kernel_absent_is_a_clear_error(monkeypatch):
    import sys

    from mg.core.models.mamba.kernels import KernelUnavailableError, use_mamba_ssm_kernels

    monkeypatch.setitem(sys.modules, "mamba_ssm", None)  # as if not installed
    with pytest.raises(KernelUnavailableError, match="pip install mamba-ssm"):
        use_mamba_ssm_kernels(MambaModel(_hybrid_config()))


def test_mamba_ssm_kernel_is_called_as_megatron_calls_it(monkeypatch):
    """The kernel's contract (megatron-core's call: x [b,l,h,p], dt after softplus, A, B/C
    [b,l,g,n], chunk_size, D, initial_states, return_final_states) stood in for by the
    sequential recurrence: the model's logits and decoding state are unchanged."""
    import sys
    import types

    from mg.core.models.mamba import ssd_sequential_scan
    from mg.core.models.mamba.kernels import use_mamba_ssm_kernels

    calls = []

    def mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=None, initial_states=None, return_final_states=False
    ):
        calls.append(chunk_size)
        y, final = ssd_sequential_scan(x, dt, A, B, C, D, initial_states)
        return (y, final) if return_final_states else y

    module = types.ModuleType("mamba_ssm.ops.triton.ssd_combined")
    module.mamba_chunk_scan_combined = mamba_chunk_scan_combined
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "mamba_ssm.ops.triton.ssd_combined", module)

    model = MambaModel(_hybrid_config()).eval()
    ids = torch.randint(0, 128, (2, 11))
    with torch.no_grad():
        expected = model(ids)
        assert use_mamba_ssm_kernels(model) == 2
        got = model(ids)
    assert calls == [128, 128]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
