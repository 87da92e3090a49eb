"""`mg-convert import-megatron` of a checkpoint written with Megatron's Transformer Engine spec
(`--transformer-impl transformer_engine`): the state dict of our TE-spec GPTModel, with the
`_extra_state` entries TE adds, saved as Megatron-LM saves it, imports and scores as the model
it came from; and our own TE-spec checkpoints load as they are."""

from __future__ import annotations

import dataclasses
import io
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # pytest runs with --import-mode=importlib
from reshard_helpers import CONFIGS, build, logits  # noqa: E402
from test_megatron_layouts import _megatron_args, _write_megatron  # noqa: E402

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.ckpt_convert.megatron_lm import export_megatron  # noqa: E402
from mg.core.checkpoint import load_checkpoint, load_model, save_model  # noqa: E402
from mg.core.models.te_spec import local_spec_names  # noqa: E402

IDS = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))
# where Transformer Engine's modules keep their FP8 state in a layer (Megatron's TE spec)
TE_EXTRA_STATE = (
    "self_attention.linear_qkv",
    "self_attention.core_attention",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_import_of_a_te_spec_checkpoint_scores_as_its_model(tmp_path, kind) -> None:
    config = dataclasses.replace(CONFIGS[kind], transformer_impl="transformer_engine")
    model = build(config)
    state = dict(model.state_dict())
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in state
    for i in range(config.num_layers):
        for module in TE_EXTRA_STATE:
            state[f"decoder.layers.{i}.{module}._extra_state"] = io.BytesIO(b"fp8 meta")
    args = _megatron_args(config, 1, 1, transformer_impl="transformer_engine")
    _write_megatron(tmp_path / "megatron", {(0, 0): [state]}, args, pp=1)

    code = main(
        ["import-megatron", "--load", str(tmp_path / "megatron")]
        + [
            "--save",
            str(tmp_path / "ours"),
        ]
    )
    assert code in (0, None)
    imported, imported_config, _, _ = load_model(tmp_path / "ours")
    assert imported_config.transformer_impl == "local"  # stored under the local spec's names
    assert set(imported.state_dict()) == set(local_spec_names(state))
    with torch.no_grad():
        expected = model(IDS)
    assert torch.equal(logits(tmp_path / "ours", IDS), expected)


def test_our_te_spec_checkpoint_loads_under_its_own_names(tmp_path) -> None:
    config = dataclasses.replace(CONFIGS["llama"], transformer_impl="transformer_engine")
    model = build(config)
    save_model(tmp_path, model, config, None)
    loaded, loaded_config, _, _ = load_model(tmp_path)
    assert loaded_config.transformer_impl == "transformer_engine"
    assert set(loaded.state_dict()) == set(model.state_dict())
    with torch.no_grad():
        assert torch.equal(loaded(IDS), model(IDS))


def test_export_of_a_te_spec_model_says_transformer_engine(tmp_path) -> None:
    """Megatron must build the TE spec to read these names: the args say so."""
    config = dataclasses.replace(CONFIGS["gpt2"], transformer_impl="transformer_engine")
    model = build(config)
    save_model(tmp_path / "ours", model, config, None)
    export_megatron(tmp_path / "ours", tmp_path / "megatron", report=lambda _: None)
    state = load_checkpoint(tmp_path / "megatron", allow_pickle=True)[0]
    assert state["args"].transformer_impl == "transformer_engine"
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in state["model"]
    main(
        ["import-megatron", "--load", str(tmp_path / "megatron"), "--save", str(tmp_path / "back")]
    )
    assert torch.equal(logits(tmp_path / "back", IDS), logits(tmp_path / "ours", IDS))


def test_export_hf_of_a_te_spec_checkpoint(tmp_path) -> None:
    """The fused norms go to HF's input_layernorm / post_attention_layernorm: the same HF
    tensors as the local-spec model with the same weights."""
    from mg.core.models.hf_mapping import megatron_to_hf
    from mg.core.models.te_spec import te_spec_names

    local = build(CONFIGS["llama"])
    config = dataclasses.replace(CONFIGS["llama"], transformer_impl="transformer_engine")
    te_state = te_spec_names(local.state_dict(), config)
    ours = megatron_to_hf(te_state, config, "llama")
    reference = megatron_to_hf(local.state_dict(), CONFIGS["llama"], "llama")
    assert set(ours) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(ours[name], tensor), name
