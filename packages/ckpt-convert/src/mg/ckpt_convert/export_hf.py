"""`mg-convert export-hf`: an mg checkpoint → a folder `transformers` loads.

The checkpoint may be of either format and any TP/PP layout (`checkpoint_source`
joins the shards of a tensor when it is read). `torch` files are memory-mapped,
and tensors are converted one layer at a time
and written into safetensors shards as each shard fills up, so the model is not
held twice. Shards are named `model-0000K-of-0000N.safetensors` (with
`model.safetensors.index.json`) once the total exceeds `--shard-size`; a model
that fits is one `model.safetensors`, as `save_pretrained` does it.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import Tensor
from tqdm import tqdm

from mg.ckpt_convert.bert_heads import hf_class_of, hf_name_for_class, tensors_for_class
from mg.ckpt_convert.checkpoint_source import open_checkpoint
from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.hf_source import SAFETENSORS_INDEX, TOKENIZER_FILES
from mg.ckpt_convert.import_hf import VOCAB_TENSORS
from mg.ckpt_convert.staging import check_target, staged_dir
from mg.core.checkpoint.model_io import resolve_tokenizer_paths
from mg.core.models import TransformerConfig
from mg.core.models.hf_mapping import config_to_hf, get_architecture, megatron_to_hf
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
    if "lm_head.dense.weight" in names or config.transformer_layer_order == "post_ln":
        return "bert"
    if config.position_embedding_type == "learned_absolute":
        return "gpt2"
    return "mistral" if config.window_size is not None else "llama"


def hf_config_dict(
    config: TransformerConfig, arch: str, dtype: torch.dtype, hf_class: str | None = None
) -> dict[str, Any]:
    """config.json: core's mapping plus the token ids recorded at import."""
    hf_vocab = config.extra.get("hf_vocab_size") or config.vocab_size
    try:
        out = config_to_hf(dataclasses.replace(config, vocab_size=hf_vocab), arch)
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


class ShardWriter:
    """Collects tensors and writes a safetensors file whenever `max_bytes` would be passed."""

    def __init__(self, folder: Path, max_bytes: int) -> None:
        self.folder, self.max_bytes = folder, max_bytes
        self.pending: dict[str, Tensor] = {}
        self.pending_bytes = 0
        self.written: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        path = self.folder / f"shard-{len(self.written):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Rename the files to HF's names and write the index when there is more than one."""
        self.flush()
        if len(self.written) == 1:
            self.written[0][0].rename(self.folder / "model.safetensors")
            return
        count = len(self.written)
        weight_map = {}
        for k, (path, names) in enumerate(self.written, start=1):
            final = f"model-{k:05d}-of-{count:05d}.safetensors"
            path.rename(self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


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
        get_architecture(arch)
    except ValueError as exc:
        raise ConvertError(f"{load}: {exc}") from None
    hf_class = None
    if arch == "bert":
        hf_class = hf_class_of(config, names)
        names = list(tensors_for_class(names, hf_class))
    hf_vocab = config.extra.get("hf_vocab_size") or config.vocab_size
    dtype = source.tensor("embedding.word_embeddings.weight").dtype
    hf_config = hf_config_dict(config, arch, dtype, hf_class)
    with staged_dir(save) as staging:
        writer = ShardWriter(staging, max_bytes)
        for group in tqdm(
            group_megatron(names), desc="export-hf", unit="layer", disable=not progress
        ):
            subset = {}
            for name in group:
                tensor = source.tensor(name)
                if name in VOCAB_TENSORS:
                    tensor = tensor[:hf_vocab].clone()
                subset[name] = tensor
            try:
                converted = megatron_to_hf(subset, config, arch)
            except (KeyError, ValueError, RuntimeError) as exc:
                raise ConvertError(f"{load}: {exc}") from None
            for name, tensor in converted.items():
                writer.add(name if hf_class is None else hf_name_for_class(name, hf_class), tensor)
        writer.finish()
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        generation = generation_config_dict(config, hf_config)
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        copy_tokenizer_files(tokenizer, staging)
    return Path(save)
