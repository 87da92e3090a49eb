"""Multi-latent attention under Megatron's Transformer Engine spec (`transformer_impl=
"transformer_engine"`): megatron-core's TE-spec names (its MLA spec walked with marker
classes, no TE needed), the local spec's numbers with the weights mapped, Transformer
Engine's modules (the stand-in package, mg.core.testing.te_standin) on one process and
under tensor (+ sequence) parallelism on 2 gloo ranks, and the torch_dist keys.

This file is also the rank worker (`python test_te_mla.py OUT_DIR`): each rank builds the
local-spec reference (same seed) and a TE-spec copy with the weights renamed, splits the
copy over TP=2 and compares its loss and gradients with the reference's. fp32:
parallelism changes only the order of sums.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.recompute import apply_recompute_modules
from mg.core.models.te_parallel import TEParallelism
from mg.core.models.te_spec import (
    LayerNormLinear,
    apply_transformer_engine,
    local_spec_names,
    te_spec_names,
)

WORLD = 2
BASE = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    vocab_size=128,
    seq_length=16,
    max_position_embeddings=64,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    ffn_hidden_size=96,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    multi_latent_attention=True,
    kv_lora_rank=24,
    qk_head_dim=16,
    qk_pos_emb_head_dim=8,
    v_head_dim=12,
)
CONFIGS = {  # DeepSeek-V3's kind (latent norms fused under TE), V2-Lite's (no latent norms)
    "q-lora-norms": dict(q_lora_rank=32, qk_layernorm=True, rope_type="yarn"),
    "q-proj": dict(q_lora_rank=None, rope_type="rope"),
}


def _config(name: str, te: bool = False, **overrides) -> TransformerConfig:
    impl = "transformer_engine" if te else "local"
    return TransformerConfig(**BASE, **CONFIGS[name], transformer_impl=impl, **overrides)


def _pair(name: str, **overrides) -> tuple[GPTModel, GPTModel]:
    """The local-spec model and the TE-spec one, each from seed 0 (the same draws)."""
    torch.manual_seed(0)
    local = GPTModel(_config(name, **overrides))
    torch.manual_seed(0)
    te = GPTModel(_config(name, te=True, **overrides))
    with torch.no_grad():  # norms that matter (they start at 1), the same in both
        for key, value in local.state_dict().items():
            if "layernorm" in key:
                value.copy_(1 + 0.1 * torch.randn_like(value))
    te.load_state_dict(te_spec_names(local.state_dict(), local.config))
    return local, te


def _loss_and_grads(model: GPTModel, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _tokens() -> torch.Tensor:
    return torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(7))


# --- names ---------------------------------------------------------------------------------

_LN_LINEAR, _LINEAR, _DPA, _NORM = "LayerNormLinear", "Linear", "DotProductAttention", "Norm"


def _te_params(kind: str) -> list[str]:
    """TE's parameters per module (RMSNorm, no biases): TE's own attribute names."""
    return {
        _LN_LINEAR: ["weight", "layer_norm_weight", "_extra_state"],
        _LINEAR: ["weight", "_extra_state"],
        _DPA: ["_extra_state"],
        _NORM: ["weight"],
    }[kind]


def _megatron_mla_te_layer_names(config: TransformerConfig) -> set[str]:
    """megatron-core 0.16.1's `get_gpt_layer_with_transformer_engine_spec(
    multi_latent_attention=True)` walked with its TE provider replaced by markers: which
    submodule is a LayerNormLinear, a Linear, TE attention, a norm or absent is
    Megatron's; the names inside each are TE's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import megatron.core.models.gpt.gpt_layer_specs as specs
        from megatron.core.transformer.spec_utils import ModuleSpec

    markers = {kind: type(kind, (), {}) for kind in (_LN_LINEAR, _LINEAR, _DPA, _NORM)}

    class MarkerProvider:
        def linear(self):
            return markers[_LINEAR]

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
        spec = specs.get_gpt_layer_with_transformer_engine_spec(
            qk_layernorm=config.qk_layernorm, multi_latent_attention=True
        )
    finally:
        patches.undo()
    by_marker = {v: k for k, v in markers.items()}
    skip = {"linear_q_proj"} if config.q_lora_rank is not None else set()
    if config.q_lora_rank is None:
        skip |= {"linear_q_down_proj", "linear_q_up_proj"}

    def walk(node, prefix: str):
        module = node.module if isinstance(node, ModuleSpec) else node
        if module in by_marker:
            yield from (prefix + p for p in _te_params(by_marker[module]))
            return
        sub = getattr(node, "submodules", None)
        if sub is None:
            return
        for field in dataclasses.fields(sub):
            child = getattr(sub, field.name)
            if field.name not in skip and isinstance(child, (ModuleSpec, type)):
                yield from walk(child, f"{prefix}{field.name}.")

    return set(walk(spec, ""))


@pytest.mark.slow  # megatron-core's import: ~30 s on 2 CPUs
@pytest.mark.compat
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_layer_names_are_megatron_core_mla_te_spec_names(name: str) -> None:
    pytest.importorskip("megatron.core")
    config = _config(name, te=True)
    theirs = _megatron_mla_te_layer_names(config)
    ours = GPTModel(config).state_dict()
    for i in range(config.num_layers):
        layer = {k.split(".", 3)[3] for k in ours if k.startswith(f"decoder.layers.{i}.")}
        assert layer == {n for n in theirs if not n.endswith("_extra_state")}
    if name == "q-lora-norms":
        assert "self_attention.linear_q_up_proj.layer_norm_weight" in theirs
        assert "self_attention.linear_kv_up_proj.layer_norm_weight" in theirs
        assert "input_layernorm.weight" in theirs


def test_te_names_map_both_ways() -> None:
    local, te = _pair("q-lora-norms")
    attention = te.decoder.layers[0].self_attention
    assert isinstance(attention.linear_q_up_proj, LayerNormLinear)
    assert isinstance(attention.linear_kv_up_proj, LayerNormLinear)
    assert attention.q_layernorm is None and attention.kv_layernorm is None
    names = set(te.state_dict())
    assert "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight" in names
    assert "decoder.layers.0.input_layernorm.weight" in names
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in names
    assert set(local_spec_names(te.state_dict())) == set(local.state_dict())
    assert set(te_spec_names(local.state_dict(), local.config)) == names


# --- numbers -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_te_spec_equals_local_spec(name: str) -> None:
    """fp32, the same weights mapped: the same loss and gradients, bitwise."""
    local, te = _pair(name)
    tokens = _tokens()
    loss_local, grads_local = _loss_and_grads(local, tokens)
    loss_te, grads_te = _loss_and_grads(te, tokens)
    assert torch.equal(loss_te, loss_local)
    mapped = te_spec_names(grads_local, local.config)
    assert set(mapped) == set(grads_te)
    for key, grad in grads_te.items():
        assert torch.equal(grad, mapped[key]), key


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_transformer_engines_modules_equal_local_spec(monkeypatch, name: str) -> None:
    """TE's modules swapped in (the stand-in package: TE's constructor arguments, names and
    attention contract): down projections plain Linears, up projections LayerNormLinears
    with the latent norms, TE attention told (key, value) head sizes."""
    from mg.core.testing import te_standin

    te_standin.install(monkeypatch)
    local, te = _pair(name)
    apply_transformer_engine(te)
    attention = te.decoder.layers[0].self_attention
    for module in (attention.linear_kv_down_proj, attention.linear_proj):
        assert type(module).__name__ == "Linear"
    fused = "LayerNormLinear" if name == "q-lora-norms" else "Linear"
    assert type(attention.linear_kv_up_proj).__name__ == fused
    assert attention.core_attention.kwargs["kv_channels"] == (24, 12)
    names = {k for k in te.state_dict() if not k.endswith("_extra_state")}
    assert names == set(te_spec_names(local.state_dict(), local.config))
    tokens = _tokens()
    loss_local, grads_local = _loss_and_grads(local, tokens)
    loss_te, grads_te = _loss_and_grads(te, tokens)
    torch.testing.assert_close(loss_te, loss_local, rtol=1e-6, atol=0)
    mapped = te_spec_names(grads_local, local.config)
    for key, grad in grads_te.items():
        torch.testing.assert_close(grad, mapped[key], rtol=1e-5, atol=1e-7, msg=key)


@pytest.mark.slow  # megatron-core's import
@pytest.mark.compat
def test_torch_dist_keys_are_megatrons_te_names() -> None:
    """The torch_dist keys (Megatron's layer-stacked sharded keys) of a TE-spec MLA model are
    megatron-core's TE-spec names: the latent norms as the up projections'
    `layer_norm_weight`, the input norm its own module, the dense MLP's norm in fc1."""
    pytest.importorskip("megatron.core")
    from mg.core.checkpoint.megatron_sharded_keys import key_layout, megatron_sharded_key

    config = _config("q-lora-norms", te=True)
    with torch.device("meta"):
        names = [n for n, _ in GPTModel(config).named_parameters()]
    layout = key_layout(config)
    ours = {megatron_sharded_key(n, layout).key for n in names if n.startswith("decoder.layers.")}
    theirs = _megatron_mla_te_layer_names(config)
    assert ours == {f"decoder.layers.{n}" for n in theirs if not n.endswith("_extra_state")}
    assert "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight" in ours


def test_torch_dist_save_stores_te_names_and_reads_back(tmp_path) -> None:
    """A torch_dist save of the TE-spec model: its stored keys are the TE spec's, and they
    read back (as mg's load does, `te_spec_names` over the read state) bit-exact."""
    from mg.core.checkpoint.dist_format import load_full_state, save_dist_checkpoint, stored_keys
    from mg.core.checkpoint.megatron_dist import megatron_model_state
    from mg.core.checkpoint.megatron_sharded_keys import key_layout

    _, te = _pair("q-lora-norms")
    weights = te.state_dict()
    state = megatron_model_state(weights, key_layout(te.config), extra_state=True)
    save_dist_checkpoint(tmp_path, 1, {**state.tensors, **state.objects}, {})
    folder = tmp_path / "iter_0000001"
    keys = stored_keys(folder, "decoder.layers.")
    for name in ("linear_q_up_proj", "linear_kv_up_proj"):
        assert f"decoder.layers.self_attention.{name}.layer_norm_weight" in keys
    assert "decoder.layers.input_layernorm.weight" in keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys
    assert not any("q_layernorm" in k or "kv_layernorm" in k for k in keys)
    read = te_spec_names(load_full_state(folder), te.config)
    assert read.keys() == weights.keys()
    assert all(torch.equal(read[k], weights[k]) for k in weights)


def test_checkpoint_round_trip(tmp_path) -> None:
    from mg.core.checkpoint import load_model, save_model

    _, te = _pair("q-lora-norms")
    save_model(tmp_path, te, te.config, None)
    loaded, config, _, _ = load_model(tmp_path)
    assert config.transformer_impl == "transformer_engine"
    assert set(loaded.state_dict()) == set(te.state_dict())
    tokens = _tokens()[:, :8]
    assert torch.equal(loaded(tokens), te.eval()(tokens))


# --- tensor parallelism ---------------------------------------------------------------------

LAYOUTS = ("tp", "tp_sp")


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


RECOMPUTE = ["core_attn", "layernorm", "mla_up_proj", "mlp"]


def _scenario(name: str, layout: str, swap: bool, recompute: bool = False) -> dict:
    from mg.core.parallel.mesh import ParallelDims
    from mg.core.parallel.tensor_parallel import apply_tensor_parallel, sync_tensor_parallel_grads

    local, model = _pair(name)
    sequence_parallel = layout == "tp_sp"
    mesh = ParallelDims.from_world(WORLD, tp=WORLD).build_mesh()["tp"]
    apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
    if swap:
        apply_transformer_engine(model, parallel=TEParallelism(mesh.get_group(), sequence_parallel))
    if recompute:  # after the swap, as the construction pipeline orders them
        apply_recompute_modules(model, RECOMPUTE)
    tokens = _tokens()
    loss_ref, grads_ref = _loss_and_grads(local, tokens)
    loss, _ = _loss_and_grads(model, tokens)
    sync_tensor_parallel_grads(model)
    grads = {n: _full(p.grad) for n, p in model.named_parameters()}
    worst = 0.0
    for key, ref in te_spec_names(grads_ref, local.config).items():
        scale = float(ref.abs().max()) or 1.0
        worst = max(worst, float((grads[key] - ref).abs().max()) / scale)
    return {"loss": [float(loss), float(loss_ref)], "grad_rel": worst}


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    report = {}
    for name in CONFIGS:
        for layout in LAYOUTS:
            report[f"{name}-{layout}-plain"] = _scenario(name, layout, swap=False)
        report[f"{name}-tp_sp-plain-recompute"] = _scenario(name, "tp_sp", False, True)
    with pytest.MonkeyPatch.context() as patch:
        from mg.core.testing import te_standin

        te_standin.install(patch)
        for name in CONFIGS:
            for layout in LAYOUTS:
                report[f"{name}-{layout}-te"] = _scenario(name, layout, swap=True)
            report[f"{name}-tp_sp-te-recompute"] = _scenario(name, "tp_sp", True, True)
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    from mg.core.testing.launch import launch_workers

    out = tmp_path_factory.mktemp("te_mla_parallel")
    launch_workers(__file__, WORLD, [str(out)], timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.slow  # two ranks, eight models each: ~30 s on 2 CPUs
@pytest.mark.parametrize("swap", ["plain", "te"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tensor_parallel_te_spec_equals_one_process(reports, name, layout, swap) -> None:
    _check(reports, f"{name}-{layout}-{swap}")


@pytest.mark.slow
@pytest.mark.parametrize("swap", ["plain", "te"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_tensor_parallel_with_recompute_modules_equals_one_process(reports, name, swap) -> None:
    """TP=2 with sequence parallelism, the recompute of the attention core, the norms,
    MLA's up projections and the MLPs on (their outputs are DTensors or local shards)."""
    _check(reports, f"{name}-tp_sp-{swap}-recompute")


def _check(reports: list[dict], key: str) -> None:
    for report in reports:
        entry = report[key]
        loss, loss_ref = entry["loss"]
        assert loss == pytest.approx(loss_ref, rel=1e-6)
        assert entry["grad_rel"] < 1e-5


if __name__ == "__main__":
    _worker(sys.argv[1])
