"""The distributed optimizer's sharded state through DCP, on 4 gloo ranks, against its
gathered `state_dict()`.

This file is also the rank worker (`python THIS OUT_DIR` under RANK/WORLD_SIZE). Per
case (fp32 and bf16 AdamW, SGD with momentum) each rank steps a small model twice at
d=4 with one bucket layout, saves `sharded_state()` (its own fragments only) with
`save_dist_checkpoint`, and loads it into a fresh optimizer at d=2 with another
bucket size (other fragment boundaries, other padding) through
`sharded_state_to_load` / `load_sharded_state`. The loaded state, gathered, must
equal the saved one exactly (the same fp32 numbers are moved, none computed), and
the stored tensors must have the parameters' global shapes.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from mg.core.checkpoint.dist_format import load_dist_checkpoint, save_dist_checkpoint
from mg.core.parallel.distributed_optimizer import DistributedOptimizer
from mg.core.testing.launch import launch_workers

WORLD = 4


def _model(dtype: torch.dtype) -> nn.Module:
    """Odd shapes, so that data-parallel fragments cut rows in the middle."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 13), nn.GELU(), nn.Linear(13, 5), nn.LayerNorm(5)).to(dtype)


def _groups(model: nn.Module) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() > 1]
    rest = [p for p in model.parameters() if p.dim() == 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


MAKERS = {
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=False),
    "sgd": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=False),
}


def _train(opt: DistributedOptimizer, model: nn.Module, rank: int) -> None:
    for step in range(2):
        opt.zero_grad()
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randn(3, 7, generator=g).to(next(model.parameters()).dtype)
        model(x).float().pow(2).mean().backward()
        opt.finish_grad_sync()
        opt.step()


def _by_key(state: dict) -> dict:
    """DCP keys are strings: index the state by the parameter's position as text."""
    return {
        "state": {str(i): e for i, e in state["state"].items()},
        "param_groups": state["param_groups"],
    }


def _case(name: str, folder: Path, rank: int, group4, group2) -> dict:
    kind, precision = name.split("_")
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    model = _model(dtype)
    fresh = copy.deepcopy(model)
    opt = DistributedOptimizer(_groups(model), MAKERS[kind], dp_group=group4, bucket_size=40)
    _train(opt, model, rank)
    saved = opt.state_dict()  # gathered: the reference
    own = _by_key(opt.sharded_state())
    save_dist_checkpoint(folder, 1, {"optimizer": own, "model": dict(model.state_dict())}, {})
    out: dict = {}
    if rank == 0:
        metadata = dcp.FileSystemReader(folder / "iter_0000001").read_metadata()
        shapes = {
            k: tuple(v.size) for k, v in metadata.state_dict_metadata.items() if hasattr(v, "size")
        }
        out["shapes_ok"] = all(
            shapes.get(f"optimizer.state.{i}.{key}") in (None, tuple(p.shape))
            for i, p in enumerate(opt.params)
            for key in ("exp_avg", "exp_avg_sq", "momentum_buffer", "main_param")
        )
        out["keys"] = sorted(k for k in shapes if k.startswith("optimizer.state.0."))
    if group2 is None:  # ranks 2 and 3 take no part in the d=2 load
        return out
    opt2 = DistributedOptimizer(_groups(fresh), MAKERS[kind], dp_group=group2, bucket_size=1000)
    stored = set(dcp.FileSystemReader(folder / "iter_0000001").read_metadata().state_dict_metadata)
    request = opt2.sharded_state_to_load(lambda i, key: f"optimizer.state.{i}.{key}" in stored)
    sharded = {"optimizer": _by_key(request), "model": dict(fresh.state_dict())}
    load_dist_checkpoint(folder / "iter_0000001", sharded, process_group=group2)
    loaded = sharded["optimizer"]
    opt2.load_sharded_state(
        {
            "state": {int(i): e for i, e in loaded["state"].items()},
            "param_groups": saved["param_groups"],
        }
    )
    again = opt2.state_dict()
    out["equal"] = sorted(again["state"]) == sorted(saved["state"]) and all(
        torch.equal(again["state"][i][key], value)
        for i, entry in saved["state"].items()
        for key, value in entry.items()
    )
    out["main_param"] = any("main_param" in e for e in saved["state"].values())
    return out


CASES = ["adamw_fp32", "adamw_bf16", "sgd_fp32"]


def _worker(out_dir: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    group4 = dist.new_group(list(range(WORLD)))
    group2 = dist.new_group([0, 1])
    results = {}
    for name in CASES:
        folder = out_dir / name
        results[name] = _case(name, folder, rank, group4, group2 if rank < 2 else None)
        dist.barrier()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("sharded_state")
    launch_workers(__file__, WORLD, [str(out)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case", CASES)
def test_sharded_state_saved_at_d4_loads_at_d2_with_other_buckets(results, case) -> None:
    for rank in (0, 1):
        assert results[rank][case]["equal"], (rank, case)
    assert results[0][case]["shapes_ok"]
    assert results[0][case]["main_param"] == (case == "adamw_bf16")
    keys = results[0][case]["keys"]
    if case.startswith("sgd"):
        assert keys == ["optimizer.state.0.momentum_buffer"]
    else:
        assert {"optimizer.state.0.exp_avg", "optimizer.state.0.step"} <= set(keys)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker(Path(sys.argv[1]))
