"""--ckpt-format torch_dist with --use-distributed-optimizer: the full optimizer state is
stored by parameter name, so it resumes at another data-parallel size and into the
plain optimizer (and back).

Reference: the uninterrupted single-process run. Tolerance (fp32): 1e-5 relative on
losses, as in test_dist_opt.py: the distributed optimizer reduce-scatters gradients in
another order than one process accumulating all micro-batches (~1e-7 relative per step).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from mg.core.testing.launch import launch_workers

WORKER = Path(__file__).with_name("ddp_worker.py")
FLAGS = ["--attention-dropout", "0", "--hidden-dropout", "0"]
LOSS_RTOL = 1e-5
TORCH_DIST = ["--ckpt-format", "torch_dist"]


def _run(argvs: list[list[str]], world_size: int, out: Path) -> list[dict]:
    launch_workers(str(WORKER), world_size, [str(out), json.dumps(argvs)], timeout=600)
    return json.loads(out.read_text())


def _assert_close(reference: list[float], got: list[float]) -> None:
    assert len(reference) == len(got)
    for a, b in zip(reference, got, strict=True):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (reference, got)


@pytest.mark.slow
def test_dist_opt_torch_dist_resumes_at_dp1_and_dp2(tmp_path, mock_argv, train) -> None:
    """DP=2 with the distributed optimizer saves at iteration 5 (of 10); one process with
    plain AdamW and DP=2 with the distributed optimizer resume it: iterations 6-10 equal
    the uninterrupted run. The stored state is AdamW's, by name, written once."""
    argv = mock_argv(tmp_path, *FLAGS, *TORCH_DIST, mbs=2, gbs=8, iters=10)
    one = train(argv)
    ckpt = str(tmp_path / "ckpt")
    dist_opt = [*argv, "--use-distributed-optimizer"]
    (saved,) = _run(
        [[*dist_opt, "--save", ckpt, "--save-interval", "5", "--exit-interval", "5"]],
        2,
        tmp_path / "save.json",
    )
    _assert_close(one.losses[:5], saved["losses"])

    metadata = dcp.FileSystemReader(Path(ckpt, "iter_0000005")).read_metadata()
    keys = metadata.state_dict_metadata
    name = "decoder.final_layernorm.weight"
    for moment in ("exp_avg", "exp_avg_sq", "step"):
        assert f"optimizer.state.{name}.{moment}" in keys
    # Full (DP-size-independent) tensors: the moments have the parameter's global shape.
    assert keys[f"optimizer.state.{name}.exp_avg"].size == keys[name].size  # no layer axis

    plain = train([*argv, "--load", ckpt])
    (sharded,) = _run([[*dist_opt, "--load", ckpt]], 2, tmp_path / "load.json")
    _assert_close(one.losses[5:], plain.losses)
    _assert_close(one.losses[5:], sharded["losses"])


def test_plain_torch_dist_resumes_into_the_distributed_optimizer(
    tmp_path, mock_argv, train
) -> None:
    """The other direction, in one process: plain AdamW saves at iteration 3 (of 6), the
    distributed optimizer (d = 1) resumes it; iterations 4-6 equal the uninterrupted run."""
    argv = mock_argv(tmp_path, *FLAGS, *TORCH_DIST, mbs=2, gbs=4, iters=6)
    one = train(argv)
    ckpt = str(tmp_path / "ckpt")
    train([*argv, "--save", ckpt, "--save-interval", "3", "--exit-interval", "3"])
    resumed = train([*argv, "--use-distributed-optimizer", "--load", ckpt])
    _assert_close(one.losses[3:], resumed.losses)


def test_release_torch_dist_checkpoint_loads_weights_only(tmp_path, mock_argv, train) -> None:
    """A `release` torch_dist checkpoint (converted weights) is found by --load and loads
    like --finetune (Megatron): the same losses as --finetune from the iteration folder."""
    from mg.core.checkpoint.dist_format import load_common, load_full_state, save_dist_checkpoint

    argv = mock_argv(tmp_path, *FLAGS, *TORCH_DIST, mbs=2, gbs=4, iters=3)
    ckpt = tmp_path / "ckpt"
    train([*argv, "--save", str(ckpt)])
    folder = ckpt / "iter_0000003"
    release = tmp_path / "release"
    common = {k: v for k, v in load_common(folder).items() if k in ("args", "mg")}
    save_dist_checkpoint(release, "release", {"model": load_full_state(folder)}, common)
    finetuned = train([*argv, "--load", str(ckpt), "--finetune"])
    from_release = train([*argv, "--load", str(release)])
    assert from_release.losses == finetuned.losses


def test_release_torch_checkpoint_loads_weights_only(tmp_path, mock_argv, train) -> None:
    """The same for the torch format: `release/mp_rank_00` with model weights and args only
    (no optimizer, no RNG) loads like --finetune instead of asking for optimizer state."""
    import torch

    from mg.core.checkpoint.torch_format import save_checkpoint_shards

    argv = mock_argv(tmp_path, *FLAGS, "--ckpt-format", "torch", mbs=2, gbs=4, iters=3)
    ckpt = tmp_path / "ckpt"
    train([*argv, "--save", str(ckpt)])
    saved = torch.load(
        ckpt / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False
    )
    weights = {k: saved[k] for k in ("model", "args", "checkpoint_version", "mg")}
    save_checkpoint_shards(tmp_path / "release", "release", {(0, 0): weights})
    finetuned = train([*argv, "--load", str(ckpt), "--finetune"])
    from_release = train([*argv, "--load", str(tmp_path / "release")])
    assert from_release.losses == finetuned.losses
