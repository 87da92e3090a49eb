"""Checkpoints of pipeline-parallel runs: Megatron's mp_rank_TT_PPP layout, resume equal.

A PP=2 run (interleaved: 2 model chunks per rank) saves at iteration 5 and
exits; a second run resumes from it to iteration 10. Its losses equal the
uninterrupted single-process run's iterations 6-10 (fp32, 1e-5 relative, as
in test_pp_cp_equivalence.py), and each pipeline rank's file holds its own
chunks as `model0`/`model1` with local layer numbers, as Megatron writes them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mg.core.testing.launch import launch_workers

WORKER = Path(__file__).with_name("ddp_worker.py")
FLAGS = ["--num-layers", "4", "--attention-dropout", "0", "--hidden-dropout", "0"]
PP2_INTERLEAVED = [
    "--pipeline-model-parallel-size",
    "2",
    "--num-layers-per-virtual-pipeline-stage",
    "1",
]


def _run(argvs: list[list[str]], world_size: int, out: Path) -> list[dict]:
    launch_workers(str(WORKER), world_size, [str(out), json.dumps(argvs)], timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_pp2_torch_checkpoint_layout_and_resume(tmp_path: Path, mock_argv, train) -> None:
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=8, iters=10)
    one = train(argv)
    save = str(tmp_path / "ckpt")
    first = [
        *argv,
        *PP2_INTERLEAVED,
        "--ckpt-format",
        "torch",
        "--save",
        save,
        "--save-interval",
        "5",
        "--exit-interval",
        "5",
    ]
    second = [*argv, *PP2_INTERLEAVED, "--ckpt-format", "torch", "--load", save]
    runs = _run([first, second], 2, tmp_path / "runs.json")
    assert len(runs[0]["losses"]) == 5 and len(runs[1]["losses"]) == 5
    for a, b in zip(one.losses[5:], runs[1]["losses"], strict=True):
        assert abs(a - b) / abs(a) <= 1e-5, (one.losses, runs[1]["losses"])

    folder = Path(save, "iter_0000005")
    assert sorted(p.name for p in folder.iterdir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    first_stage = torch.load(folder / "mp_rank_00_000" / "model_optim_rng.pt", weights_only=False)
    last_stage = torch.load(folder / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    assert "model" not in first_stage and {"model0", "model1"} <= set(first_stage)
    # rank 0: layers 0 and 2, embedding in chunk 0; rank 1: layers 1 and 3, head in chunk 1
    assert "embedding.word_embeddings.weight" in first_stage["model0"]
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in first_stage["model1"]
    assert "decoder.layers.1.mlp.linear_fc1.weight" not in first_stage["model1"]
    assert "output_layer.weight" in last_stage["model1"]  # the tied copy, as Megatron saves it
    assert "decoder.final_layernorm.weight" in last_stage["model1"]
    assert first_stage["mg"]["parallel"]["pp"] == 2
    assert torch.equal(  # the two copies of the tied embedding stayed equal
        first_stage["model0"]["embedding.word_embeddings.weight"],
        last_stage["model1"]["output_layer.weight"],
    )


@pytest.mark.slow
def test_torch_dist_reshards_across_pipeline_sizes(tmp_path: Path, mock_argv, train) -> None:
    """Saved at PP=2 (torch_dist) at iteration 5; resumed at PP=1 (one process) and at PP=4
    (4 ranks), iterations 6-10 equal the uninterrupted run (1e-5 relative)."""
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=8, iters=10)
    one = train(argv)
    save = str(tmp_path / "dist")
    first = [*argv, "--pipeline-model-parallel-size", "2", "--ckpt-format", "torch_dist"]
    first += ["--save", save, "--save-interval", "5", "--exit-interval", "5"]
    _run([first], 2, tmp_path / "save.json")
    assert Path(save, "iter_0000005", "metadata.json").is_file()

    at_pp1 = train([*argv, "--load", save, "--ckpt-format", "torch_dist"])
    at_pp4 = _run(
        [
            [
                *argv,
                "--load",
                save,
                "--ckpt-format",
                "torch_dist",
                "--pipeline-model-parallel-size",
                "4",
            ]
        ],
        4,
        tmp_path / "pp4.json",
    )[0]
    for name, losses in (("pp1", at_pp1.losses), ("pp4", at_pp4["losses"])):
        assert len(losses) == 5, name
        for a, b in zip(one.losses[5:], losses, strict=True):
            assert abs(a - b) / abs(a) <= 1e-5, (name, one.losses, losses)


def test_distributed_optimizer_with_pipeline_resumes_in_both_formats(
    tmp_path: Path, mock_argv, train
) -> None:
    """PP=2 with the distributed optimizer saves at iteration 5 (torch: mp_rank_00_00P;
    torch_dist) and resumes: torch at PP=2, torch_dist at PP=2 and PP=1 with the plain
    optimizer (each stage's own parameter groups) and at PP=2 x DP=2 overlapped.
    Iterations 6-10 equal the uninterrupted run (1e-5)."""
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=8, iters=10)
    one = train(argv)
    pp2 = ["--pipeline-model-parallel-size", "2", "--use-distributed-optimizer"]
    stop = ["--save-interval", "5", "--exit-interval", "5"]
    legacy, dist = str(tmp_path / "torch"), str(tmp_path / "dist")
    runs = _run(
        [
            [*argv, *pp2, "--ckpt-format", "torch", "--save", legacy, *stop],
            [*argv, *pp2, "--ckpt-format", "torch", "--load", legacy],
            [*argv, *pp2, "--ckpt-format", "torch_dist", "--save", dist, *stop],
            [*argv, "--pipeline-model-parallel-size", "2", "--load", dist],  # plain AdamW
        ],
        2,
        tmp_path / "pp2.json",
    )
    assert sorted(p.name for p in Path(legacy, "iter_0000005").iterdir()) == [
        "mp_rank_00_000",
        "mp_rank_00_001",
    ]
    at_pp1 = train([*argv, "--load", dist]).losses
    at_pp2_dp2 = _run(
        [[*argv, *pp2, "--load", dist, "--overlap-grad-reduce", "--overlap-param-gather"]],
        4,
        tmp_path / "dp2.json",
    )[0]["losses"]
    resumed = {
        "torch pp2": runs[1]["losses"],
        "torch_dist pp2 plain": runs[3]["losses"],
        "pp1": at_pp1,
        "dp2": at_pp2_dp2,
    }
    for name, losses in resumed.items():
        assert len(losses) == 5, name
        for a, b in zip(one.losses[5:], losses, strict=True):
            assert abs(a - b) / abs(a) <= 1e-5, (name, one.losses, losses)
