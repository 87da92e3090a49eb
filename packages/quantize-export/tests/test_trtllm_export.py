"""--export-format trtllm: ModelOpt's unified layout, checked structurally (TensorRT-LLM
does not run here): hf_quant_config.json, config.json, and tensors that unpack to mg's
dequantized weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mg.core.checkpoint import load_model
from mg.core.models.hf_mapping import split_qkv
from mg.quantize_export import cli
from mg.quantize_export.trtllm_export import pack_int4_in_uint8


def _unpack_modelopt(packed: torch.Tensor) -> torch.Tensor:
    """ModelOpt's unpack: uint8 [out/2, in] → signed int8 [out, in]."""
    low = (packed & 0x0F).to(torch.int16)
    high = (packed >> 4).to(torch.int16)
    low, high = torch.where(low >= 8, low - 16, low), torch.where(high >= 8, high - 16, high)
    return torch.stack([low, high], dim=1).reshape(-1, packed.shape[1]).to(torch.int8)


def test_pack_int4_in_uint8_round_trip() -> None:
    signed = torch.randint(-8, 8, (6, 4), dtype=torch.int8)
    packed = pack_int4_in_uint8(signed)
    assert packed.shape == (3, 4) and packed.dtype == torch.uint8
    assert packed[0, 0].item() == (signed[0, 0].item() & 0xF) | ((signed[1, 0].item() & 0xF) << 4)
    assert torch.equal(_unpack_modelopt(packed), signed)


@pytest.mark.parametrize(
    "recipe, extra, algo",
    [("int4_wo", ["--group-size", "32"], "W4A16_AWQ"), ("int8_wo", [], "W8A16")],
)
def test_modelopt_layout(recipe, extra, algo, trained_llama, tmp_path) -> None:
    _, ckpt = trained_llama
    save = tmp_path / "q"
    cli.main(["--no-progress", "--load", str(ckpt), "--save", str(save), "--recipe", recipe,
              *extra, "--export-format", "trtllm"])  # fmt: skip
    folder = save / "trtllm"
    quant = json.loads((folder / "hf_quant_config.json").read_text())["quantization"]
    assert quant["quant_algo"] == algo and quant["exclude_modules"] == ["lm_head"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["quantization_config"]["quant_method"] == "modelopt"
    state = load_file(folder / "model.safetensors")
    ours, mg_config, _, _ = load_model(save)
    qkv = ours.decoder.layers[0].self_attention.linear_qkv
    q_rows, _, _ = split_qkv(qkv.dequantized_weight(), mg_config)
    weight = state["model.layers.0.self_attn.q_proj.weight"]
    scale = state["model.layers.0.self_attn.q_proj.weight_scale"]
    if algo == "W4A16_AWQ":
        assert quant["group_size"] == 32 and quant["has_zero_point"] is False
        assert weight.dtype == torch.uint8 and weight.shape == (32, 64)
        assert scale.dtype == torch.float16 and scale.shape == (64, 2)
        values = _unpack_modelopt(weight).float() * scale.float().repeat_interleave(32, 1)
        assert torch.allclose(values, q_rows, rtol=1e-3, atol=1e-6)
    else:
        assert weight.dtype == torch.int8 and scale.shape == (64,)
        assert torch.allclose(weight.float() * scale[:, None], q_rows)
    assert "lm_head.weight" in state and state["lm_head.weight"].dtype == torch.float32


def test_recipes_without_a_modelopt_layout_are_refused_before_quantizing(
    trained_llama, tmp_path, capsys
) -> None:
    _, ckpt = trained_llama
    with pytest.raises(SystemExit) as exc:
        cli.main(["--load", str(ckpt), "--save", str(tmp_path / "q"), "--recipe", "int4_wo",
                  "--group-size", "32", "--asymmetric", "--export-format", "trtllm"])  # fmt: skip
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "ModelOpt has no layout for int4_wo (asymmetric)" in err and err.count("\n") == 1
    assert not (tmp_path / "q").exists()
