"""`mg-convert import-hf`: a Hugging Face GPT-2 / Llama / Mistral / BERT / Mamba-2 / Nemotron-H
folder → mg.

The mapping of names and layouts is core's (`mg.core.models.hf_mapping`); this
module adds what a file-to-file conversion needs: reading layer by layer,
Megatron's vocabulary padding, dtype, shape checks against the model the config
describes, tokenizer files, and an atomic write.

Memory: the source is read one layer at a time through `safe_open` handles that
are closed after the layer, and each converted tensor goes straight into the
checkpoint file (:class:`StreamingTorchFile`) and is dropped, so the peak is
about one layer, not the model (bench/bench_convert_memory.py).

The checkpoint records what export needs to give the model back unchanged:
``config.extra`` holds ``hf_model_type``, ``hf_vocab_size`` (the unpadded
vocabulary), ``hf_config`` (the source config.json) and ``hf_generation_config``.
The tokenizer files are copied to ``DIR/tokenizer/`` and the TokenizerConfig
names that folder relative to DIR (``load_model`` resolves it), so the
checkpoint folder can be moved as a whole.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from mg.ckpt_convert.architectures import hf_architecture, model_config_of_hf
from mg.ckpt_convert.bert_heads import bert_meta_model, complete_heads
from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.hf_source import HFWeights, read_hf_config, resolve_source, tokenizer_files
from mg.ckpt_convert.llava_hf import LLAVA_MODEL_TYPE, convert_llava, write_llava_release
from mg.ckpt_convert.staging import check_target, staged_dir
from mg.ckpt_convert.stream_writer import StreamingTorchFile
from mg.ckpt_convert.vision_tower_hf import (
    VISION_TOWER_MODEL_TYPES,
    convert_vision_tower,
    write_vision_release,
)
from mg.core.checkpoint import (
    CHECKPOINT_VERSION,
    RELEASE,
    checkpoint_file,
    mg_metadata,
)
from mg.core.checkpoint.layout import tracker_file
from mg.core.models import TransformerConfig, pad_vocab_size
from mg.core.models.hf_mapping import hf_to_megatron
from mg.core.models.mamba import decoder_model
from mg.core.tokenizers.config import TokenizerConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOKENIZER_DIR = "tokenizer"
_LAYER = re.compile(r"\.(?:layers|layer|h)\.(\d+)\.")
# Tensors whose rows are vocabulary entries: padded on import, sliced on export.
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight", "output_layer.bias")


def layer_of(name: str) -> int | None:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else None


def group_by_layer(names: list[str]) -> dict[int | None, list[str]]:
    """Tensor names per layer index; None for embeddings, final norm, output layer."""
    groups: dict[int | None, list[str]] = defaultdict(list)
    for name in names:
        groups[layer_of(name)].append(name)
    return dict(sorted(groups.items(), key=lambda kv: -1 if kv[0] is None else kv[0]))


def model_config_from_hf(
    hf_config: dict[str, Any], source: Path, make_vocab_size_divisible_by: int
) -> TransformerConfig:
    """config.json → TransformerConfig with Megatron's padded vocabulary."""
    path = source / "config.json"
    model_type = hf_config.get("model_type")
    try:
        config = model_config_of_hf(hf_config)
    except KeyError as exc:  # the mapping reads a field the file does not have
        raise ConvertError(
            f"{path}: no {exc.args[0]!r} field, which a {model_type} config needs: the file "
            "is incomplete or from another model. Download config.json again (or write it "
            "with transformers' save_pretrained), or add the field"
        ) from None
    except TypeError as exc:  # a field of the wrong type (null, a string) met arithmetic
        nulls = [key for key, value in hf_config.items() if value is None]
        among = f"; null there: {', '.join(nulls)}" if nulls else ""
        raise ConvertError(
            f"{path}: a field holds a value of the wrong type ({exc}){among}. Give it the "
            "number a config of this model needs, or download config.json again"
        ) from None
    except ValueError as exc:
        raise ConvertError(f"{path}: {exc}") from None
    hf_vocab = config.vocab_size
    extra = dict(config.extra, hf_vocab_size=hf_vocab, hf_config=hf_config)
    generation = source / "generation_config.json"
    if generation.is_file():
        extra["hf_generation_config"] = json.loads(generation.read_text())
    return dataclasses.replace(
        config,
        vocab_size=pad_vocab_size(hf_vocab, make_vocab_size_divisible_by),
        extra=extra,
    )


def pad_rows(tensor: Tensor, rows: int) -> Tensor:
    """Zero rows appended up to `rows` (Megatron's padded vocab entries are never produced)."""
    if tensor.shape[0] == rows:
        return tensor
    out = tensor.new_zeros((rows, *tensor.shape[1:]))
    out[: tensor.shape[0]] = tensor
    return out


def is_bert(config: TransformerConfig) -> bool:
    return config.extra.get("hf_model_type") == "bert"


def expected_shapes(config: TransformerConfig) -> dict[str, torch.Size]:
    if is_bert(config):
        model = bert_meta_model(config)
    else:
        with torch.device("meta"):
            model = decoder_model(config)  # GPTModel, or MambaModel for Mamba-2 / hybrids
    return {name: t.shape for name, t in model.state_dict().items()}


def convert_weights(
    weights: HFWeights,
    config: TransformerConfig,
    dtype: torch.dtype | None,
    progress: bool = True,
    sink: Callable[[Tensor], Any] | None = None,
) -> dict[str, Any]:
    """Read, map, pad, cast and check every tensor, one layer at a time.

    With a ``sink`` (``StreamingTorchFile.add``) each tensor is handed over as soon as
    it is converted and the result holds what the sink returned, not the tensors."""
    arch = hf_architecture(config.extra["hf_model_type"], config)
    shapes = expected_shapes(config)
    out: dict[str, Tensor] = {}
    groups = group_by_layer(weights.names())
    for layer, names in tqdm(
        groups.items(), desc="import-hf", unit="layer", disable=None if progress else True
    ):
        if layer is not None and layer >= config.num_layers + (config.mtp_num_layers or 0):
            raise ConvertError(
                f"{weights.folder} has tensors of layer {layer} ({names[0]}), but config.json "
                f"says num_hidden_layers={config.num_layers}"
            )
        with weights.open_group(names) as hf_state:
            try:
                converted = hf_to_megatron(hf_state, config, arch)
            except (KeyError, RuntimeError, ValueError) as exc:
                message = exc.args[0] if isinstance(exc, KeyError) else str(exc)
                raise ConvertError(f"{weights.folder}: {message}") from None
        for name, tensor in converted.items():
            if name in VOCAB_TENSORS:
                tensor = pad_rows(tensor, config.vocab_size)
            if dtype is not None and tensor.dtype != dtype:
                tensor = tensor.to(dtype)
            if name not in shapes:
                raise ConvertError(f"{weights.folder}: {name} is not a parameter of this model")
            if tensor.shape != shapes[name]:
                raise ConvertError(
                    f"{weights.folder}: shape mismatch for {name}: the weights give "
                    f"{tuple(tensor.shape)}, config.json implies {tuple(shapes[name])}"
                )
            out[name] = tensor if sink is None else sink(tensor)
            del tensor
    if is_bert(config):
        initialised = complete_heads(out, config, shapes, sink)
        if initialised:
            config.extra["hf_initialized"] = initialised
    missing = sorted(set(shapes) - set(out))
    if missing:
        raise ConvertError(
            f"{weights.folder}: {len(missing)} parameters have no weights in the source: "
            f"{missing[:6]}"
        )
    return out


def copy_tokenizer(
    source: Path, checkpoint_dir: Path, bert: bool = False
) -> TokenizerConfig | None:
    """Copy the tokenizer files to DIR/tokenizer/ and describe them (paths relative to DIR).

    A BERT with a vocab.txt gets Megatron's WordPiece tokenizer (what BERT training
    and the RACE/GLUE tasks use: no [CLS]/[SEP] added by `tokenize`)."""
    files = tokenizer_files(source)
    if not files:
        return None
    target = checkpoint_dir / TOKENIZER_DIR
    target.mkdir()
    for file in files:
        shutil.copy2(file, target / file.name)
    names = {f.name for f in files}
    if bert and "vocab.txt" in names:
        settings = source / "tokenizer_config.json"
        lower = True
        if settings.is_file():
            lower = json.loads(settings.read_text()).get("do_lower_case", True)
        return TokenizerConfig(
            "BertWordPieceLowerCase" if lower else "BertWordPieceCase",
            vocab_file=f"{TOKENIZER_DIR}/vocab.txt",
        )
    if "tokenizer.json" in names:
        return TokenizerConfig("HuggingFaceTokenizer", tokenizer_model=TOKENIZER_DIR)
    if {"vocab.json", "merges.txt"} <= names:
        return TokenizerConfig(
            "GPT2BPETokenizer",
            vocab_file=f"{TOKENIZER_DIR}/vocab.json",
            merge_file=f"{TOKENIZER_DIR}/merges.txt",
        )
    if "tokenizer.model" in names:
        return TokenizerConfig(
            "Llama2Tokenizer", tokenizer_model=f"{TOKENIZER_DIR}/tokenizer.model"
        )
    return None


def import_hf(
    src: str,
    save: str | Path,
    dtype: str | None = None,
    make_vocab_size_divisible_by: int = 128,
    progress: bool = True,
) -> Path:
    """Convert `src` (folder or Hub repo id) into a release checkpoint at `save`."""
    check_target(save)
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    source = resolve_source(src)
    hf_config = read_hf_config(source)
    if hf_config.get("model_type") == LLAVA_MODEL_TYPE:  # vision-language: llava_hf.py
        dtype_to = DTYPES.get(dtype or "")
        llava, state, unused = convert_llava(
            source, hf_config, dtype_to, make_vocab_size_divisible_by
        )
        with staged_dir(save) as staging:
            tokenizer = copy_tokenizer(source, staging)
            write_llava_release(staging, state, llava, tokenizer, str(src), unused)
        return Path(save)
    if hf_config.get("model_type") in VISION_TOWER_MODEL_TYPES:  # vision_tower_hf.py
        vision, state, unused = convert_vision_tower(source, hf_config, DTYPES.get(dtype or ""))
        with staged_dir(save) as staging:
            write_vision_release(staging, state, vision, str(src), unused, hf_config)
        return Path(save)
    config = model_config_from_hf(hf_config, source, make_vocab_size_divisible_by)
    arch = hf_architecture(config.extra["hf_model_type"], config)
    weights = HFWeights(source, arch.base_model_prefix, arch.head_prefixes)
    if config.mtp_num_layers and not any(
        (layer_of(name) or 0) >= config.num_layers for name in weights.names()
    ):  # the config names MTP layers the files do not hold (transformers saves none)
        config = dataclasses.replace(config, mtp_num_layers=None)
    with staged_dir(save) as staging:
        tokenizer_config = copy_tokenizer(source, staging, bert=is_bert(config))
        write_release(
            staging, weights, config, tokenizer_config, DTYPES.get(dtype or ""), progress,
            source=str(src), converted_by="mg-convert import-hf",
        )  # fmt: skip
    return Path(save)


def write_release(
    staging: Path,
    weights: Any,
    config: Any,
    tokenizer_config: Any,
    dtype: Any,
    progress: bool,
    *,
    source: str,
    converted_by: str,
) -> None:
    """Converted weights as a `release` checkpoint in `staging`, streamed to disk a tensor
    at a time, with the state save_model writes (model_io) and the tracker file."""
    path = checkpoint_file(staging, RELEASE)
    path.parent.mkdir(parents=True)
    writer = StreamingTorchFile(path)
    model = convert_weights(weights, config, dtype, progress, writer.add)
    writer.finish(
        {
            "model": model,
            "args": {"source": source, "converted_by": converted_by},
            "iteration": 0,
            "mg": mg_metadata(
                config.to_dict(), tokenizer_config.to_dict() if tokenizer_config else None
            ),
            "checkpoint_version": CHECKPOINT_VERSION,
        }
    )
    tracker_file(staging).write_text(RELEASE)
