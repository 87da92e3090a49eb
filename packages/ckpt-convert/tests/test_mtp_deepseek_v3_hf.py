"""mg-convert for DeepSeek-V3's multi-token prediction layer, stored as DeepSeek releases it:
`model.layers.{num_hidden_layers}.*` (enorm, hnorm, eh_proj, shared_head.norm, a decoder
layer, and copies of the embedding and output head). transformers' DeepseekV3ForCausalLM
neither builds nor saves it, so the test writes one beside a random model's weights:
import-hf reads it into Megatron's `mtp.layers.0` (weights equal, tensor for tensor),
export-hf writes it back bit for bit (the two copies left out: they are the shared
embedding and head), and a folder whose config names MTP layers its files lack imports
without them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

pytest.importorskip("transformers")

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.core.checkpoint.model_io import load_model  # noqa: E402

pytestmark = pytest.mark.compat


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(f"_mtp_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


deepseek = _sibling("test_deepseek_v3_hf.py")


def _with_mtp_layer(folder: Path) -> dict[str, torch.Tensor]:
    """Add DeepSeek's MTP layer (layer 3 of 3 decoder layers) to the folder's weights and
    num_nextn_predict_layers 1 to its config; returns the layer's tensors."""
    tensors = deepseek._tensors(folder)
    gen = torch.Generator().manual_seed(7)
    mtp = {}
    for name, tensor in tensors.items():  # a decoder layer like the last (MoE) one
        if name.startswith("model.layers.2."):
            noise = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype) * 0.1
            mtp[name.replace("model.layers.2.", "model.layers.3.")] = tensor + noise
    hidden = tensors["model.embed_tokens.weight"].shape[1]
    mtp["model.layers.3.enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp["model.layers.3.hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp["model.layers.3.eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
    mtp["model.layers.3.shared_head.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp["model.layers.3.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    mtp["model.layers.3.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    for file in folder.glob("*.safetensors"):
        file.unlink()
    save_file({**tensors, **mtp}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    return mtp


def test_deepseek_v3_mtp_layer_import_export(tmp_path):
    deepseek._make(tmp_path / "hf")
    hf_mtp = _with_mtp_layer(tmp_path / "hf")

    main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])
    model, config, _, _ = load_model(tmp_path / "ckpt")
    assert config.mtp_num_layers == 1
    ours = model.state_dict()
    pairs = {
        "mtp.layers.0.eh_proj.weight": "model.layers.3.eh_proj.weight",
        "mtp.layers.0.enorm.weight": "model.layers.3.enorm.weight",
        "mtp.layers.0.final_layernorm.weight": "model.layers.3.shared_head.norm.weight",
        "mtp.layers.0.transformer_layer.self_attention.linear_kv_down_proj.weight": (
            "model.layers.3.self_attn.kv_a_proj_with_mqa.weight"
        ),
        "mtp.layers.0.transformer_layer.mlp.router.expert_bias": (
            "model.layers.3.mlp.gate.e_score_correction_bias"
        ),
        "mtp.layers.0.transformer_layer.mlp.experts.local_experts.5.linear_fc2.weight": (
            "model.layers.3.mlp.experts.5.down_proj.weight"
        ),
    }
    for name, hf_name in pairs.items():
        assert torch.equal(ours[name], hf_mtp[hf_name]), name
    ids = torch.randint(0, deepseek.VOCAB, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():  # the MTP block computes: each depth's loss from the imported weights
        _, mtp = model.eval()(ids, labels=torch.roll(ids, -1, 1), return_mtp=True)
    assert mtp.per_token.shape == (1, 1, 12) and torch.isfinite(mtp.per_token).all()

    main(["export-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "out")])
    original, exported = deepseek._tensors(tmp_path / "hf"), deepseek._tensors(tmp_path / "out")
    copies = {"model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"}
    assert set(exported) == set(original) - copies
    for name, tensor in exported.items():
        assert torch.equal(tensor, original[name]), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == 1


def test_config_naming_mtp_layers_the_files_lack(tmp_path):
    """transformers saves no MTP layer whatever its config says: imported without one."""
    deepseek._make(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])
    model, imported, _, _ = load_model(tmp_path / "ckpt")
    assert imported.mtp_num_layers is None and model.mtp is None
