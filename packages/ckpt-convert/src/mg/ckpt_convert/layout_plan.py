"""The target of a conversion: parallel sizes checked the way Megatron checks them, the
vocabulary re-padded when the new tensor-parallel size needs it, the routed experts'
layout, and the saved entries.

An MoE model's experts are stored in one of Megatron-Core's two layouts:
``sequential`` (SequentialMLP, ``mlp.experts.local_experts.N.linear_fc1.weight``) or
``grouped`` (grouped GEMM, TEGroupedMLP's ``mlp.experts.linear_fc1.weightN``); the
same tensors under other names. The target may change it (``expert_layout``); its
config's ``moe_grouped_gemm`` says which, and :func:`expert_layout_name` renames.

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
import re
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
EXPERT_LAYOUTS = ("sequential", "grouped")
_SEQUENTIAL = re.compile(
    r"^(.*\bmlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$"
)
_GROUPED = re.compile(r"^(.*\bmlp\.experts\.)(linear_fc[12]\.(?:weight|bias))(\d+)$")


def expert_layout_name(name: str, grouped: bool) -> str:
    """``name`` in the sequential (``local_experts.N.linear_fc1.weight``) or grouped GEMM
    (``linear_fc1.weightN``) experts layout; a name of no routed expert is unchanged."""
    if grouped and (match := _SEQUENTIAL.match(name)):
        return f"{match[1]}{match[3]}{match[2]}"
    if not grouped and (match := _GROUPED.match(name)):
        return f"{match[1]}local_experts.{match[3]}.{match[2]}"
    return name


@dataclass
class TargetLayout:
    """What the converted checkpoint will be: sizes, model config, notes for the user."""

    tp: int
    pp: int
    config: TransformerConfig
    notes: list[str] = field(default_factory=list)
    ep: int = 1
    """Expert-parallel ranks (`torch` files ``mp_rank_TT[_PPP]_EEE``); 1 for a dense model."""


def plan_target(
    source: CheckpointSource,
    tp: int | None,
    pp: int | None,
    divisible_by: int | None = None,
    ep: int | None = None,
    expert_layout: str | None = None,
) -> TargetLayout:
    """Check ``tp``/``pp``/``ep`` (None: keep the source's) against the model; re-pad the
    vocab; the experts in ``expert_layout`` (None: keep)."""
    tp = source.tp if tp is None else tp
    pp = source.pp if pp is None else pp
    ep = source.ep if ep is None else ep
    c = source.config
    if tp < 1 or pp < 1 or ep < 1:
        raise ConvertError(
            "--target-tensor-parallel-size, --target-pipeline-parallel-size and "
            "--target-expert-parallel-size must be >= 1"
        )
    experts = c.num_moe_experts
    if ep > 1 and not experts:
        raise ConvertError(
            f"--target-expert-parallel-size {ep}: the model has no experts (not an MoE); use 1"
        )
    if experts and experts % ep:
        raise ConvertError(
            f"--target-expert-parallel-size {ep} does not divide the model's num_moe_experts "
            f"({experts}); Megatron gives each expert-parallel rank as many experts, choose a "
            f"divisor of {experts}"
        )
    if expert_layout is not None and expert_layout not in EXPERT_LAYOUTS:
        raise ConvertError(f"--expert-layout {expert_layout!r}: expected one of {EXPERT_LAYOUTS}")
    if expert_layout is not None and not experts:
        raise ConvertError("--expert-layout: the model has no experts (not an MoE)")
    sizes = [
        ("num_attention_heads", c.num_attention_heads),
        ("num_query_groups", c.num_query_groups),
        ("ffn_hidden_size", c.ffn_hidden_size),
    ]
    if experts:  # expert tensor parallelism = TP: each expert's MLP is split as the MLP is
        sizes.append(("moe_ffn_hidden_size", c.moe_ffn_hidden_size))
        if c.moe_shared_expert_intermediate_size:
            sizes.append(
                ("moe_shared_expert_intermediate_size", c.moe_shared_expert_intermediate_size)
            )
    for what, value in sizes:
        if value % tp:
            raise ConvertError(
                f"--target-tensor-parallel-size {tp} does not divide the model's {what} "
                f"({value}); Megatron splits it evenly over the ranks, choose a divisor of {value}"
            )
    if isinstance(c, MambaConfig) and MAMBA in c.layer_pattern:
        # Megatron-Core's MambaMixer splits its heads and groups over the TP ranks
        for what, value in (
            ("mamba_num_heads", c.mamba_num_heads),
            ("mamba_num_groups", c.mamba_num_groups),
        ):
            if value % tp:
                raise ConvertError(
                    f"--target-tensor-parallel-size {tp} does not divide the model's {what} "
                    f"({value}); Megatron splits it evenly over the ranks, choose a divisor "
                    f"of {value}"
                )
    if c.num_layers % pp:
        raise ConvertError(
            f"--target-pipeline-parallel-size {pp} does not divide the model's num_layers "
            f"({c.num_layers}); choose a divisor of {c.num_layers}"
        )
    notes = []
    config = c
    if expert_layout is not None and (expert_layout == "grouped") != c.moe_grouped_gemm:
        config = dataclasses.replace(config, moe_grouped_gemm=expert_layout == "grouped")
        notes.append(
            f"experts written in the {expert_layout} layout (the source's: "
            f"{'grouped' if c.moe_grouped_gemm else 'sequential'})"
        )
    if c.vocab_size % tp:
        if divisible_by is None:
            divisible_by = int(
                source.args.get("make_vocab_size_divisible_by") or DEFAULT_DIVISIBLE_BY
            )
        multiple = divisible_by * tp
        padded = math.ceil(c.vocab_size / multiple) * multiple
        config = dataclasses.replace(config, vocab_size=padded)
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
    return TargetLayout(tp, pp, config, notes, ep)


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
    if "expert_model_parallel_size" in args or target.ep > 1:
        args["expert_model_parallel_size"] = target.ep
    if args.get("expert_tensor_parallel_size") is not None:
        args["expert_tensor_parallel_size"] = target.tp
    if target.config.num_moe_experts:
        args["moe_grouped_gemm"] = target.config.moe_grouped_gemm
    for name in ("num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size"):
        if name in args:
            args[name] = None
    if "padded_vocab_size" in args:
        args["padded_vocab_size"] = target.config.vocab_size
    raw = source.state.get("args")
    state["args"] = argparse.Namespace(**args) if isinstance(raw, argparse.Namespace) else args
    meta = source.state.get("mg") or {}
    parallel = {
        k: v for k, v in (meta.get("parallel") or {}).items() if k not in ("tp", "pp", "vp", "ep")
    }
    state["mg"] = mg_metadata(
        target.config.to_dict(),
        meta.get("tokenizer_config"),
        tp=target.tp,
        pp=target.pp,
        ep=target.ep,
        **parallel,
    )
    return state
