"""GGUF for llama.cpp: the quantized model's linears as Q8_0 / Q4_0 / Q4_1 blocks, Q4_K /
Q5_K / Q6_K super-blocks (or F16 / BF16 / F32), norms in F32, embeddings in F16 (in BF16
/ F32 in those files), with the hyper-parameters and tokenizer llama.cpp reads.

``Q4_K_M`` / ``Q5_K_M`` are llama.cpp's mixes (``llama_tensor_get_type``): Q4_K / Q5_K,
with the value projection (``attn_v``, or GPT-2's fused ``attn_qkv``) and ``ffn_down`` in
Q6_K in the layers where llama.cpp spends more bits (the first and last eighth and every
third layer between), and a quantized output layer in Q6_K. ``Q4_K`` and ``Q5_K`` alone
are the "S" files: every linear in one type. In a Q8_0 file the token embedding and a
float output layer are Q8_0 too, as llama.cpp's converter writes them
(``convert_hf_to_gguf.py --outtype q8_0``); in the other quantized types they stay F16.

mg's own blocks are carried over exactly where the formats coincide: ``int8_wo`` is
Q8_0 with every block of a row scaled by the row's scale; symmetric int4 (any group
size that is a multiple of 32) is Q4_0, asymmetric int4 is Q4_1. Otherwise (fp8,
int8_sq, or a ``--gguf-type`` other than the recipe's own) the dequantized weight is
quantized by llama.cpp's own rules (:mod:`.gguf_blocks`). K-quants need rows of a
multiple of 256 values; a linear with shorter rows is written as Q8_0 (llama.cpp falls
back too).

Architectures: ``llama`` (RMSNorm + RoPE + SwiGLU: Llama, Mistral) with q/k rows
permuted as llama.cpp's converter does, and ``gpt2`` (LayerNorm, learned positions,
fused [q; k; v]).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from mg.core.models import TransformerConfig
from mg.core.models.hf_mapping import split_qkv
from mg.core.models.norms import LayerNorm1P, RMSNorm1P
from mg.core.quantization import Int4WeightOnlyLinear, Int8WeightOnlyLinear, QuantizedLinear
from mg.core.quantization.primitives import unpack_int4
from mg.core.tokenizers.config import TokenizerConfig
from mg.quantize_export.errors import QuantizeInputError
from mg.quantize_export.gguf_blocks import QK_K, QUANTIZERS, q4_from_int4, q8_0_from_int8

DEFAULT_TYPE = {"int8_wo": "Q8_0", "int8_sq": "Q8_0", "fp8": "Q8_0"}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
K_MIXES = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}  # llama.cpp's _M files: their base type


def more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v / ffn_down a _M mix keeps in
    Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def default_gguf_type(recipe: str, symmetric: bool) -> str:
    return DEFAULT_TYPE.get(recipe, "Q4_0" if symmetric else "Q4_1")


def gguf_architecture(config: TransformerConfig) -> str:
    rope_rms = config.normalization == "RMSNorm" and config.position_embedding_type == "rope"
    if rope_rms and config.gated_linear_unit and not config.add_bias_linear:
        return "llama"
    if config.normalization == "LayerNorm" and config.position_embedding_type == (
        "learned_absolute"
    ):
        return "gpt2"
    raise QuantizeInputError(
        "--export-format gguf: unsupported architecture (GGUF export writes llama-style "
        "RMSNorm/RoPE/SwiGLU models and GPT-2)"
    )


def _encode_linear(module: nn.Module, gguf_type: str) -> tuple[str, np.ndarray]:
    """A linear's [out, in] weight as rows of GGUF data."""
    if gguf_type == "Q8_0" and isinstance(module, Int8WeightOnlyLinear):
        return "Q8_0", q8_0_from_int8(module.qweight, module.weight_scale).numpy()
    if gguf_type in ("Q4_0", "Q4_1") and isinstance(module, Int4WeightOnlyLinear):
        q = unpack_int4(module.qweight)
        kind, blocks = q4_from_int4(q, module.weight_scale, module.weight_zero_point)
        if kind == gguf_type and module.group_size % 32 == 0:
            return kind, blocks.numpy()
    weight = (
        module.dequantized_weight() if isinstance(module, QuantizedLinear) else module.weight
    ).detach()
    if gguf_type in K_QUANTS and weight.shape[1] % QK_K:
        gguf_type = "Q8_0"  # rows shorter than a super-block: llama.cpp also falls back
    if gguf_type in QUANTIZERS:
        return gguf_type, QUANTIZERS[gguf_type](weight).numpy()
    return _encode_float(weight, gguf_type)


def norm_gamma(norm: nn.Module) -> Tensor:
    """The scale a norm multiplies by: its weight, or 1 + weight for a zero-centred norm
    (--apply-layernorm-1p), which llama.cpp's norms do not know."""
    weight = norm.weight.detach()
    return weight + 1 if isinstance(norm, (LayerNorm1P, RMSNorm1P)) else weight


def _encode_table(t: Tensor, gguf_type: str, float_type: str) -> tuple[str, np.ndarray]:
    """The token embedding or a float output layer [rows, hidden]: Q8_0 in a Q8_0 file where
    the rows are whole blocks of 32, else in `float_type`."""
    if gguf_type == "Q8_0" and t.shape[1] % 32 == 0:
        return "Q8_0", QUANTIZERS["Q8_0"](t.detach().float()).numpy()
    return _encode_float(t, float_type)


def _encode_float(t: Tensor, gguf_type: str) -> tuple[str, np.ndarray]:
    t = t.detach().float()
    if gguf_type == "BF16":
        return "BF16", t.to(torch.bfloat16).view(torch.int16).numpy()
    if gguf_type == "F32":
        return "F32", t.numpy()
    return "F16", t.to(torch.float16).numpy()


def _permute(index: Tensor, heads: int) -> Tensor:
    """llama.cpp's converter: HF's rotate-half q/k rows → GGML's interleaved RoPE rows."""
    return index.reshape(heads, 2, index.shape[0] // heads // 2).swapaxes(1, 2).reshape(-1)


def _row_maps(arch: str, config: TransformerConfig, qkv_rows: int, fc1_rows: int):
    """GGUF tensor suffix → rows of linear_qkv / linear_fc1 that make it."""
    index = torch.arange(qkv_rows)[:, None]
    q, k, v = (t.reshape(-1) for t in split_qkv(index, config))
    half = fc1_rows // 2
    if arch == "llama":
        qkv = {
            "attn_q": _permute(q, config.num_attention_heads),
            "attn_k": _permute(k, config.num_query_groups),
            "attn_v": v,
        }
        fc1 = {"ffn_gate": torch.arange(half), "ffn_up": torch.arange(half, fc1_rows)}
    else:
        qkv = {"attn_qkv": torch.cat([q, k, v])}
        fc1 = {"ffn_up": torch.arange(fc1_rows)}
    return qkv, fc1


def _tokenizer_vocab(tokenizer_config: TokenizerConfig | None, root: Path):
    """(tokens by id, merges, special ids) of a byte-level BPE tokenizer."""
    if tokenizer_config is None:
        raise QuantizeInputError("--export-format gguf needs a tokenizer; the checkpoint has none")

    def path(value: str) -> Path:
        p = Path(value)
        return p if p.is_absolute() else root / p

    kind = tokenizer_config.tokenizer_type
    if kind == "GPT2BPETokenizer":
        vocab = json.loads(path(tokenizer_config.vocab_file).read_text(encoding="utf-8"))
        lines = path(tokenizer_config.merge_file).read_text(encoding="utf-8").splitlines()
        merges = [m for m in lines if m and not m.startswith("#version")]
        special = {"<|endoftext|>"}
    elif kind == "HuggingFaceTokenizer":
        data = json.loads(
            (path(tokenizer_config.tokenizer_model) / "tokenizer.json").read_text("utf-8")
        )
        if data["model"]["type"] != "BPE":
            raise QuantizeInputError(
                f"--export-format gguf: tokenizer model {data['model']['type']} is not supported "
                "(byte-level BPE only)"
            )
        vocab = dict(data["model"]["vocab"])
        for added in data.get("added_tokens", []):
            vocab[added["content"]] = added["id"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
        special = {a["content"] for a in data.get("added_tokens", []) if a.get("special")}
    else:
        raise QuantizeInputError(
            f"--export-format gguf: tokenizer {kind} is not supported yet (GPT-2 BPE and "
            "Hugging Face byte-level BPE tokenizers are)"
        )
    tokens = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        tokens[i] = token
    return tokens, merges, {vocab[s] for s in special if s in vocab}


def write_gguf(
    path: Path,
    model: nn.Module,
    config: TransformerConfig,
    tokenizer_config: TokenizerConfig | None,
    tokenizer_root: Path,
    gguf_type: str,
) -> dict:
    # lazy: gguf (llama.cpp's writer and its tables) only for --export-format gguf
    import gguf

    arch = gguf_architecture(config)
    tokens, merges, special = _tokenizer_vocab(tokenizer_config, tokenizer_root)
    vocab_size = config.vocab_size
    if len(tokens) > vocab_size:
        raise QuantizeInputError(
            f"--export-format gguf: the tokenizer has {len(tokens)} tokens, the model {vocab_size}"
        )
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
        for i in range(len(tokens))
    ]
    pad = vocab_size - len(tokens)  # Megatron's padded vocabulary: unused tokens, as llama.cpp pads
    tokens += [f"[PAD{i}]" for i in range(pad)]
    types += [gguf.TokenType.UNUSED] * pad

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(path.stem)
    writer.add_context_length(config.max_position_embeddings or config.seq_length)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_layers)
    writer.add_feed_forward_length(config.ffn_hidden_size)
    writer.add_head_count(config.num_attention_heads)
    if arch == "llama":
        writer.add_head_count_kv(config.num_query_groups)
        writer.add_rope_freq_base(float(config.rotary_base))
        writer.add_layer_norm_rms_eps(config.layernorm_epsilon)
        writer.add_rope_dimension_count(config.kv_channels)
        writer.add_vocab_size(vocab_size)
    else:
        writer.add_layer_norm_eps(config.layernorm_epsilon)
    writer.add_file_type(
        {
            "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
            "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
            "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
            "Q4_K": gguf.LlamaFileType.MOSTLY_Q4_K_S,  # every linear Q4_K: llama.cpp's "S"
            "Q4_K_M": gguf.LlamaFileType.MOSTLY_Q4_K_M,
            "Q5_K": gguf.LlamaFileType.MOSTLY_Q5_K_S,
            "Q5_K_M": gguf.LlamaFileType.MOSTLY_Q5_K_M,
            "Q6_K": gguf.LlamaFileType.MOSTLY_Q6_K,
            "F16": gguf.LlamaFileType.MOSTLY_F16,
            "BF16": gguf.LlamaFileType.MOSTLY_BF16,
            "F32": gguf.LlamaFileType.ALL_F32,
        }[gguf_type]
    )
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eod = min(special) if special else 0
    writer.add_bos_token_id(eod)
    writer.add_eos_token_id(eod)

    tensor_types: dict[str, str] = {}
    float_type = gguf_type if gguf_type in ("BF16", "F32") else "F16"
    base_type = K_MIXES.get(gguf_type, gguf_type)

    def sensitive_type(layer: int) -> str:
        """attn_v's / ffn_down's type in layer `layer`."""
        mix = gguf_type in K_MIXES and more_bits(layer, config.num_layers)
        return "Q6_K" if mix else base_type

    def put(name: str, kind: str, data: np.ndarray) -> None:
        tensor_types[name] = kind
        qtype = gguf.GGMLQuantizationType[kind]
        if kind in ("Q8_0", "Q4_0", "Q4_1", *K_QUANTS, "BF16"):
            writer.add_tensor(name, np.ascontiguousarray(data), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))

    def norm(prefix: str, module: nn.Module) -> None:
        put(f"{prefix}.weight", *_encode_float(norm_gamma(module), "F32"))
        if getattr(module, "bias", None) is not None:
            put(f"{prefix}.bias", *_encode_float(module.bias, "F32"))

    def bias(prefix: str, module: nn.Module, rows: Tensor | None = None) -> None:
        if module.bias is not None:
            b = module.bias.detach() if rows is None else module.bias.detach()[rows]
            put(f"{prefix}.bias", *_encode_float(b, "F32"))

    embedding = model.embedding.word_embeddings.weight
    embedding_table = _encode_table(embedding, gguf_type, float_type)
    put("token_embd.weight", *embedding_table)
    if model.embedding.position_embeddings is not None:
        put(
            "position_embd.weight",
            *_encode_float(model.embedding.position_embeddings.weight, "F32"),
        )
    for i, layer in enumerate(model.decoder.layers):
        blk = f"blk.{i}"
        attention, mlp = layer.self_attention, layer.mlp
        qkv_maps, fc1_maps = _row_maps(
            arch, config, attention.linear_qkv.out_features, mlp.linear_fc1.out_features
        )
        norm(f"{blk}.attn_norm", layer.input_layernorm)
        encoded: dict[str, tuple[str, np.ndarray]] = {}  # qkv rows by type (v may differ)
        for name, index in qkv_maps.items():
            wanted = sensitive_type(i) if name in ("attn_v", "attn_qkv") else base_type
            if wanted not in encoded:
                encoded[wanted] = _encode_linear(attention.linear_qkv, wanted)
            kind, rows = encoded[wanted]
            put(f"{blk}.{name}.weight", kind, rows[index.numpy()])
            bias(f"{blk}.{name}", attention.linear_qkv, index)
        put(f"{blk}.attn_output.weight", *_encode_linear(attention.linear_proj, base_type))
        bias(f"{blk}.attn_output", attention.linear_proj)
        norm(f"{blk}.ffn_norm", layer.pre_mlp_layernorm)
        kind, rows = _encode_linear(mlp.linear_fc1, base_type)
        for name, index in fc1_maps.items():
            put(f"{blk}.{name}.weight", kind, rows[index.numpy()])
            bias(f"{blk}.{name}", mlp.linear_fc1, index)
        put(f"{blk}.ffn_down.weight", *_encode_linear(mlp.linear_fc2, sensitive_type(i)))
        bias(f"{blk}.ffn_down", mlp.linear_fc2)
    norm("output_norm", model.decoder.final_layernorm)
    output = model.output_layer if model.output_layer is not None else None
    if output is None:  # tied: llama.cpp's gpt2 converter writes the copy as output.weight
        put("output.weight", *embedding_table)  # (encoded once for both)
    elif isinstance(output, QuantizedLinear):  # a _M mix writes it in Q6_K, as llama.cpp
        put("output.weight", *_encode_linear(output, "Q6_K" if gguf_type in K_MIXES else gguf_type))
    else:
        put("output.weight", *_encode_table(output.weight, gguf_type, float_type))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"format": "gguf", "path": str(path), "architecture": arch, "tensor_types": tensor_types}
