"""--export-format hf: a compressed-tensors folder that transformers (with the
compressed-tensors package) loads; its logits match mg's quantized model's within the
quantization's own error (a fraction of the float model's distance to them)."""

from __future__ import annotations

import json

import pytest
import torch

from mg.core.checkpoint import load_model
from mg.quantize_export import cli
from mg.quantize_export.hf_export import pack_int4_to_int32


def test_int4_packing_matches_compressed_tensors() -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    q = torch.randint(0, 16, (16, 64), dtype=torch.int8)
    assert torch.equal(pack_int4_to_int32(q), pack_to_int32(q - 8, 4))
    z = torch.randint(0, 16, (16, 2), dtype=torch.int8)
    assert torch.equal(pack_int4_to_int32(z, dim=0), pack_to_int32(z - 8, 4, packed_dim=0))


@pytest.mark.parametrize(
    "recipe, extra",
    [
        ("int8_wo", []),
        ("int4_wo", ["--group-size", "32"]),
        ("fp8", ["--calib"]),
    ],
)
def test_transformers_loads_the_export(recipe, extra, trained_llama, datasets, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    float_model, ckpt = trained_llama
    if "--calib" in extra:
        extra = [
            "--calib-data-path",
            datasets[0],
            "--calib-samples",
            "4",
            "--calib-seq-length",
            "32",
        ]
    save = tmp_path / "q"
    cli.main(["--no-progress", "--load", str(ckpt), "--save", str(save), "--recipe", recipe,
              *extra, "--export-format", "hf"])  # fmt: skip
    config = json.loads((save / "hf" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    ours, _, _, _ = load_model(save)
    hf = AutoModelForCausalLM.from_pretrained(save / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([[464, 3290, 318, 257, 1310, 286, 262, 995]])
    with torch.no_grad():
        theirs = hf(ids).logits
        mine = ours(ids)
        reference = float_model(ids)
    quantization_error = (mine - reference).abs().max()
    assert quantization_error > 0
    assert (theirs - mine).abs().max() <= 0.25 * quantization_error + 1e-4


def test_asymmetric_int4_decompresses_with_compressed_tensors(trained_llama, tmp_path) -> None:
    """transformers 5 cannot load asymmetric pack-quantized folders yet (its parameters
    expect unpacked zero points: vllm-project/llm-compressor#1618), so the export is
    checked with compressed-tensors' own decompressor, which vLLM's loader follows."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from safetensors.torch import load_file

    from mg.core.models.hf_mapping import split_qkv

    _, ckpt = trained_llama
    save = tmp_path / "q"
    cli.main(["--no-progress", "--load", str(ckpt), "--save", str(save), "--recipe", "int4_wo",
              "--group-size", "64", "--asymmetric", "--export-format", "hf"])  # fmt: skip
    config = json.loads((save / "hf" / "config.json").read_text())["quantization_config"]
    group = config["config_groups"]["group_0"]
    scheme = QuantizationScheme(targets=group["targets"], weights=group["weights"])
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    state = load_file(save / "hf" / "model.safetensors")
    ours, mg_config, _, _ = load_model(save)
    qkv = ours.decoder.layers[1].self_attention.linear_qkv.dequantized_weight()
    fc1 = ours.decoder.layers[1].mlp.linear_fc1.dequantized_weight()
    expected = dict(zip(("q_proj", "k_proj", "v_proj"), split_qkv(qkv, mg_config), strict=True))
    expected.update(gate_proj=fc1[:128], up_proj=fc1[128:])
    for name, weight in expected.items():
        section = "self_attn" if name in ("q_proj", "k_proj", "v_proj") else "mlp"
        prefix = f"model.layers.1.{section}.{name}."
        module_state = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
        assert "weight_zero_point" in module_state
        out = compressor.decompress(module_state, scheme)
        assert torch.allclose(out["weight"].float(), weight, atol=1e-6), name


def test_quantized_output_layer_round_trips(trained_llama, datasets, tmp_path) -> None:
    """--quantize-output-layer: the logits run through the int8 output layer, in mg's
    reloaded checkpoint and in the compressed-tensors export (lm_head no longer ignored);
    a tied model is refused by name."""
    from transformers import AutoModelForCausalLM

    from mg.core.quantization import Int8WeightOnlyLinear

    float_model, ckpt = trained_llama
    save, report = tmp_path / "q", tmp_path / "report.json"
    cli.main(["--no-progress", "--load", str(ckpt), "--save", str(save), "--recipe", "int8_wo",
              "--quantize-output-layer", "--eval-data-path", datasets[1], "--eval-samples", "4",
              "--report", str(report), "--export-format", "hf"])  # fmt: skip
    data = json.loads(report.read_text())
    assert data["quantized_linears"] == 9 and abs(data["ppl_change_pct"]) < 1, data
    config = json.loads((save / "hf" / "config.json").read_text())
    assert "lm_head" not in config["quantization_config"]["ignore"]
    ours, _, _, _ = load_model(save)
    assert isinstance(ours.output_layer, Int8WeightOnlyLinear)
    hf = AutoModelForCausalLM.from_pretrained(save / "hf", dtype=torch.float32).eval()
    ids = torch.tensor([[464, 3290, 318, 257, 1310, 286, 262, 995]])
    with torch.no_grad():
        mine, theirs, reference = ours(ids), hf(ids).logits, float_model(ids)
        # the output layer's own error is in the logits: the dequantized weight's
        expected = torch.nn.functional.linear(
            ours.decoder(ours.embedding(ids, torch.arange(8)[None]), ours.rotary_pos_emb(
                torch.arange(8)[None])), ours.output_layer.dequantized_weight()
        )  # fmt: skip
    assert (mine - expected).abs().max() < 1e-4
    quantization_error = (mine - reference).abs().max()
    assert quantization_error > 0
    assert (theirs - mine).abs().max() <= 0.25 * quantization_error + 1e-4


def test_quantize_output_layer_refuses_tied_weights(tokenizer_config, tmp_path, capsys) -> None:
    from mg.core.checkpoint import save_model
    from mg.core.models import GPTModel
    from mg.core.models.presets import tiny_llama

    config = tiny_llama(vocab_size=50304, seq_length=32, max_position_embeddings=32)
    config.untie_embeddings_and_output_weights = False
    save_model(tmp_path / "tied", GPTModel(config), config, tokenizer_config)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--no-progress", "--load", str(tmp_path / "tied"), "--save",
                  str(tmp_path / "q"), "--recipe", "int8_wo",
                  "--quantize-output-layer"])  # fmt: skip
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mg-quantize: error: --quantize-output-layer") and "\n" not in err
    assert not (tmp_path / "q").exists()
