"""torch_dist checkpoints of tensor-parallel models: resharding, async saves, kill -9.

Also the rank worker (`python test_parallel_tensor_checkpoint.py MODE DIR`).
`reshard`: 4 gloo ranks train a Llama-shaped model (SwiGLU, so the strided
fc1 shards are covered) one step at TP=2 x DP=2 (same batch on every rank, so
replicas agree), save asynchronously while the parameters change (the save
must hold the values at the call), then load at TP=1 x DP=4 and at TP=4;
every parameter and AdamW moment must equal the saved one (bit-exact: DCP
copies bytes). One process then reads the whole model without a process
group. `killed`: one process saves iteration 1, starts an async save of
iteration 2 whose writes are slowed down, and is killed with SIGKILL in the
middle of it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

from mg.core.checkpoint import read_latest_iteration
from mg.core.checkpoint.dist_format import (
    is_torch_dist,
    load_dist_checkpoint,
    load_full_state,
    save_dist_checkpoint,
)
from mg.core.models import GPTModel, presets
from mg.core.parallel import ParallelDims
from mg.core.parallel.tensor_parallel import apply_tensor_parallel, sync_tensor_parallel_grads
from mg.core.testing.launch import launch_workers

WORLD = 4


def _config():
    return presets.tiny_llama(hidden_size=32, ffn_hidden_size=48, seq_length=16, num_query_groups=4)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _build(tp: int) -> GPTModel:
    torch.manual_seed(0)
    model = GPTModel(_config())
    mesh = ParallelDims.from_world(WORLD, tp=tp).build_mesh()
    if tp > 1:
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=False)
    return model


def _reshard(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = _build(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(5))
    model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    sync_tensor_parallel_grads(model)
    opt.step()
    saved = {k: _full(v).clone() for k, v in model.state_dict().items()}
    saved_opt = {
        k: _full(v["exp_avg"]).clone()
        for k, v in get_optimizer_state_dict(model, opt)["state"].items()
    }
    state = {"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}
    pending = save_dist_checkpoint(out / "ckpt", 3, state, {"note": "x"}, async_save=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)  # training goes on; the checkpoint keeps the values at the call
    pending.wait()
    dist.barrier()
    report = {}
    for tp in (1, 4):
        loaded = _build(tp)
        opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
        target = {"model": loaded.state_dict(), "optimizer": get_optimizer_state_dict(loaded, opt2)}
        common = load_dist_checkpoint(out / "ckpt" / "iter_0000003", target)
        set_optimizer_state_dict(loaded, opt2, target["optimizer"])
        report[f"tp{tp}"] = {
            "param": max(
                float((_full(v) - saved[k]).abs().max()) for k, v in loaded.state_dict().items()
            ),
            "exp_avg": max(
                float((_full(v["exp_avg"]) - saved_opt[k]).abs().max())
                for k, v in get_optimizer_state_dict(loaded, opt2)["state"].items()
            ),
            "common": common,
        }
    if rank == 0:
        whole = load_full_state(out / "ckpt" / "iter_0000003")
        report["full"] = max(float((whole[k] - v).abs().max()) for k, v in saved.items())
        report["full_keys"] = sorted(whole) == sorted(saved)
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def _killed(out: Path) -> None:
    from torch.distributed.checkpoint import FileSystemWriter

    torch.manual_seed(0)
    model = GPTModel(_config())
    save_dist_checkpoint(out / "ckpt", 1, {"model": model.state_dict()}, {"step": 1})
    original = FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        time.sleep(30)  # the test kills us during this
        return original(self, plan, planner)

    FileSystemWriter.write_data = slow_write_data
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    save_dist_checkpoint(
        out / "ckpt", 2, {"model": model.state_dict()}, {"step": 2}, async_save=True
    )
    print("ASYNC SAVE STARTED", flush=True)
    time.sleep(60)


@pytest.fixture(scope="module")
def reshard_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("dist_ckpt")
    launch_workers(__file__, WORLD, ["reshard", str(out)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("tp", [1, 4])
def test_tp2_dp2_checkpoint_loads_into_other_layouts(reshard_reports, tp: int) -> None:
    for report in reshard_reports:
        r = report[f"tp{tp}"]
        assert r["param"] == 0.0 and r["exp_avg"] == 0.0
        assert r["common"] == {"note": "x", "iteration": 3}


def test_one_process_reads_the_whole_model(reshard_reports) -> None:
    assert reshard_reports[0]["full"] == 0.0 and reshard_reports[0]["full_keys"]


def test_kill_during_async_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.Popen(
        [sys.executable, __file__, "killed", str(tmp_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "ASYNC SAVE STARTED" in line:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert any("ASYNC SAVE STARTED" in line for line in lines), "".join(lines)
    ckpt = tmp_path / "ckpt"
    assert read_latest_iteration(ckpt) == 1
    assert is_torch_dist(ckpt / "iter_0000001")
    assert not (ckpt / "iter_0000002").exists()  # only the .tmp staging folder, never read
    torch.manual_seed(0)
    reference = GPTModel(_config()).state_dict()
    state = load_full_state(ckpt / "iter_0000001")
    assert all(torch.equal(state[k], v) for k, v in reference.items())


if __name__ == "__main__":
    {"reshard": _reshard, "killed": _killed}[sys.argv[1]](Path(sys.argv[2]))
