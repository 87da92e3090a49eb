"""mg-convert for DeepSeek-V3: a random DeepseekV3ForCausalLM from transformers (multi-latent
attention with YaRN, a dense first layer, sigmoid-routed experts with a score-correction
bias, group-limited top-k, a shared expert) → import-hf → our logits within 1e-4 (fp32);
export-hf → transformers loads it without warnings and gives the same logits; the
exported tensors and config fields equal the input's bit for bit."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.core.checkpoint.model_io import load_model  # noqa: E402
from mg.core.models.mla import MLASelfAttention  # noqa: E402

pytestmark = pytest.mark.compat

TOL = 1e-4
VOCAB = 128


def _config(q_lora_rank: int | None = 32):
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=16,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        routed_scaling_factor=2.5,
        kv_lora_rank=24,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        v_head_dim=12,
        qk_nope_head_dim=16,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=4,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 32,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )


def _make(folder, q_lora_rank: int | None = 32) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(_config(q_lora_rank))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 0.2 if "norm" in name else 0.1)
        for layer in model.model.layers[1:]:  # a bias that changes which experts win
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.1)
    model.eval().save_pretrained(folder)
    return model


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["q-lora", "q-proj"])
def test_deepseek_v3_import_export_round_trip(tmp_path, q_lora_rank):
    hf = _make(tmp_path / "hf", q_lora_rank)
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits

    main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])
    model, config, _, _ = load_model(tmp_path / "ckpt")
    assert config.multi_latent_attention and config.rope_type == "yarn"
    assert config.moe_layer_pattern == [False, True, True]
    assert isinstance(model.decoder.layers[0].self_attention, MLASelfAttention)
    with torch.no_grad():
        ours = model.eval()(ids)[..., :VOCAB]
    assert (ours - expected).abs().max().item() <= TOL

    main(["export-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "out")])
    records: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Handler(logging.WARNING)
    transformers.utils.logging.get_logger().addHandler(handler)
    try:
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    finally:
        transformers.utils.logging.get_logger().removeHandler(handler)
    assert not [r for r in records if "weight" in r.lower()], records
    assert type(reloaded).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, expected)
    original, exported = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in (
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_group",
        "topk_group",
        "routed_scaling_factor",
        "first_k_dense_replace",
        "n_shared_experts",
        "rope_parameters",
    ):
        assert written[key] == source[key], key


def test_deepseek_v3_configs_it_cannot_run_are_refused_by_field():
    from mg.core.models.hf_mapping import config_from_hf

    config = json.loads(_config().to_json_string())
    with pytest.raises(ValueError, match="rope_interleave"):
        config_from_hf({**config, "rope_interleave": False})
    with pytest.raises(ValueError, match="topk_group"):
        config_from_hf({**config, "topk_group": 1})
    with pytest.raises(ValueError, match="norm_topk_prob"):
        config_from_hf({**config, "norm_topk_prob": False})


def test_a_trained_mla_model_exports_as_deepseek_v3():
    """A model trained by mg-train (no recorded HF type) with MLA is DeepSeek-V3's."""
    import dataclasses

    from mg.ckpt_convert.export_hf import guess_architecture
    from mg.core.models.hf_mapping import config_from_hf

    config = config_from_hf(json.loads(_config().to_json_string()))
    assert guess_architecture(dataclasses.replace(config, extra={}), []) == "deepseek_v3"
