"""transformer_impl="transformer_engine": Megatron-Core's TE-spec parameter names (read from
megatron-core's own spec and sharded keys, no TE needed), the same numerics as the local
spec, checkpoints, and (with TE on a GPU) TE's modules and FP8."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch

from mg.core.checkpoint import load_model, save_model
from mg.core.models import GPTModel, TransformerConfig, presets
from mg.core.models.attention_backend import BackendUnavailableError
from mg.core.models.te_spec import (
    FP8Options,
    LayerNormLinear,
    apply_transformer_engine,
    fp8_autocast,
    local_spec_names,
    te_spec_names,
    transformer_engine_installed,
)
from mg.core.testing.megatron_reference import TINY_SHAPES, tiny_config

TE_ON_GPU = torch.cuda.is_available() and transformer_engine_installed()

# Transformer Engine's parameter names per module (TE's own attributes: `weight`, `bias`,
# `layer_norm_weight`, `layer_norm_bias`, and `_extra_state` on every TE module).
_LN_LINEAR, _LINEAR, _DPA, _NORM = "LayerNormLinear", "Linear", "DotProductAttention", "Norm"


def _te_params(kind: str, config: TransformerConfig, bias: bool) -> list[str]:
    layer_norm = config.normalization == "LayerNorm"
    names = {
        _LN_LINEAR: ["weight", "layer_norm_weight"]
        + (["bias"] if bias else [])
        + (["layer_norm_bias"] if layer_norm else [])
        + ["_extra_state"],
        _LINEAR: ["weight"] + (["bias"] if bias else []) + ["_extra_state"],
        _DPA: ["_extra_state"],
        _NORM: ["weight"] + (["bias"] if layer_norm else []),
    }
    return names[kind]


def _megatron_te_layer_names(config: TransformerConfig) -> set[str]:
    """Walk megatron-core's `get_gpt_layer_with_transformer_engine_spec` with its TE
    provider replaced by markers (TE is not installed here): which submodule is a
    LayerNormLinear, a Linear, TE attention, a norm or an identity is Megatron's; the
    parameter names inside each are TE's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt.gpt_layer_specs as specs
        from megatron.core.transformer.spec_utils import ModuleSpec

    markers = {kind: type(kind, (), {}) for kind in (_LN_LINEAR, _LINEAR, _DPA, _NORM)}

    class MarkerProvider:
        def column_parallel_linear(self):
            return markers[_LINEAR]

        def row_parallel_linear(self):
            return markers[_LINEAR]

        def fuse_layernorm_and_linear(self):
            return True

        def column_parallel_layer_norm_linear(self):
            return markers[_LN_LINEAR]

        def layer_norm(self, rms_norm: bool = False, for_qk: bool = False):
            return markers[_NORM]

        def core_attention(self):
            return markers[_DPA]

    patches = pytest.MonkeyPatch()
    patches.setattr(specs, "TESpecProvider", MarkerProvider, raising=False)
    try:
        spec = specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    finally:
        patches.undo()
    by_marker = {v: k for k, v in markers.items()}

    def walk(node, prefix: str, bias: bool):
        module = node.module if isinstance(node, ModuleSpec) else node
        if module in by_marker:
            yield from (prefix + p for p in _te_params(by_marker[module], config, bias))
            return
        sub = getattr(node, "submodules", None)
        if sub is None:
            return
        for field in dataclasses.fields(sub):
            child = getattr(sub, field.name)
            if isinstance(child, (ModuleSpec, type)):
                qkv = field.name == "linear_qkv" and config.add_qkv_bias
                yield from walk(child, f"{prefix}{field.name}.", config.add_bias_linear or qkv)

    return set(walk(spec, "", config.add_bias_linear))


def _te_config(shape: str, **overrides) -> TransformerConfig:
    return dataclasses.replace(
        tiny_config(shape), transformer_impl="transformer_engine", **overrides
    )


@pytest.mark.compat
@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
def test_layer_names_are_megatron_core_te_spec_names(shape: str) -> None:
    config = _te_config(shape)
    ours = GPTModel(config).state_dict()
    theirs = _megatron_te_layer_names(config)
    for i in range(config.num_layers):
        layer = {k.split(".", 3)[3] for k in ours if k.startswith(f"decoder.layers.{i}.")}
        # every name of ours is Megatron's; what TE adds beyond ours is its FP8 state only
        assert layer <= theirs
        assert {n for n in theirs - layer} == {
            "self_attention.linear_qkv._extra_state",
            "self_attention.core_attention._extra_state",
            "self_attention.linear_proj._extra_state",
            "mlp.linear_fc1._extra_state",
            "mlp.linear_fc2._extra_state",
        }
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in ours
    assert not any("input_layernorm" in k or "pre_mlp_layernorm" in k for k in ours)


@pytest.mark.compat
@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
def test_names_are_megatron_core_sharded_keys(tmp_path, shape: str) -> None:
    """megatron-core's local GPTModel stores its norms under the TE spec's names in its
    sharded state dict (so both specs read one checkpoint): ours, with the layer index
    dropped, are exactly those keys, with the same shapes."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from mg.core.testing.megatron_reference import megatron_gpt_model, megatron_on_cpu

        with megatron_on_cpu(tmp_path):
            sharded = megatron_gpt_model(tiny_config(shape)).sharded_state_dict()
    theirs = set()
    for name, entry in sharded.items():
        if name.endswith("_extra_state"):
            continue
        built = entry.build() if hasattr(entry, "build") else [entry]
        parts = built.values() if isinstance(built, dict) else built
        theirs |= {part.key for part in parts}
    ours = GPTModel(_te_config(shape)).state_dict()
    flat = {
        (f"decoder.layers.{k.split('.', 3)[3]}" if k.startswith("decoder.layers.") else k)
        for k in ours
    }
    if not tiny_config(shape).untie_embeddings_and_output_weights:
        theirs.discard("output_layer.weight")
    assert flat == theirs


@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
def test_same_outputs_and_gradients_as_the_local_spec(shape: str) -> None:
    torch.manual_seed(0)
    local = GPTModel(tiny_config(shape)).eval()
    torch.manual_seed(0)
    te = GPTModel(_te_config(shape)).eval()
    renamed = te_spec_names(local.state_dict(), local.config)
    assert set(renamed) == set(te.state_dict())
    for name, tensor in te.state_dict().items():  # the same init, draw for draw
        assert torch.equal(tensor, renamed[name]), name
    assert set(local_spec_names(te.state_dict())) == set(local.state_dict())
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(te(ids), local(ids))
    te(ids, labels=ids).sum().backward()
    local(ids, labels=ids).sum().backward()
    grads = te_spec_names({n: p.grad for n, p in local.named_parameters()}, local.config)
    for name, param in te.named_parameters():
        torch.testing.assert_close(param.grad, grads[name], rtol=0, atol=0)


def test_zero_centred_gamma_matches_the_local_spec() -> None:
    """--apply-layernorm-1p: the fused norm computes with 1 + weight, as TE's
    zero_centered_gamma does, and starts at 0."""
    config = dataclasses.replace(tiny_config("gpt2"), layernorm_zero_centered_gamma=True)
    local = GPTModel(config).eval()
    te = GPTModel(dataclasses.replace(config, transformer_impl="transformer_engine")).eval()
    qkv = te.decoder.layers[0].self_attention.linear_qkv
    assert qkv.zero_centered_gamma and not qkv.layer_norm_weight.any()
    with torch.no_grad():
        for p in local.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    te.load_state_dict(te_spec_names(local.state_dict(), local.config))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    assert torch.equal(te(ids), local(ids))


def test_moe_layers_keep_their_pre_mlp_norm() -> None:
    config = presets.tiny_llama(
        transformer_impl="transformer_engine", num_moe_experts=4, moe_layer_freq=[0, 1]
    )
    names = GPTModel(config).state_dict()
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert "decoder.layers.1.pre_mlp_layernorm.weight" in names
    assert "decoder.layers.1.self_attention.linear_qkv.layer_norm_weight" in names
    assert set(te_spec_names(local_spec_names(names), config)) == set(names)


def test_checkpoint_round_trip(tmp_path) -> None:
    torch.manual_seed(0)
    model = GPTModel(_te_config("llama")).eval()
    save_model(tmp_path, model, model.config, None)
    loaded, config, _, _ = load_model(tmp_path)
    assert config.transformer_impl == "transformer_engine"
    assert isinstance(loaded.decoder.layers[0].self_attention.linear_qkv, LayerNormLinear)
    ids = torch.randint(0, 128, (1, 8))
    assert torch.equal(loaded(ids), model(ids))


@pytest.mark.skipif(TE_ON_GPU, reason="checks the message where TE or CUDA is missing")
def test_transformer_engine_missing_names_the_extra() -> None:
    model = GPTModel(_te_config("gpt2"))
    with pytest.raises(BackendUnavailableError) as err:
        apply_transformer_engine(model)
    message = str(err.value)
    assert "--transformer-impl transformer_engine" in message and "\n" not in message
    assert "mg-core[gpu]" in message or "CUDA" in message
    with pytest.raises(BackendUnavailableError, match="--fp8-format"), fp8_autocast(FP8Options()):
        pass


def test_apply_needs_the_te_spec_names() -> None:
    with pytest.raises(ValueError, match="transformer_impl='transformer_engine'"):
        apply_transformer_engine(GPTModel(tiny_config("gpt2")))


@pytest.mark.skipif(not TE_ON_GPU, reason="needs Transformer Engine and a CUDA GPU")
@pytest.mark.parametrize("shape", sorted(TINY_SHAPES))
def test_te_modules_keep_names_and_outputs(shape: str) -> None:
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPTModel(_te_config(shape, attention_dropout=0.0, hidden_dropout=0.0)).eval()
    ids = torch.randint(0, 128, (2, 16), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        before = model(ids).float()
    names = set(model.state_dict())
    apply_transformer_engine(model)
    after_names = set(model.state_dict())
    assert names <= after_names
    assert {n for n in after_names - names if not n.endswith("_extra_state")} == set()
    assert any(n.endswith("core_attention._extra_state") for n in after_names)
    with torch.autocast("cuda", torch.bfloat16):
        after = model(ids).float()
    torch.testing.assert_close(after, before, rtol=5e-2, atol=5e-2)


@pytest.mark.skipif(not TE_ON_GPU, reason="needs Transformer Engine and a CUDA GPU")
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_fp8_forward_backward_close_to_bf16(recipe: str) -> None:
    config = dataclasses.replace(
        presets.tiny_llama(hidden_size=128, ffn_hidden_size=256, num_attention_heads=4),
        transformer_impl="transformer_engine",
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = GPTModel(config)
    apply_transformer_engine(model)
    ids = torch.randint(0, 128, (4, 32), device="cuda")
    with torch.autocast("cuda", torch.bfloat16):
        reference = model(ids, labels=ids).mean()
    with torch.autocast("cuda", torch.bfloat16), fp8_autocast(FP8Options(recipe=recipe)):
        loss = model(ids, labels=ids).mean()
    loss.backward()
    assert abs(loss.item() - reference.item()) < 0.05 * reference.item()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
