"""BERT's optional parts: which Hugging Face class holds which head, and the heads a
source lacks.

A transformers ``BertModel`` file has the encoder and the pooler, ``BertForMaskedLM``
the encoder and the MLM head (no pooler), ``BertForPreTraining`` all of it plus the
next-sentence head. Our ``BertModel`` always has the MLM head and has the pooler and
binary head together, so import builds what the source allows and initialises the
heads it lacks (Megatron's init, seeded, recorded in ``config.extra``); export writes
exactly the tensors of the class the checkpoint came from, so a round trip gives the
same files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from mg.core.models import BertModel, TransformerConfig

HF_CLASSES = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
_POOLER = ("pooler.",)
_NSP = ("binary_head.",)
_MLM = ("lm_head.", "output_layer.")
INIT_SEED = 1234


def bert_meta_model(config: TransformerConfig, binary_head: bool = True) -> BertModel:
    with torch.device("meta"):
        return BertModel(
            config,
            add_binary_head=binary_head,
            num_tokentypes=config.extra.get("type_vocab_size", 2),
        )


def complete_heads(
    state: dict[str, Any],
    config: TransformerConfig,
    shapes: dict[str, torch.Size],
    sink: Callable[[Tensor], Any] | None = None,
) -> list[str]:
    """Add Megatron-initialised tensors for the heads the source lacks (in place).

    Without a pooler there is no binary head either (BertForMaskedLM): those names
    are dropped from the model. Returns the names that were initialised."""
    if "pooler.dense.weight" not in state:
        for name in [n for n in shapes if n.startswith(_POOLER + _NSP)]:
            del shapes[name]
    dtype = state["embedding.word_embeddings.weight"].dtype
    generator = torch.Generator().manual_seed(INIT_SEED)
    initialised = []
    for name in sorted(set(shapes) - set(state)):
        if not name.startswith(_NSP + _MLM):
            continue
        if "layer_norm.weight" in name:
            tensor = torch.ones(shapes[name])
        elif name.endswith("bias"):
            tensor = torch.zeros(shapes[name])
        else:
            tensor = torch.empty(shapes[name]).normal_(
                0.0, config.init_method_std, generator=generator
            )
        state[name] = tensor.to(dtype) if sink is None else sink(tensor.to(dtype))
        initialised.append(name)
    return initialised


def hf_class_of(config: TransformerConfig, names: list[str]) -> str:
    """The class to export as: the recorded one, else what the weights can fill."""
    recorded = (config.extra.get("hf_config") or {}).get("architectures") or []
    if recorded and recorded[0] in HF_CLASSES:
        return recorded[0]
    return "BertForPreTraining" if "binary_head.weight" in names else "BertForMaskedLM"


def tensors_for_class(names: list[str], hf_class: str) -> list[str]:
    """The Megatron names whose HF tensors `hf_class` has."""
    if hf_class == "BertModel":
        return [n for n in names if not n.startswith(_NSP + _MLM)]
    if hf_class == "BertForMaskedLM":
        return [n for n in names if not n.startswith(_POOLER + _NSP)]
    return list(names)


def hf_name_for_class(name: str, hf_class: str) -> str:
    """`save_pretrained` of the base BertModel writes its keys without `bert.`."""
    return name.removeprefix("bert.") if hf_class == "BertModel" else name
