"""`mg-convert import-gguf`: a llama.cpp GGUF file (Llama / Mistral / Qwen2 / Qwen3) → mg.

The file is read as if it were the Hugging Face model it was converted from: its
metadata becomes that model's config.json (:mod:`.gguf_config`), its tensors are
dequantized and renamed to Hugging Face names with llama.cpp's q/k permutation undone
(:mod:`.gguf_file`), its vocabulary becomes a tokenizer.json (:mod:`.gguf_tokenizer`).
From there it is import-hf's path: the same tables, shape checks, vocabulary padding,
streaming writer and atomic staging, and the same ``config.extra`` (so export-hf gives
a Hugging Face folder back).

Quantized weights are stored dequantized, float32 by default (every value of a GGUF
block is exact in float32); ``dtype`` casts them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mg.ckpt_convert.architectures import model_config_of_hf
from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.gguf_config import generation_config_of, gguf_architecture, hf_config_of_gguf
from mg.ckpt_convert.gguf_file import ROPE_FREQS, GGUFWeights, dequantized, metadata, open_reader
from mg.ckpt_convert.gguf_rope import llama3_scaling
from mg.ckpt_convert.gguf_tokenizer import write_tokenizer
from mg.ckpt_convert.import_hf import DTYPES, TOKENIZER_DIR, write_release
from mg.ckpt_convert.staging import check_target, staged_dir
from mg.core.models import TransformerConfig, pad_vocab_size
from mg.core.tokenizers.config import TokenizerConfig


def _output_is_embedding_copy(reader) -> bool:
    """No output.weight (llama.cpp's tied models), or one stored byte for byte as the
    embedding (a converter's copy of a tied weight): either way the model is tied."""
    tensors = {t.name: t for t in reader.tensors}
    output, embedding = tensors.get("output.weight"), tensors.get("token_embd.weight")
    if output is None:
        return True
    if embedding is None or output.tensor_type != embedding.tensor_type:
        return False
    return output.data.shape == embedding.data.shape and (output.data == embedding.data).all()


def _vocab_size(meta: dict, reader, path: Path, arch: str) -> int:
    if f"{arch}.vocab_size" in meta:
        return int(meta[f"{arch}.vocab_size"])
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens:
        return len(tokens)
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embedding is None:
        raise ConvertError(f"{path} has no token_embd.weight: not a language model's weights")
    return int(embedding.shape[-1])


def rope_scaling_of(reader, path: Path, head_dim: int, base: float) -> dict | None:
    """Llama 3.1-style scaling from rope_freqs.weight (None when the file has none)."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    scaling = llama3_scaling(dequantized(tensor, path).numpy(), head_dim, base)
    if scaling is None:
        raise ConvertError(
            f"{path}: {ROPE_FREQS} holds RoPE frequency factors that no Llama 3.1-style "
            "(llama3) scaling reproduces; import the Hugging Face model with import-hf"
        )
    return scaling or None


def model_config_of_gguf(
    meta: dict, reader, path: Path, tied: bool, make_vocab_size_divisible_by: int
) -> TransformerConfig:
    """The file's TransformerConfig, with Megatron's padded vocabulary and import-hf's
    ``extra`` (hf_model_type, hf_vocab_size, hf_config, hf_generation_config)."""
    arch = gguf_architecture(meta, path)
    hf_config = hf_config_of_gguf(meta, path, tied, _vocab_size(meta, reader, path, arch))
    rope_scaling = rope_scaling_of(reader, path, hf_config["head_dim"], hf_config["rope_theta"])
    if rope_scaling:
        hf_config["rope_scaling"] = rope_scaling
    try:
        config = model_config_of_hf(hf_config)
    except ValueError as exc:
        raise ConvertError(f"{path}: {exc}") from None
    extra = dict(
        config.extra,
        hf_vocab_size=config.vocab_size,
        hf_config=hf_config,
        hf_generation_config=generation_config_of(hf_config),
        gguf_file_type=meta.get("general.file_type"),
    )
    return dataclasses.replace(
        config,
        vocab_size=pad_vocab_size(config.vocab_size, make_vocab_size_divisible_by),
        extra=extra,
    )


def import_gguf(
    src: str | Path,
    save: str | Path,
    dtype: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    progress: bool = True,
) -> Path:
    """Convert GGUF file `src` into a release checkpoint at `save`."""
    check_target(save)
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    path = Path(src)
    reader = open_reader(path)
    meta = metadata(reader)
    tied = _output_is_embedding_copy(reader)
    config = model_config_of_gguf(meta, reader, path, tied, make_vocab_size_divisible_by)
    llama = config.extra["hf_model_type"] == "llama"
    heads = (config.num_attention_heads, config.num_query_groups) if llama else None
    weights = GGUFWeights(path, reader, heads, tie_output=tied)
    with staged_dir(save) as staging:
        tokenizer_config = None
        context = config.max_position_embeddings or config.seq_length
        if write_tokenizer(meta, path, staging / TOKENIZER_DIR, context):
            tokenizer_config = TokenizerConfig(
                "HuggingFaceTokenizer", tokenizer_model=TOKENIZER_DIR
            )
        write_release(
            staging, weights, config, tokenizer_config, DTYPES[dtype or "fp32"], progress,
            source=str(src), converted_by="mg-convert import-gguf",
        )  # fmt: skip
    return Path(save)
