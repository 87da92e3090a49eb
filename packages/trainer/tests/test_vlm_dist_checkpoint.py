"""`mg-train vlm --ckpt-format torch_dist`: Megatron-Core's LLaVAModel keys, resume and
resharding.

The checkpoint keys each tower as megatron-core's `LLaVAModel.sharded_state_dict` does
(`language_model.*` as a GPT, `vision_model.*` with the ViT's layers on their own axis,
`vision_projection.*`); a run saved at iteration 5 and resumed gives iterations 6-10's
losses bit for bit; a TP=2 save loads at TP=1 with the same weights.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from mg.core.checkpoint.dist_format import stored_keys
from mg.core.checkpoint.layout import CheckpointError
from mg.trainer.arguments import parse_args
from mg.trainer.training import Trainer


def _sibling(name: str):
    """A module beside this file (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_vlmck_{name}", Path(__file__).with_name(name))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


VLM = _sibling("test_vlm_training.py").VLM


def _argv(tmp_path: Path, *extra: str, iters: int = 10) -> list[str]:
    return [*VLM, "--train-iters", str(iters), "--data-cache-path", str(tmp_path), *extra]


def _checkpointing(folder: Path) -> list[str]:
    return ["--save", str(folder), "--load", str(folder), "--save-interval", "5"] + [
        "--ckpt-format",
        "torch_dist",
    ]


@pytest.mark.slow  # three short runs: ~25 s on a loaded 2-CPU box
def test_resume_from_a_torch_dist_checkpoint_continues_bitwise(tmp_path: Path) -> None:
    """10 iterations straight; 5, saved, then 5 more from the checkpoint: the same losses."""
    straight = Trainer(parse_args(_argv(tmp_path / "a", "--freeze-ViT"))).train().losses
    save = [*_checkpointing(tmp_path / "ck"), "--freeze-ViT"]
    first = Trainer(parse_args(_argv(tmp_path / "b", *save, "--exit-interval", "5"))).train()
    second = Trainer(parse_args(_argv(tmp_path / "b", *save))).train()
    assert first.losses + second.losses == straight
    keys = stored_keys(tmp_path / "ck" / "iter_0000005")
    for key in (
        "language_model.embedding.word_embeddings.weight",
        "language_model.decoder.layers.self_attention.linear_qkv.weight",
        "language_model.decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "language_model.decoder.final_layernorm.weight",
        "vision_model.conv1.weight",
        "vision_model.class_token",
        "vision_model.position_embeddings.weight",
        "vision_model.ln_pre.weight",
        "vision_model.decoder.layers.self_attention.linear_qkv.weight",
        "vision_model.decoder.layers.mlp.linear_fc1.layer_norm_bias",
        "vision_projection.encoder.linear_fc1.weight",
        "vision_projection.encoder.linear_fc2.bias",
    ):
        assert key in keys, key
    assert not any(k.startswith("model.") for k in keys)  # no per-parameter layout


@pytest.mark.slow  # two gloo ranks, then one process: ~100 s on a loaded 2-CPU box
def test_tensor_parallel_save_loads_at_one_rank(tmp_path: Path) -> None:
    """A TP=2 run saves at iteration 5; one process loads it (weights, and the Adam state
    resharded from its global tensors) and trains iterations 6-10 with the TP=2 run's
    losses (to 1e-5 relative: split matmuls sum in another order)."""
    run_ranks = _sibling("test_ddp.py").run_ranks
    tp2 = ["--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
    (saved,) = run_ranks(
        [_argv(tmp_path, *tp2, *_checkpointing(tmp_path / "ck"), "--freeze-ViT")],
        2,
        tmp_path / "two.json",
    )
    one = ["--make-vocab-size-divisible-by", "128", "--freeze-ViT", "--ckpt-format", "torch_dist"]
    one += ["--load", str(tmp_path / "ck"), "--ckpt-step", "5"]
    resumed = Trainer(parse_args(_argv(tmp_path, *one))).train()
    assert len(resumed.losses) == 5
    assert resumed.losses == pytest.approx(saved["losses"][5:], rel=1e-5)


@pytest.mark.slow  # two gloo ranks, then one process: ~120 s on a loaded 2-CPU box
def test_pipeline_parallel_save_loads_at_one_stage(tmp_path: Path) -> None:
    """A PP=2 run (the towers on the first stage) saves at iteration 5 under the whole
    model's names; one process loads it and trains iterations 6-10 with its losses."""
    run_ranks = _sibling("test_ddp.py").run_ranks
    pp2 = ["--pipeline-model-parallel-size", "2", "--freeze-ViT"]
    (saved,) = run_ranks(
        [_argv(tmp_path, *pp2, *_checkpointing(tmp_path / "ck"))], 2, tmp_path / "two.json"
    )
    one = ["--freeze-ViT", "--ckpt-format", "torch_dist", "--load", str(tmp_path / "ck")]
    resumed = Trainer(parse_args(_argv(tmp_path, *one, "--ckpt-step", "5"))).train()
    assert resumed.losses == pytest.approx(saved["losses"][5:], rel=1e-6)


def test_a_first_run_starts_from_the_pretrained_checkpoint(tmp_path: Path) -> None:
    """`--pretrained-checkpoint` with nothing in --load: the weights, as --finetune (the
    same losses), and a later run resumes from --load."""

    def _trainer(*extra: str, iters: int = 2) -> Trainer:
        return Trainer(parse_args(_argv(tmp_path, *extra, iters=iters)))

    ck = ["--save", str(tmp_path / "ck"), "--save-interval", "2", "--ckpt-format", "torch_dist"]
    _trainer(*ck).train()
    finetuned = _trainer("--load", str(tmp_path / "ck"), "--finetune").train().losses
    run = ["--load", str(tmp_path / "run"), "--save", str(tmp_path / "run")]
    run += ["--pretrained-checkpoint", str(tmp_path / "ck"), "--save-interval", "2"]
    assert _trainer(*run).train().losses == finetuned
    again = _trainer(*run, iters=3).train().losses  # resumes from --load at iteration 2
    assert len(again) == 1


def test_a_pretrained_checkpoint_without_the_projector(tmp_path: Path) -> None:
    """Megatron's combined checkpoint (a language model and a vision tower, no projector):
    with --allow-missing-vision-projection-checkpoint the towers take its weights and the
    projector keeps its init."""
    from mg.core.checkpoint.dist_format import save_dist_checkpoint
    from mg.core.checkpoint.megatron_dist import megatron_model_state
    from mg.core.checkpoint.megatron_sharded_keys import key_layout

    fresh = Trainer(parse_args(_argv(tmp_path, iters=1))).model
    combined = {
        name: tensor + 1.0
        for name, tensor in fresh.state_dict().items()
        if not name.startswith("vision_projection.")
    }
    state = megatron_model_state(combined, key_layout(fresh.config), extra_state=True)
    save_dist_checkpoint(tmp_path / "combined", 1, {**state.tensors, **state.objects}, {})
    run = ["--load", str(tmp_path / "run"), "--ckpt-format", "torch_dist"]
    run += ["--pretrained-checkpoint", str(tmp_path / "combined")]
    with pytest.raises(CheckpointError, match="vision_projection"):  # the projector is asked for
        Trainer(parse_args(_argv(tmp_path, *run, iters=1)))
    run.append("--allow-missing-vision-projection-checkpoint")
    model = Trainer(parse_args(_argv(tmp_path, *run, iters=1))).model
    for name, tensor in model.state_dict().items():
        expected = (
            fresh.state_dict()[name] if name.startswith("vision_projection.") else combined[name]
        )
        assert torch.equal(tensor, expected), name
