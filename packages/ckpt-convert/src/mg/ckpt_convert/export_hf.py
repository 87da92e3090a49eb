"""`mg-convert export-hf`: an mg checkpoint → a folder `transformers` loads.

The checkpoint may be of either format and any TP/PP layout (`checkpoint_source`
joins the shards of a tensor when it is read). The model is converted one
layer at a time and never held whole: first on the meta device, which gives
every output tensor's name, shape and dtype and so the safetensors files'
headers and shard plan; then for real, each layer's tensors read (memory-mapped
`torch` files, or just those keys from a `torch_dist` checkpoint), converted,
written to their place in the files, and let go of. Shards are named
`model-0000K-of-0000N.safetensors` (with `model.safetensors.index.json`) once
the total exceeds `--shard-size`; a model that fits is one `model.safetensors`,
as `save_pretrained` does it, byte for byte what `safetensors.save_file` writes.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from mg.ckpt_convert.architectures import hf_architecture, hf_config_of
from mg.ckpt_convert.bert_heads import hf_class_of, hf_name_for_class, tensors_for_class
from mg.ckpt_convert.checkpoint_source import CheckpointSource, open_checkpoint
from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.hf_shards import ShardedWriter, plan_shards
from mg.ckpt_convert.hf_source import TOKENIZER_FILES
from mg.ckpt_convert.import_hf import VOCAB_TENSORS
from mg.ckpt_convert.llava_hf import export_llava, is_llava_checkpoint
from mg.ckpt_convert.staging import check_target, staged_dir
from mg.ckpt_convert.vision_tower_hf import export_vision_tower, is_vision_tower_checkpoint
from mg.core.checkpoint.model_io import resolve_tokenizer_paths
from mg.core.models import TransformerConfig
from mg.core.models.hf_mapping import megatron_to_hf
from mg.core.models.mamba import MambaConfig
from mg.core.tokenizers.config import TokenizerConfig

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
_UNITS["GIB"] = 2**30
_MEGATRON_LAYER = re.compile(r"^(?:decoder|encoder)\.layers\.(\d+)\.")
# Keys of config.json that the TransformerConfig does not carry but HF users rely on.
_CARRIED_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")


def parse_size(text: str) -> int:
    """'5GB' → 5·10⁹ (decimal, as transformers' max_shard_size), '2GiB', '500MB', '1024'."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ConvertError(f"--shard-size {text!r}: expected a size such as 5GB, 500MB or 2GiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def guess_architecture(config: TransformerConfig, names: list[str] | tuple[str, ...] = ()) -> str:
    """The HF model_type for a model trained here (no record of an HF origin)."""
    if config.extra.get("hf_model_type"):
        return config.extra["hf_model_type"]
    if isinstance(config, MambaConfig):  # all Mamba layers, or a hybrid
        return "mamba2" if set(config.layer_pattern) == {"M"} else "nemotron_h"
    if "lm_head.dense.weight" in names or config.transformer_layer_order == "post_ln":
        return "bert"
    if config.position_embedding_type == "learned_absolute":
        return "gpt2"
    if config.multi_latent_attention:  # DeepSeek-V3's attention (--multi-latent-attention)
        return "deepseek_v3"
    if config.sandwich_norms:  # Gemma 3's layer (mg-train gpt --sandwich-norms ...)
        return "gemma3_text"
    if config.softmax_type == "learnable":  # gpt-oss's attention sinks (--softmax-type)
        return "gpt_oss"
    if config.num_moe_experts is not None:  # the MoE family whose attention this is
        if config.add_qkv_bias or config.moe_shared_expert_intermediate_size:
            return "qwen2_moe"
        return "qwen3_moe" if config.qk_layernorm else "mixtral"
    if config.qk_layernorm:  # Qwen3's attention (Megatron-LM trains it with --qk-layernorm)
        return "qwen3"
    if config.add_qkv_bias and not config.add_bias_linear:  # Qwen2's (--add-qkv-bias)
        return "qwen2"
    return "mistral" if config.window_size is not None else "llama"


def hf_config_dict(
    config: TransformerConfig, arch: str, dtype: torch.dtype, hf_class: str | None = None
) -> dict[str, Any]:
    """config.json: core's mapping plus the token ids recorded at import."""
    hf_vocab = config.extra.get("hf_vocab_size") or config.vocab_size
    try:
        out = hf_config_of(dataclasses.replace(config, vocab_size=hf_vocab), arch)
    except ValueError as exc:
        raise ConvertError(f"cannot export as {arch!r}: {exc}") from None
    source = config.extra.get("hf_config") or {}
    for key in _CARRIED_KEYS:
        if source.get(key) is not None:
            out[key] = source[key]
    if out.get("rope_scaling") is None:
        out.pop("rope_scaling", None)
    out["torch_dtype"] = str(dtype).removeprefix("torch.")
    if hf_class is not None:
        out["architectures"] = [hf_class]
    return out


def generation_config_dict(config: TransformerConfig, hf_config: dict[str, Any]) -> dict[str, Any]:
    recorded = config.extra.get("hf_generation_config")
    if recorded:
        return dict(recorded)
    out: dict[str, Any] = {"_from_model_config": True}
    for key in _CARRIED_KEYS:
        if hf_config.get(key) is not None:
            out[key] = hf_config[key]
    return out


def group_megatron(names: list[str]) -> list[list[str]]:
    """Embeddings first, then layer by layer, then the final norm and output layer."""
    first, last, layers = [], [], {}
    for name in names:
        match = _MEGATRON_LAYER.match(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
        elif name.startswith("embedding."):
            first.append(name)
        else:
            last.append(name)
    return [first, *(layers[i] for i in sorted(layers)), last]


def copy_tokenizer_files(tokenizer: TokenizerConfig | None, target: Path) -> None:
    """Copy the tokenizer's files (HF folder, or GPT-2 vocab/merges) next to the weights."""
    if tokenizer is None:
        return
    if tokenizer.tokenizer_type == "HuggingFaceTokenizer" and tokenizer.tokenizer_model:
        folder = Path(tokenizer.tokenizer_model)
        folder = folder if folder.is_dir() else folder.parent
        for name in TOKENIZER_FILES:
            if (folder / name).is_file():
                shutil.copy2(folder / name, target / name)
        return
    if tokenizer.tokenizer_type.startswith("BertWordPiece") and tokenizer.vocab_file:
        shutil.copy2(tokenizer.vocab_file, target / "vocab.txt")
        lower = tokenizer.tokenizer_type == "BertWordPieceLowerCase"
        settings = {"tokenizer_class": "BertTokenizer", "do_lower_case": lower}
        (target / "tokenizer_config.json").write_text(json.dumps(settings, indent=2) + "\n")
        return
    for field, name in (
        ("vocab_file", "vocab.json"),
        ("merge_file", "merges.txt"),
        ("tokenizer_model", "tokenizer.model"),
    ):
        value = getattr(tokenizer, field)
        if value and Path(value).is_file():
            shutil.copy2(value, target / name)


class LayerConverter:
    """One layer group's Megatron tensors → its HF tensors; works on meta tensors too,
    which is how export plans the files before reading any data."""

    def __init__(
        self,
        config: TransformerConfig,
        arch: str,
        hf_class: str | None,
        where: str | Path,
    ) -> None:
        self.config, self.arch, self.hf_class, self.where = config, arch, hf_class, where
        self.hf_vocab = config.extra.get("hf_vocab_size") or config.vocab_size

    def __call__(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        # the padded vocabulary rows are cut off; a view is enough, the writer copies bytes
        subset = {
            name: tensor[: self.hf_vocab] if name in VOCAB_TENSORS else tensor
            for name, tensor in tensors.items()
        }
        try:
            converted = megatron_to_hf(subset, self.config, hf_architecture(self.arch, self.config))
        except (KeyError, ValueError, RuntimeError) as exc:
            raise ConvertError(f"{self.where}: {exc}") from None
        if self.hf_class is None:
            return converted
        return {hf_name_for_class(n, self.hf_class): t for n, t in converted.items()}


def write_weights(
    source: CheckpointSource,
    groups: list[list[str]],
    convert: LayerConverter,
    folder: Path,
    max_bytes: int,
    progress: bool,
) -> None:
    """Plan the shards on the meta device, then fill them one layer group at a time."""
    planned = [
        item for group in groups for item in convert({n: source.meta(n) for n in group}).items()
    ]
    writer = ShardedWriter(folder, plan_shards(planned, max_bytes))
    for group in tqdm(groups, desc="export-hf", unit="layer", disable=None if progress else True):
        for name, tensor in convert(source.tensors(group)).items():
            writer.add(name, tensor)
        source.release()  # what this layer read leaves memory with it
    writer.finish()


def export_hf(
    load: str | Path,
    save: str | Path,
    shard_size: str = "5GB",
    iteration: int | str | None = None,
    progress: bool = True,
) -> Path:
    """Write `save` as a transformers model folder from the checkpoint in `load`."""
    check_target(save)
    max_bytes = parse_size(shard_size)
    if iteration is None and is_llava_checkpoint(load):  # vision-language: llava_hf.py
        with staged_dir(save) as staging:
            export_llava(load, staging)
        return Path(save)
    if iteration is None and is_vision_tower_checkpoint(load):  # vision_tower_hf.py
        with staged_dir(save) as staging:
            export_vision_tower(load, staging)
        return Path(save)
    source = open_checkpoint(load, iteration, check_gpt=False)
    meta = source.state.get("mg") or {}
    config = source.config
    tokenizer = None
    if meta.get("tokenizer_config"):
        tokenizer = resolve_tokenizer_paths(
            TokenizerConfig.from_dict(dict(meta["tokenizer_config"])), load
        )
    names = source.names
    arch = guess_architecture(config, names)
    try:
        hf_architecture(arch, config)
    except ValueError as exc:
        raise ConvertError(f"{load}: {exc}") from None
    hf_class = None
    if arch == "bert":
        hf_class = hf_class_of(config, names)
        names = list(tensors_for_class(names, hf_class))
    dtype = source.meta("embedding.word_embeddings.weight").dtype
    hf_config = hf_config_dict(config, arch, dtype, hf_class)
    convert = LayerConverter(config, arch, hf_class, load)
    with staged_dir(save) as staging:
        write_weights(source, group_megatron(names), convert, staging, max_bytes, progress)
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        generation = generation_config_dict(config, hf_config)
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        copy_tokenizer_files(tokenizer, staging)
    return Path(save)
