"""mg-convert for mixture-of-experts models: Mixtral and Qwen3-MoE from transformers →
import-hf → our logits; export-hf → transformers loads it without warnings, same logits;
the exported tensors equal the input bit for bit."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.core.checkpoint.model_io import load_model  # noqa: E402

pytestmark = pytest.mark.compat

TOL = 1e-4
TINY = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _make(family: str, folder):
    torch.manual_seed(0)
    if family == "mixtral":
        config = transformers.MixtralConfig(
            **TINY, num_local_experts=4, num_experts_per_tok=2, router_jitter_noise=0.0
        )
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen3MoeConfig(
            **TINY,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            mlp_only_layers=[0],
        )
        model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if name.endswith("gate.weight") else 0.02))
    model.eval().save_pretrained(folder)
    return model


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_import_export_round_trip(family, tmp_path):
    hf = _make(family, tmp_path / "hf")
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits

    main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])
    model, config, _, _ = load_model(tmp_path / "ckpt")
    assert config.num_moe_experts == 4 and config.moe_router_topk == 2
    with torch.no_grad():
        ours = model.eval()(ids)[..., :128]
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
    with torch.no_grad():
        again = reloaded(ids).logits
    assert (again - expected).abs().max().item() <= TOL
    original, exported = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
