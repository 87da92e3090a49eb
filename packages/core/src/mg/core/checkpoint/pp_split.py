"""Pipeline stages' state dicts ↔ the whole model's, with Megatron's `torch`-format names.

A `torch`-format checkpoint saved with PP > 1 holds, in each
``mp_rank_TT_PPP/``, the model chunk(s) of that pipeline rank with the layers
numbered locally (``decoder.layers.0`` is the chunk's first layer): the
embedding on the first stage, the final norm and the output layer on the last,
and — with tied embeddings — the last stage's own copy of the word embeddings
as ``output_layer.weight`` (Megatron's scheme; the copy is not a separate
parameter of the whole model). Layers go to stages as
:func:`mg.core.parallel.pipeline.layer_ranges` assigns them, which is what the
trainer's :class:`~mg.core.parallel.pipeline.PipelineChunk` holds, so the
dicts built here are key for key the trainer's ``chunk.state_dict()``.

Values are passed through untouched (tensors, or anything else a caller maps
by name), so a converter can route lazy references without copying.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TypeVar

from mg.core.parallel.pipeline import layer_ranges

T = TypeVar("T")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
TIED_COPY = "output_layer.weight"
WORD_EMBEDDINGS = "embedding.word_embeddings.weight"


def _global_order(name: str) -> tuple[int, int]:
    """Sort key giving the whole model's order: embedding, layers, final norm, output."""
    match = _LAYER.match(name)
    if match:
        return (1, int(match.group(1)))
    if name.startswith("embedding."):
        return (0, 0)
    if name.startswith("decoder."):
        return (2, 0)
    return (3, 0)


def stage_key_map(
    global_names: Sequence[str],
    num_layers: int,
    pp_size: int,
    pp_rank: int,
    *,
    tied: bool,
    virtual_size: int = 1,
    chunk: int = 0,
) -> dict[str, str]:
    """{local name: global name} of what model chunk ``chunk`` of ``pp_rank`` holds.

    Raises ValueError for a name that is no GPT-model tensor (so no stage owns it).
    """
    start, end = layer_ranges(num_layers, pp_size, virtual_size)[pp_rank][chunk]
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == pp_size - 1 and chunk == virtual_size - 1
    out: dict[str, str] = {}
    for name in global_names:
        match = _LAYER.match(name)
        if match:
            index = int(match.group(1))
            if start <= index < end:
                out[f"decoder.layers.{index - start}.{match.group(2)}"] = name
        elif name.startswith("embedding."):
            if first:
                out[name] = name
        elif name.startswith(("decoder.final_layernorm.", "decoder.final_norm.", "output_layer.")):
            if last:
                out[name] = name
        else:
            raise ValueError(f"{name!r} is not a tensor of a GPT model; no pipeline stage holds it")
    if tied and last and not first and TIED_COPY not in out:
        out[TIED_COPY] = WORD_EMBEDDINGS
    return out


def split_pipeline(
    weights: Mapping[str, T], num_layers: int, pp_size: int, *, tied: bool, virtual_size: int = 1
) -> list[list[dict[str, T]]]:
    """[pipeline rank][model chunk] → that chunk's state dict (local layer numbers)."""
    names = list(weights)
    return [
        [
            {
                local: weights[name]
                for local, name in stage_key_map(
                    names, num_layers, pp_size, rank, tied=tied, virtual_size=virtual_size, chunk=c
                ).items()
            }
            for c in range(virtual_size)
        ]
        for rank in range(pp_size)
    ]


def merge_pipeline(
    stages: Sequence[Sequence[Mapping[str, T]]], num_layers: int, *, tied: bool
) -> dict[str, T]:
    """The whole model's state dict from [pipeline rank][model chunk] dicts.

    The last stage's tied copy of the word embeddings is dropped: the first
    stage's embedding is the parameter (Megatron's converter reads that one too).
    """
    pp_size, virtual_size = len(stages), len(stages[0])
    ranges = layer_ranges(num_layers, pp_size, virtual_size)
    merged: dict[str, T] = {}
    for rank, chunks in enumerate(stages):
        for c, local in enumerate(chunks):
            start = ranges[rank][c][0]
            first = rank == 0 and c == 0
            for name, value in local.items():
                match = _LAYER.match(name)
                if match:
                    name = f"decoder.layers.{int(match.group(1)) + start}.{match.group(2)}"
                elif name == TIED_COPY and tied and not first:
                    continue
                merged[name] = value
    return dict(sorted(merged.items(), key=lambda item: _global_order(item[0])))
