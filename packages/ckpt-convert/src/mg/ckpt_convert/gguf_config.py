"""A GGUF file's hyper-parameters (``general.architecture`` and its ``<arch>.*`` keys) as
the Hugging Face config.json of the same model, which import-hf's mapping then reads.

Going through config.json keeps one mapping to our TransformerConfig (core's
``config_from_hf``) and lets export-hf give the model back as a Hugging Face folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mg.ckpt_convert.errors import ConvertError

# general.architecture → Hugging Face model_type (Mistral 7B is written as "llama")
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def gguf_architecture(meta: dict[str, Any], path: Path) -> str:
    """``general.architecture``, refused by name unless we convert it."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConvertError(
            f"{path}: general.architecture {arch!r} is not supported; import-gguf reads "
            f"{', '.join(ARCHITECTURES)} (Mistral files say llama)"
        )
    return arch


def _required(meta: dict[str, Any], key: str, path: Path) -> Any:
    if key not in meta:
        raise ConvertError(f"{path}: metadata key {key!r} is missing; the file is incomplete")
    return meta[key]


def hf_config_of_gguf(
    meta: dict[str, Any], path: Path, tied: bool, vocab_size: int
) -> dict[str, Any]:
    """The config.json transformers would write for this model (without rope_scaling,
    which a GGUF file holds as a tensor: `gguf_rope`)."""
    arch = gguf_architecture(meta, path)
    key = f"{arch}."
    heads = int(_required(meta, key + "attention.head_count", path))
    hidden = int(_required(meta, key + "embedding_length", path))
    head_dim = int(meta.get(key + "attention.key_length", hidden // heads))
    if int(meta.get(key + "attention.value_length", head_dim)) != head_dim:
        raise ConvertError(f"{path}: {key}attention.value_length differs from key_length")
    rotary = int(meta.get(key + "rope.dimension_count", head_dim))
    if rotary != head_dim:
        raise ConvertError(
            f"{path}: {key}rope.dimension_count={rotary} rotates part of each {head_dim}-wide "
            "head; partial RoPE is not supported"
        )
    scaling = meta.get(key + "rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise ConvertError(
            f"{path}: {key}rope.scaling.type={scaling!r} is not supported (only unscaled RoPE)"
        )
    if key + "attention.sliding_window" in meta:
        raise ConvertError(f"{path}: {key}attention.sliding_window is not supported")
    context = int(meta.get(key + "context_length", 2048))
    config: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch],
        "architectures": [_HF_CLASSES[arch]],
        "num_hidden_layers": int(_required(meta, key + "block_count", path)),
        "hidden_size": hidden,
        "intermediate_size": int(_required(meta, key + "feed_forward_length", path)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get(key + "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rope_theta": float(meta.get(key + "rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_required(meta, key + "attention.layer_norm_rms_epsilon", path)),
        "max_position_embeddings": context,
        "vocab_size": vocab_size,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    for name, hf in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        value = meta.get(f"tokenizer.ggml.{name}_token_id")
        if value is not None:
            config[hf] = int(value)
    return config


def generation_config_of(hf_config: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json's ids, as transformers derives them from config.json."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: hf_config[k] for k in keys if k in hf_config}
