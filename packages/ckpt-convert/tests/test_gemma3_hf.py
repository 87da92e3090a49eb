"""mg-convert for Gemma 3 (text): a random Gemma3ForCausalLM from transformers →
import-hf → our logits (fp32, a sequence longer than the sliding window, both layer
types); export-hf → transformers loads it without warnings, same logits; the exported
tensors and config fields equal the input's."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

transformers = pytest.importorskip("transformers")

from mg.ckpt_convert.cli import main  # noqa: E402
from mg.core.checkpoint.model_io import load_model  # noqa: E402

pytestmark = pytest.mark.compat

TOL = 1e-4
VOCAB = 128
WINDOW = 6


def _config():
    return transformers.Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=WINDOW,
        sliding_window_pattern=3,  # sliding, sliding, full
        query_pre_attn_scalar=16,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )


def _make(folder) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(_config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.1)
    model.eval().save_pretrained(folder)
    return model


def _tensors(folder) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def test_gemma3_import_export_round_trip(tmp_path):
    hf = _make(tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, 4 * WINDOW), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids).logits

    main(["import-hf", str(tmp_path / "hf"), "--save", str(tmp_path / "ckpt")])
    model, config, _, _ = load_model(tmp_path / "ckpt")
    assert config.window_size == (WINDOW - 1, 0) and config.window_attn_skip_freq == 3
    assert config.sandwich_norms and config.softmax_scale == 0.25
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
    assert type(reloaded).__name__ == "Gemma3ForCausalLM"
    with torch.no_grad():
        again = reloaded(ids).logits
    assert torch.equal(again, expected)
    original, exported = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(exported) == set(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    for key in ("layer_types", "sliding_window", "query_pre_attn_scalar", "rope_parameters"):
        assert written[key] == source[key], key


def test_a_trained_gemma3_shaped_model_exports_as_gemma3():
    """A model trained by mg-train (no recorded HF type) with sandwich norms is Gemma 3's."""
    import dataclasses

    from mg.ckpt_convert.export_hf import guess_architecture
    from mg.core.models.hf_mapping import config_from_hf

    config = config_from_hf(json.loads(_config().to_json_string()))
    assert guess_architecture(dataclasses.replace(config, extra={}), []) == "gemma3_text"
