"""The device mesh: Megatron's rank order and process groups, on 4 gloo ranks.

This file is also the rank worker (`python test_parallel_mesh.py OUT_DIR` under
torchrun-style RANK/WORLD_SIZE/MASTER_* variables). Each rank writes the ranks
of every group it belongs to, for several layouts; the test compares them with
Megatron's groups for the same sizes (tp fastest-varying, then cp, dp, pp).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from mg.core.parallel import ParallelDims, ParallelLayoutError
from mg.core.testing.launch import launch_workers

WORLD = 4
LAYOUTS = [
    {"tp": 2},
    {"tp": 1},
    {"tp": 4},
    {"tp": 2, "pp": 2},
    {"tp": 2, "cp": 2},
    {"tp": 1, "cp": 2},
]
NAMES = ("tp", "cp", "dp", "pp", "dp_cp")


def _worker(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    report = []
    for layout in LAYOUTS:
        mesh = ParallelDims.from_world(WORLD, **layout).build_mesh()
        report.append(
            {
                name: {
                    "ranks": dist.get_process_group_ranks(mesh.group(name)),
                    "rank": mesh.rank(name),
                    "size": mesh.size(name),
                }
                for name in NAMES
            }
        )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[list[dict]]:
    out = tmp_path_factory.mktemp("mesh")
    launch_workers(__file__, WORLD, [str(out)], timeout=120)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _megatron_groups(world: int, tp: int = 1, pp: int = 1, cp: int = 1) -> dict[str, list]:
    """Groups as Megatron's RankGenerator builds them for order tp-cp-dp-pp."""
    dims = ParallelDims.from_world(world, tp=tp, pp=pp, cp=cp)
    coords = [dims.coordinates(r) for r in range(world)]

    def groups(varying: set[str]) -> list[list[int]]:
        out: dict[tuple, list[int]] = {}
        for r, c in enumerate(coords):
            key = tuple(v for k, v in sorted(c.items()) if k not in varying)
            out.setdefault(key, []).append(r)
        return sorted(out.values())

    return {
        "tp": groups({"tp"}),
        "cp": groups({"cp"}),
        "dp": groups({"dp"}),
        "pp": groups({"pp"}),
        "dp_cp": groups({"dp", "cp"}),
    }


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_groups_follow_megatron_rank_order(reports, index: int) -> None:
    layout = LAYOUTS[index]
    expected = _megatron_groups(WORLD, **layout)
    for rank in range(WORLD):
        got = reports[rank][index]
        for name in NAMES:
            (group,) = [g for g in expected[name] if rank in g]
            assert got[name]["ranks"] == group, (layout, rank, name)
            assert got[name]["rank"] == group.index(rank)
            assert got[name]["size"] == len(group)


def test_known_megatron_layouts() -> None:
    """Spot values from Megatron's docs: 8 ranks, tp=2, pp=2 → dp groups [0,2],[1,3],…"""
    groups = _megatron_groups(8, tp=2, pp=2)
    assert groups["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert groups["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert groups["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert ParallelDims.from_world(8, tp=2, pp=2).coordinates(5) == {
        "tp": 1,
        "cp": 0,
        "dp": 0,
        "pp": 1,
    }


def test_world_size_must_factor() -> None:
    with pytest.raises(ParallelLayoutError, match=r"world_size \(6\) is not divisible.*\(4\)"):
        ParallelDims.from_world(6, tp=4)
    assert ParallelDims.from_world(8, tp=2, cp=2).dp == 2
    with pytest.raises(ParallelLayoutError, match="tensor parallel size must be >= 1"):
        ParallelDims.from_world(4, tp=0)


def test_single_process_mesh_without_torchrun() -> None:
    """A one-rank mesh works without torchrun (a private gloo group)."""
    script = (
        "from mg.core.parallel import ParallelDims\n"
        "m = ParallelDims.from_world(1).build_mesh()\n"
        "print(m.size('dp'), m.rank('tp'), m.size('dp_cp'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["1", "0", "1"]


if __name__ == "__main__":
    _worker(sys.argv[1])
