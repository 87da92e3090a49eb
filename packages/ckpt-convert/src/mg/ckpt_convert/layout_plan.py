"""The target of a conversion: parallel sizes checked the way Megatron checks them, the
vocabulary re-padded when the new tensor-parallel size needs it, and the saved entries.

Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by × TP``
(``_vocab_size_with_padding``). When the recorded padded size does not split into
the target TP, the embedding (and an untied output layer) grow to the next such
multiple, the new rows copying the last row, as Megatron's checkpoint saver does;
the padded rows are never real tokens, so the model's outputs on the real
vocabulary do not change. A size that already divides stays as it is.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mg.ckpt_convert.checkpoint_source import LAYOUT_BOUND, CheckpointSource
from mg.ckpt_convert.errors import ConvertError
from mg.core.checkpoint import mg_metadata
from mg.core.checkpoint.pp_split import WORD_EMBEDDINGS
from mg.core.models import TransformerConfig
from mg.core.models.mamba import MambaConfig
from mg.core.models.mamba.pattern import MAMBA

_VOCAB_ROWS = (WORD_EMBEDDINGS, "output_layer.weight")
DEFAULT_DIVISIBLE_BY = 128  # Megatron's --make-vocab-size-divisible-by default


@dataclass
class TargetLayout:
    """What the converted checkpoint will be: sizes, model config, notes for the user."""

    tp: int
    pp: int
    config: TransformerConfig
    notes: list[str] = field(default_factory=list)


def plan_target(
    source: CheckpointSource, tp: int | None, pp: int | None, divisible_by: int | None = None
) -> TargetLayout:
    """Check ``tp``/``pp`` (None: keep the source's) against the model; re-pad the vocab."""
    tp = source.tp if tp is None else tp
    pp = source.pp if pp is None else pp
    c = source.config
    if tp < 1 or pp < 1:
        raise ConvertError(
            "--target-tensor-parallel-size and --target-pipeline-parallel-size must be >= 1"
        )
    for what, value in (
        ("num_attention_heads", c.num_attention_heads),
        ("num_query_groups", c.num_query_groups),
        ("ffn_hidden_size", c.ffn_hidden_size),
    ):
        if value % tp:
            raise ConvertError(
                f"--target-tensor-parallel-size {tp} does not divide the model's {what} "
                f"({value}); Megatron splits it evenly over the ranks, choose a divisor of {value}"
            )
    if tp > 1 and isinstance(c, MambaConfig) and MAMBA in c.layer_pattern:
        raise ConvertError(
            f"--target-tensor-parallel-size {tp}: Mamba layers are not split over "
            "tensor-parallel ranks yet (Megatron splits their heads and groups); use 1"
        )
    if c.num_layers % pp:
        raise ConvertError(
            f"--target-pipeline-parallel-size {pp} does not divide the model's num_layers "
            f"({c.num_layers}); choose a divisor of {c.num_layers}"
        )
    notes = []
    config = c
    if c.vocab_size % tp:
        if divisible_by is None:
            divisible_by = int(
                source.args.get("make_vocab_size_divisible_by") or DEFAULT_DIVISIBLE_BY
            )
        multiple = divisible_by * tp
        padded = math.ceil(c.vocab_size / multiple) * multiple
        config = dataclasses.replace(c, vocab_size=padded)
        notes.append(
            f"vocabulary re-padded from {c.vocab_size} to {padded} rows (a multiple of "
            f"make-vocab-size-divisible-by {divisible_by} × TP {tp}, as Megatron pads); the new "
            "rows copy the last row and are never real tokens"
        )
    if source.dropped:
        what = " and ".join(
            {"optimizer": "optimizer", "rng_state": "RNG"}[k] for k in source.dropped
        )
        notes.append(
            f"{what} state not carried over: its layout depends on the parallel layout "
            "(Megatron's converter drops it too); resume with --no-load-optim --no-load-rng, "
            "or fine-tune with --finetune"
        )
    return TargetLayout(tp, pp, config, notes)


def target_tensors(
    source: CheckpointSource, target: TargetLayout, names: list[str]
) -> dict[str, Tensor]:
    """The whole tensors ``names`` as the target stores them (vocabulary rows re-padded)."""
    rows = target.config.vocab_size
    out = source.tensors(names)
    for name, tensor in out.items():
        if name in _VOCAB_ROWS and tensor.shape[0] < rows:
            extra = tensor[-1:].expand(rows - tensor.shape[0], -1)
            out[name] = torch.cat([tensor, extra], dim=0)
    return out


def target_state(source: CheckpointSource, target: TargetLayout) -> dict[str, Any]:
    """The non-model entries to save: args and ``mg`` updated to the target layout."""
    state = {k: v for k, v in source.state.items() if k not in LAYOUT_BOUND}
    args = dict(source.args)
    args.update(tensor_model_parallel_size=target.tp, pipeline_model_parallel_size=target.pp)
    for name in ("num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size"):
        if name in args:
            args[name] = None
    if "padded_vocab_size" in args:
        args["padded_vocab_size"] = target.config.vocab_size
    raw = source.state.get("args")
    state["args"] = argparse.Namespace(**args) if isinstance(raw, argparse.Namespace) else args
    meta = source.state.get("mg") or {}
    parallel = {
        k: v for k, v in (meta.get("parallel") or {}).items() if k not in ("tp", "pp", "vp")
    }
    state["mg"] = mg_metadata(
        target.config.to_dict(),
        meta.get("tokenizer_config"),
        tp=target.tp,
        pp=target.pp,
        **parallel,
    )
    return state
