"""Checkpoints of a model with multi-token prediction: the MTP weights in `torch` and
`torch_dist`, Megatron's key layout, and resumes equal to the uninterrupted run.

A PP=2 run (MTP on the last stage, untied embeddings as DeepSeek-V3's, so the last stage
holds an embedding copy for its MTP block) saves at iteration 5 in both formats and
exits; the `torch` checkpoint resumes at PP=2, the `torch_dist` one in one process
(layout-agnostic). Iterations 6-10 equal the one-process run's (fp32, 1e-5 relative).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mg.core.testing.launch import launch_workers

WORKER = Path(__file__).with_name("ddp_worker.py")
FLAGS = ["--position-embedding-type", "rope", "--attention-dropout", "0", "--hidden-dropout", "0"]
FLAGS += ["--mtp-num-layers", "2", "--untie-embeddings-and-output-weights", "--swiglu"]
PP2 = ["--pipeline-model-parallel-size", "2"]


def _close(expected: list[float], got: list[float]) -> None:
    assert len(got) == len(expected) > 0
    for a, b in zip(expected, got, strict=True):
        assert abs(a - b) / abs(a) <= 1e-5, (expected, got)


@pytest.mark.slow
def test_mtp_checkpoints_both_formats_resume(tmp_path: Path, mock_argv, train) -> None:
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=8, iters=10)
    one = train(argv)
    exit5 = ["--save-interval", "5", "--exit-interval", "5"]
    dist_dir, torch_dir = str(tmp_path / "dist"), str(tmp_path / "torch")
    argvs = [
        [*argv, *PP2, "--ckpt-format", "torch_dist", "--save", dist_dir, *exit5],
        [*argv, *PP2, "--ckpt-format", "torch", "--save", torch_dir, *exit5],
        [*argv, *PP2, "--ckpt-format", "torch", "--load", torch_dir],
    ]
    out = tmp_path / "runs.json"
    launch_workers(str(WORKER), 2, [str(out), json.dumps(argvs)], timeout=600)
    runs = json.loads(out.read_text())
    _close(one.losses[5:], runs[2]["losses"])
    _close(one.extra_losses["mtp_2 loss"][5:], runs[2]["extra_losses"]["mtp_2 loss"])
    at_pp1 = train([*argv, "--load", dist_dir, "--ckpt-format", "torch_dist"])
    _close(one.losses[5:], at_pp1.losses)
    _close(one.extra_losses["mtp_1 loss"][5:], at_pp1.extra_losses["mtp_1 loss"])

    # torch: the last stage's file holds the MTP block and its embedding copy, Megatron's
    folder = Path(torch_dir, "iter_0000005")
    first = torch.load(folder / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)
    last = torch.load(folder / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert not any(k.startswith("mtp.") for k in first["model"])
    assert "mtp.layers.1.eh_proj.weight" in last["model"]
    assert "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight" in last["model"]
    assert torch.equal(  # the two embedding copies stayed equal
        first["model"]["embedding.word_embeddings.weight"],
        last["model"]["embedding.word_embeddings.weight"],
    )
    # torch_dist: Megatron-Core's keys (a depth's layer by depth, norms under fused names)
    from torch.distributed.checkpoint import FileSystemReader

    keys = set(
        FileSystemReader(str(Path(dist_dir, "iter_0000005"))).read_metadata().state_dict_metadata
    )
    for key in (
        "mtp.layers.0.eh_proj.weight",
        "mtp.layers.1.enorm.weight",
        "mtp.layers.1.transformer_layer.self_attention.linear_qkv.layer_norm_weight",
        "mtp.layers.0.transformer_layer.mlp.linear_fc1.layer_norm_weight",
        "mtp.layers.0.final_layernorm.weight",
    ):
        assert key in keys, sorted(k for k in keys if k.startswith("mtp"))
    assert not any(k.startswith("mtp.layers.0.transformer_layer.input_layernorm") for k in keys)

    # mg-eval / mg-serve read both back whole (no flags), MTP block included, the same
    from mg.core.checkpoint import load_model

    from_torch, config, _, _ = load_model(torch_dir)
    from_dist, _, _, _ = load_model(dist_dir)
    assert config.mtp_num_layers == 2
    theirs = from_dist.state_dict()
    for name, tensor in from_torch.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name
    assert "mtp.layers.1.transformer_layer.input_layernorm.weight" in theirs
