"""--export-format gguf: the file opens with gguf.GGUFReader, carries llama.cpp's
hyper-parameters and tokenizer, and its dequantized tensors equal mg's dequantized
weights (rows mapped to llama.cpp's q/k/v, gate/up and q/k RoPE permutation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from mg.core.checkpoint import load_model, save_model
from mg.core.models import GPTModel
from mg.core.models.hf_mapping import split_qkv
from mg.core.models.presets import tiny_gpt2
from mg.quantize_export import cli


def _permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def _tensors(path) -> tuple[GGUFReader, dict[str, np.ndarray]]:
    reader = GGUFReader(path)
    out = {}
    for t in reader.tensors:
        data = dequantize(t.data, t.tensor_type)
        out[t.name] = np.asarray(data, dtype=np.float32).reshape(
            [int(x) for x in reversed(t.shape)]
        )
    return reader, out


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


@pytest.mark.parametrize(
    "recipe, extra, kind, rtol",
    [
        ("int8_wo", [], "Q8_0", 1e-3),
        ("int4_wo", ["--group-size", "32"], "Q4_0", 1e-3),
        pytest.param(
            "int4_wo",
            ["--group-size", "64", "--asymmetric"],
            "Q4_1",
            None,
            marks=pytest.mark.slow,
        ),
    ],
)
def test_llama_gguf_equals_mg_dequantized(recipe, extra, kind, rtol, trained_llama, tmp_path):
    _, ckpt = trained_llama
    save = tmp_path / "q"
    cli.main(["--no-progress", "--load", str(ckpt), "--save", str(save), "--recipe", recipe,
              *extra, "--export-format", "gguf"])  # fmt: skip
    model, config, _, _ = load_model(save)
    reader, tensors = _tensors(save / "gguf" / f"model-{kind}.gguf")
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == 2
    assert _field(reader, "llama.attention.head_count_kv") == 2
    assert _field(reader, "tokenizer.ggml.model") == "gpt2"
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == config.vocab_size and tokens[464] == "The"
    assert _field(reader, "tokenizer.ggml.eos_token_id") == 50256
    layer = model.decoder.layers[1]
    qkv = layer.self_attention.linear_qkv.dequantized_weight()
    q, k, v = split_qkv(qkv, config)
    fc1 = layer.mlp.linear_fc1.dequantized_weight()
    ours = {
        "blk.1.attn_q.weight": _permute(q, 4),
        "blk.1.attn_k.weight": _permute(k, 2),
        "blk.1.attn_v.weight": v,
        "blk.1.attn_output.weight": layer.self_attention.linear_proj.dequantized_weight(),
        "blk.1.ffn_gate.weight": fc1[:128],
        "blk.1.ffn_up.weight": fc1[128:],
        "blk.1.ffn_down.weight": layer.mlp.linear_fc2.dequantized_weight(),
        "blk.1.attn_norm.weight": layer.input_layernorm.weight.detach(),
    }
    for name, expected in ours.items():
        got = torch.from_numpy(tensors[name].copy())
        if rtol is None:  # Q4_1: m = -z * d is rounded to fp16 on its own
            scale = layer.mlp.linear_fc2.weight_scale.max()
            assert (got - expected).abs().max() <= 2**-10 * 16 * scale * 2, name
        else:
            assert torch.allclose(got, expected, rtol=rtol, atol=1e-6), name
    assert tensors["output.weight"].shape == (config.vocab_size, 64)
    # the embedding and the float output layer: Q8_0 in a Q8_0 file, as llama.cpp's converter
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    table = "Q8_0" if kind == "Q8_0" else "F16"
    assert kinds["token_embd.weight"] == table and kinds["output.weight"] == table
    embedding = model.embedding.word_embeddings.weight.detach().float()
    got = torch.from_numpy(tensors["token_embd.weight"].copy())
    assert float((got - embedding).norm() / embedding.norm()) < (1e-2 if kind == "Q8_0" else 1e-3)


@pytest.mark.slow
def test_gpt2_gguf_f16(tokenizer_config, tmp_path) -> None:
    torch.manual_seed(0)
    config = tiny_gpt2(vocab_size=50304)
    model = GPTModel(config).eval()
    save_model(tmp_path / "float", model, config, tokenizer_config)
    save = tmp_path / "q"
    cli.main(["--no-progress", "--load", str(tmp_path / "float"), "--save", str(save),
              "--recipe", "int8_wo", "--export-format", "gguf", "--gguf-type", "F16"])  # fmt: skip
    quantized, _, _, _ = load_model(save)
    reader, tensors = _tensors(save / "gguf" / "model-F16.gguf")
    assert _field(reader, "general.architecture") == "gpt2"
    attention = quantized.decoder.layers[0].self_attention
    q, k, v = split_qkv(attention.linear_qkv.dequantized_weight(), config)
    expected = torch.cat([q, k, v]).half().float()
    assert torch.equal(torch.from_numpy(tensors["blk.0.attn_qkv.weight"].copy()), expected)
    qb, kb, vb = split_qkv(attention.linear_qkv.bias.detach()[:, None], config)
    assert torch.equal(
        torch.from_numpy(tensors["blk.0.attn_qkv.bias"].copy()), torch.cat([qb, kb, vb])[:, 0]
    )
    assert "position_embd.weight" in tensors and "output.weight" in tensors


def test_k_quant_falls_back_to_q8_0_for_short_rows(trained_llama, tmp_path) -> None:
    # the tiny model's rows hold 64 or 128 inputs, less than a K-quant super-block (256)
    _, ckpt = trained_llama
    save = tmp_path / "q"
    cli.main(["--no-progress", "--load", str(ckpt), "--save", str(save), "--recipe", "int8_wo",
              "--export-format", "gguf", "--gguf-type", "Q6_K"])  # fmt: skip
    reader, _ = _tensors(save / "gguf" / "model-Q6_K.gguf")
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.0.ffn_down.weight"] == "Q8_0" and kinds["blk.1.attn_q.weight"] == "Q8_0"


def _k_quant_export(tmp_path, tokenizer_config, layers: int, *flags: str):
    """A random Llama with rows of 256 values (K-quant super-blocks) through mg-quantize
    int8_wo and --export-format gguf with `flags` → (the quantized checkpoint, config)."""
    from mg.core.models.presets import tiny_llama

    torch.manual_seed(0)
    config = tiny_llama(
        vocab_size=50304, hidden_size=256, num_layers=layers, num_attention_heads=4,
        num_query_groups=2, ffn_hidden_size=256,
    )  # fmt: skip
    save_model(tmp_path / "float", GPTModel(config).eval(), config, tokenizer_config)
    save = tmp_path / "q"
    cli.main(["--no-progress", "--load", str(tmp_path / "float"), "--save", str(save),
              "--recipe", "int8_wo", "--export-format", "gguf", *flags])  # fmt: skip
    return save, config


@pytest.mark.slow
@pytest.mark.parametrize("kind, bound", [("Q6_K", 0.02), ("Q4_K", 0.08)])
def test_llama_gguf_k_quants(kind, bound, tokenizer_config, tmp_path) -> None:
    save, _ = _k_quant_export(tmp_path, tokenizer_config, 1, "--gguf-type", kind)
    model, _, _, _ = load_model(save)
    reader, tensors = _tensors(save / "gguf" / f"model-{kind}.gguf")
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    layer = model.decoder.layers[0]
    fc1 = layer.mlp.linear_fc1.dequantized_weight()
    ours = {
        "blk.0.attn_output.weight": layer.self_attention.linear_proj.dequantized_weight(),
        "blk.0.ffn_gate.weight": fc1[:256],
        "blk.0.ffn_up.weight": fc1[256:],
        "blk.0.ffn_down.weight": layer.mlp.linear_fc2.dequantized_weight(),
    }
    for name, expected in ours.items():
        assert kinds[name] == kind, name
        got = torch.from_numpy(tensors[name].copy())
        assert float((got - expected).norm() / expected.norm()) < bound, name


def test_more_bits_layers_are_llama_cpp_s() -> None:
    from mg.quantize_export.gguf_export import more_bits

    # use_more_bits: i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2
    assert [i for i in range(8) if more_bits(i, 8)] == [0, 3, 6, 7]
    expected = [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(32) if more_bits(i, 32)] == expected


@pytest.mark.slow  # 15 s each; test_more_bits_layers_are_llama_cpp_s runs by default
@pytest.mark.parametrize("mix, base", [("Q4_K_M", "Q4_K"), ("Q5_K_M", "Q5_K")])
def test_llama_gguf_k_mixes(mix, base, tokenizer_config, tmp_path) -> None:
    """llama.cpp's _M mixes: attn_v and ffn_down in Q6_K in the more-bits layers (0, 3, 6
    and 7 of 8), the base type elsewhere, a quantized output layer in Q6_K; every tensor
    dequantizes close to mg's own weights."""
    save, config = _k_quant_export(
        tmp_path, tokenizer_config, 8, "--quantize-output-layer", "--gguf-type", mix
    )
    model, _, _, _ = load_model(save)
    reader, tensors = _tensors(save / "gguf" / f"model-{mix}.gguf")
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    for i in range(8):
        sensitive = "Q6_K" if i in (0, 3, 6, 7) else base
        assert kinds[f"blk.{i}.attn_v.weight"] == sensitive
        assert kinds[f"blk.{i}.ffn_down.weight"] == sensitive
        for name in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
            assert kinds[f"blk.{i}.{name}.weight"] == base
    assert kinds["output.weight"] == "Q6_K" and kinds["token_embd.weight"] == "F16"
    import gguf

    file_type = gguf.LlamaFileType[f"MOSTLY_{mix}"]
    assert int(_field(reader, "general.file_type")) == file_type
    layer = model.decoder.layers[3]
    qkv = layer.self_attention.linear_qkv.dequantized_weight()
    v = split_qkv(qkv, config)[2]
    for name, expected, bound in [
        ("blk.3.attn_v.weight", v, 0.02),
        ("blk.3.ffn_down.weight", layer.mlp.linear_fc2.dequantized_weight(), 0.02),
        (
            "blk.1.ffn_down.weight",
            model.decoder.layers[1].mlp.linear_fc2.dequantized_weight(),
            0.08,
        ),
        ("output.weight", model.output_layer.dequantized_weight(), 0.02),
    ]:
        got = torch.from_numpy(tensors[name].copy())
        assert float((got - expected).norm() / expected.norm()) < bound, name


def test_float_llama_gguf_f32_is_exact(tokenizer_config, tmp_path) -> None:
    """write_gguf of a float model in F32: every tensor F32 and equal to the weights
    (embedding and output layer too), q/k rows permuted as llama.cpp's converter does."""
    import gguf

    from mg.core.models.presets import tiny_llama
    from mg.quantize_export.gguf_export import write_gguf

    torch.manual_seed(0)
    config = tiny_llama(vocab_size=50304, ffn_hidden_size=128)
    model = GPTModel(config).eval()
    write_gguf(tmp_path / "m.gguf", model, config, tokenizer_config, tmp_path, "F32")
    reader, tensors = _tensors(tmp_path / "m.gguf")
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    assert int(_field(reader, "general.file_type")) == gguf.LlamaFileType.ALL_F32
    layer = model.decoder.layers[1]
    q, k, v = split_qkv(layer.self_attention.linear_qkv.weight.detach(), config)
    embedding = model.embedding.word_embeddings.weight.detach()
    ours = {
        "blk.1.attn_q.weight": _permute(q, 4),
        "blk.1.attn_k.weight": _permute(k, 2),
        "blk.1.attn_v.weight": v,
        "blk.1.ffn_down.weight": layer.mlp.linear_fc2.weight.detach(),
        "token_embd.weight": embedding,
        "output.weight": model.output_layer.weight.detach(),
    }
    for name, expected in ours.items():
        assert torch.equal(torch.from_numpy(tensors[name].copy()), expected), name
