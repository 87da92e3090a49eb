"""Routed experts under their global numbers, so that checkpoints reshard expert parallelism.

Under expert parallelism a rank keeps experts r·E/ep … and names them from 0
(`local_experts.0`, `weight0`), as Megatron-Core names a rank's local experts
in its module tree. A checkpoint that loads at another expert-parallel size
(torch_dist) must name each expert by its number in the whole layer instead:
`global_expert_names` maps a model's local state-dict names to those, from the
offset `apply_expert_parallel` records on each layer's experts
(`expert_offset`); the checkpoint code renames on save and on load, and a
model at EP=1 asks for every expert under the names the EP ranks wrote.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from mg.core.models.moe.experts import GroupedMLP, SequentialMLP

_SEQUENTIAL = re.compile(r"^local_experts\.(\d+)(\..+)$")
_GROUPED = re.compile(r"^(linear_fc[12]\.(?:weight|bias))(\d+)$")


def _renumber(key: str, offset: int) -> str:
    """A key inside an experts module with its expert number moved by `offset`."""
    if match := _SEQUENTIAL.match(key):
        return f"local_experts.{int(match[1]) + offset}{match[2]}"
    if match := _GROUPED.match(key):
        return f"{match[1]}{int(match[2]) + offset}"
    return key


def global_expert_names(model: nn.Module) -> dict[str, str]:
    """Local name → global name of every routed-expert tensor whose number differs
    (empty without expert parallelism, and on expert-parallel rank 0)."""
    names: dict[str, str] = {}
    for prefix, module in model.named_modules():
        offset = getattr(module, "expert_offset", 0)
        if not offset or not isinstance(module, SequentialMLP | GroupedMLP):
            continue
        head = f"{prefix}." if prefix else ""
        for key in module.state_dict():
            names[head + key] = head + _renumber(key, offset)
    return names


def rename_keys(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """`state` with its keys renamed where `names` says (the values are the same objects)."""
    return {names.get(key, key): value for key, value in state.items()}


def rename_optimizer_state(state: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (`state.<name>`, `param_groups[i].params`)
    with the names renamed where `names` says."""
    if not names:
        return dict(state)
    renamed = dict(state)
    if "state" in state:
        renamed["state"] = rename_keys(state["state"], names)
    if "param_groups" in state:
        renamed["param_groups"] = [
            {**g, "params": [names.get(p, p) for p in g["params"]]}
            if isinstance(g.get("params"), list)
            else g
            for g in state["param_groups"]
        ]
    return renamed


def inverse(names: Mapping[str, str]) -> dict[str, str]:
    return {v: k for k, v in names.items()}
