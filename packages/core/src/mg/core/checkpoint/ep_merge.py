"""The expert-parallel rank files of a `torch` checkpoint ↔ one model's weights.

Megatron's `torch` format writes one `mp_rank_TT[_PPP]_EEE` file per expert-parallel
rank, each with the dense weights and its own experts numbered from 0
(`mlp.experts.local_experts.0.…`, or `mlp.experts.linear_fc1.weight0` for grouped
GEMM). Rank e's expert i is expert e·E/ep + i of the layer.

Values are passed through untouched (tensors, or anything a converter maps by
name, such as lazy references into the files), as in :mod:`.pp_split`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TypeVar

T = TypeVar("T")

_EXPERT = re.compile(
    r"^(?P<head>.*\bmlp\.experts\.)"
    r"(?:local_experts\.(?P<seq>\d+)(?P<rest>\..+)|(?P<gemm>linear_fc[12]\.(?:weight|bias))(?P<num>\d+))$"
)


def _renumbered(key: str, offset: int) -> tuple[str, int] | None:
    """A routed expert's key with its number moved by `offset`, and the new number;
    None for any other key."""
    match = _EXPERT.match(key)
    if match is None:
        return None
    if match["seq"] is not None:
        index = int(match["seq"]) + offset
        return f"{match['head']}local_experts.{index}{match['rest']}", index
    index = int(match["num"]) + offset
    return f"{match['head']}{match['gemm']}{index}", index


def _group(key: str) -> str | None:
    """The module whose experts `key` is one of: `…experts.` (SequentialMLP) or
    `…experts.linear_fc1.` (grouped GEMM, whose weights are numbered inside it)."""
    match = _EXPERT.match(key)
    if match is None:
        return None
    if match["seq"] is not None:
        return match["head"]
    return match["head"] + match["gemm"].split(".")[0]


def merge_expert_parallel(parts: Sequence[Mapping[str, T]], num_experts: int) -> dict[str, T]:
    """One state from each expert-parallel rank's (in rank order): experts renumbered to
    their place in the layer, everything else from rank 0 (the ranks hold equal copies).
    Keys come in the whole model's order: a module's experts in expert order where rank
    0's are."""
    local = num_experts // len(parts)
    merged: dict[str, T] = {}
    done: set[str] = set()
    for key, value in parts[0].items():
        group = _group(key)
        if group is None:
            merged[key] = value
            continue
        if group in done:
            continue
        done.add(group)
        for rank, part in enumerate(parts):
            for other, tensor in part.items():
                if _group(other) == group:
                    renamed = _renumbered(other, rank * local)
                    assert renamed is not None
                    merged[renamed[0]] = tensor
    return merged


def split_expert_parallel(
    weights: Mapping[str, T], num_experts: int, ep: int
) -> list[dict[str, T]]:
    """The inverse: each expert-parallel rank's state, its experts numbered from 0 and
    every other entry shared (the same object in each)."""
    local = num_experts // ep
    parts: list[dict[str, T]] = [{} for _ in range(ep)]
    for key, value in weights.items():
        match = _EXPERT.match(key)
        if match is None:
            for part in parts:
                part[key] = value
            continue
        index = int(match["seq"] if match["seq"] is not None else match["num"])
        rank = index // local
        renamed = _renumbered(key, -rank * local)
        assert renamed is not None
        parts[rank][renamed[0]] = value
    return parts


def is_routed_expert(key: str) -> bool:
    """Whether `key` is a routed expert's tensor (not the router or a shared expert)."""
    return _EXPERT.match(key) is not None


def with_dense_from(merged: Mapping[str, T], dense: Mapping[str, T]) -> dict[str, T]:
    """`merged` (experts merged over EP) with every other entry taken from `dense`: with
    --expert-tensor-parallel-size 1 a file's experts are whole and its dense weights are
    its tensor-parallel rank's shard, so the two may come from different files."""
    return {k: v if _EXPERT.match(k) else dense[k] for k, v in merged.items()}


def rank_files_present(
    numbers: Sequence[tuple[int, ...]], pp: int, ep: int
) -> set[tuple[int, int, int]]:
    """The (tp, pp, ep) ranks of a `torch` checkpoint's `mp_rank_*` folder numbers, as
    `layout.detect_layout` reads them (two numbers: PP, or EP when PP is 1)."""
    out = set()
    for n in numbers:
        if len(n) == 3:
            out.add((n[0], n[1], n[2]))
        elif len(n) == 2:
            out.add((n[0], 0, n[1]) if pp == 1 and ep > 1 else (n[0], n[1], 0))
        else:
            out.add((n[0], 0, 0))
    return out


def whole_expert_sources(
    present: set[tuple[int, int, int]], tp: int, pp: int, ep: int
) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """With --expert-tensor-parallel-size 1 Megatron writes one file per (tp, pp, ep) rank
    that some writer holds (data- or expert-data-parallel rank 0), not every combination:
    (tp, pp) -> an ep rank whose file has that TP rank's dense shards, and (ep, pp) -> a tp
    rank whose file has that EP rank's (whole) experts. Raises KeyError naming a gap."""
    dense = {}
    experts = {}
    for t, p, e in sorted(present):
        dense.setdefault((t, p), e)
        experts.setdefault((e, p), t)
    for p in range(pp):
        for t in range(tp):
            if (t, p) not in dense:
                raise KeyError(f"no file of tensor-parallel rank {t}, pipeline rank {p}")
        for e in range(ep):
            if (e, p) not in experts:
                raise KeyError(f"no file of expert-parallel rank {e}, pipeline rank {p}")
    return dense, experts
