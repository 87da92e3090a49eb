"""Merge the expert-parallel rank files of a `torch` checkpoint into one model's weights.

Megatron's `torch` format writes one `mp_rank_TT[_PPP]_EEE` file per expert-parallel
rank, each with the dense weights and its own experts numbered from 0
(`mlp.experts.local_experts.0.…`, or `mlp.experts.linear_fc1.weight0` for grouped
GEMM). Rank e's expert i is expert e·E/ep + i of the layer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from torch import Tensor

_EXPERT = re.compile(
    r"^(?P<head>.*\bmlp\.experts\.)"
    r"(?:local_experts\.(?P<seq>\d+)(?P<rest>\..+)|(?P<gemm>linear_fc[12]\.(?:weight|bias))(?P<num>\d+))$"
)


def merge_expert_parallel(
    parts: Sequence[Mapping[str, Tensor]], num_experts: int
) -> dict[str, Tensor]:
    """One state from each expert-parallel rank's (in rank order): experts renumbered to
    their place in the layer, everything else from rank 0 (the ranks hold equal copies)."""
    local = num_experts // len(parts)
    merged: dict[str, Tensor] = {}
    for rank, part in enumerate(parts):
        for key, value in part.items():
            match = _EXPERT.match(key)
            if match is None:
                if rank == 0:
                    merged[key] = value
            elif match["seq"] is not None:
                index = int(match["seq"]) + rank * local
                merged[f"{match['head']}local_experts.{index}{match['rest']}"] = value
            else:
                index = int(match["num"]) + rank * local
                merged[f"{match['head']}{match['gemm']}{index}"] = value
    return merged
