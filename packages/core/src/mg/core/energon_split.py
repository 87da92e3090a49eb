"""The tar shards of one split of an energon WebDataset folder (`mg-prep vlm`'s output).

Energon's `.nv-meta/split.yaml` lists each split's shards, a run of them as one brace
range, `data-{000000..000003}.tar` (its own reader braceexpands it). The trainer and the
evaluator read the same folders, so the reading is here once; each names the flag the
folder came from in its own error.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

SPLIT_YAML = Path(".nv-meta") / "split.yaml"


def split_shards(folder: Path, split: str) -> list[Path] | None:
    """The shards `split.yaml` gives `split`, in order (None: the folder has no split.yaml)."""
    path = folder / SPLIT_YAML
    if not path.is_file():
        return None
    parts = (yaml.safe_load(path.read_text()) or {}).get("split_parts", {})
    return [folder / name for entry in parts.get(split) or [] for name in expand_range(entry)]


def expand_range(name: str) -> list[str]:
    """The names a `{first..last}` range stands for, zero-padded as `first` is."""
    found = re.fullmatch(r"(.*)\{(\d+)\.\.(\d+)\}(.*)", name)
    if found is None:
        return [name]
    head, first, last, tail = found.groups()
    return [f"{head}{i:0{len(first)}d}{tail}" for i in range(int(first), int(last) + 1)]
