"""The loop's numbers: loss goes down, accumulation, determinism, resume, exits."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch

from mg.trainer.arguments import ArgumentError, parse_args


def test_loss_goes_down_on_botchan(tmp_path, mock_argv, train, botchan_corpus) -> None:
    prefix, tok_flags = botchan_corpus
    argv = [
        "gpt",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "64",
        "--lr",
        "3e-3",
        "--lr-decay-style",
        "cosine",
        "--lr-warmup-iters",
        "5",
        "--min-lr",
        "3e-4",
        "--micro-batch-size",
        "4",
        "--train-iters",
        "40",
        "--data-path",
        prefix,
        "--split",
        "95,5,0",
        "--eval-interval",
        "40",
        "--eval-iters",
        "2",
        "--log-interval",
        "1000",
        "--attention-dropout",
        "0",
        "--hidden-dropout",
        "0",
        "--data-cache-path",
        str(tmp_path / "cache"),
        *tok_flags,
    ]
    result = train(argv)
    first = sum(result.losses[:5]) / 5
    last = sum(result.losses[-5:]) / 5
    # GPT-2 vocab (50,304 padded): starts near ln(50304) = 10.8
    assert first > 10.0
    assert last < first - 3.0, (first, last)
    [(iteration, valid_loss)] = result.validation
    assert iteration == 40 and valid_loss < first - 2.5


def test_grad_accumulation_matches_one_big_micro_batch(tmp_path, mock_argv, train) -> None:
    no_dropout = ["--attention-dropout", "0", "--hidden-dropout", "0"]
    accumulated = train(mock_argv(tmp_path, *no_dropout, mbs=1, gbs=8, iters=5))
    single = train(mock_argv(tmp_path, *no_dropout, mbs=8, gbs=8, iters=5))
    for a, b in zip(accumulated.losses, single.losses, strict=True):
        assert abs(a - b) / abs(b) <= 1e-5
    for a, b in zip(accumulated.grad_norms, single.grad_norms, strict=True):
        assert abs(a - b) / abs(b) <= 1e-4


def test_deterministic_mode_twice_identical(tmp_path, mock_argv, train) -> None:
    argv = mock_argv(tmp_path, "--deterministic-mode", iters=6)
    first, second = train(argv), train(argv)
    assert first.losses == second.losses
    assert torch.are_deterministic_algorithms_enabled()


def test_resume_is_bitwise_identical(tmp_path, mock_argv, train) -> None:
    straight = train(mock_argv(tmp_path, "--eval-interval", "5", "--eval-iters", "1", iters=20))
    ckpt = str(tmp_path / "ckpt")
    first = train(
        mock_argv(
            tmp_path,
            "--eval-interval",
            "5",
            "--eval-iters",
            "1",
            "--save",
            ckpt,
            "--exit-interval",
            "10",
            iters=20,
        )
    )
    assert first.exit_reason.startswith("--exit-interval") and len(first.losses) == 10
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "10"
    second = train(
        mock_argv(tmp_path, "--eval-interval", "5", "--eval-iters", "1", "--load", ckpt, iters=20)
    )
    assert second.state.iteration == 20 and second.state.consumed_train_samples == 160
    assert first.losses + second.losses == straight.losses  # bitwise
    assert first.validation + second.validation == straight.validation
    # Megatron's --no-initialization: allocate only, the checkpoint fills every weight
    uninitialised = train(
        mock_argv(
            tmp_path,
            *("--eval-interval", "5", "--eval-iters", "1", "--load", ckpt),
            "--no-initialization",
            iters=20,
        )
    )
    assert uninitialised.losses == second.losses


def test_no_initialization_needs_a_checkpoint(tmp_path, mock_argv) -> None:
    with pytest.raises(ArgumentError, match="--no-initialization .* needs --load"):
        parse_args(mock_argv(tmp_path, "--no-initialization"))


def test_checkpoint_is_self_describing(tmp_path, mock_argv, train) -> None:
    from mg.core.checkpoint import describe, load_checkpoint

    ckpt = tmp_path / "ckpt"
    train(mock_argv(tmp_path, "--save", str(ckpt), "--ckpt-format", "torch", iters=3))
    state, iteration = load_checkpoint(ckpt)
    assert iteration == 3
    assert {
        "args",
        "model",
        "optimizer",
        "opt_param_scheduler",
        "rng_state",
        "num_floating_point_operations_so_far",
    } <= set(state)
    assert state["args"].consumed_train_samples == 24
    assert state["args"].hidden_size == 32
    info = describe(ckpt)
    assert info.model_config["hidden_size"] == 32
    assert info.tokenizer_config["tokenizer_type"] == "NullTokenizer"


def test_default_checkpoint_is_torch_dist_and_self_describing(tmp_path, mock_argv, train) -> None:
    """Megatron's default format: DCP shards + common.pt, metadata.json last."""
    from mg.core.checkpoint import describe
    from mg.core.checkpoint.dist_format import (
        is_torch_dist,
        load_common,
        stored_keys,
        stored_tensors,
    )

    ckpt = tmp_path / "ckpt"
    train(mock_argv(tmp_path, "--save", str(ckpt), iters=3))
    folder = ckpt / "iter_0000003"
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert is_torch_dist(folder) and not list(folder.glob("mp_rank_*"))
    common = load_common(folder)
    assert {"args", "opt_param_scheduler", "content_metadata", "mg"} <= set(common)
    assert common["args"].consumed_train_samples == 24
    tensors = stored_tensors(folder)
    # Megatron-Core's keys: layers stacked along a leading axis, no `model.` prefix
    layers = common["mg"]["model_config"]["num_layers"]
    assert tensors["decoder.layers.self_attention.linear_qkv.weight"].shape[0] == layers
    assert "embedding.word_embeddings.weight" in tensors
    assert not any(k.startswith("model.") for k in tensors)
    assert any(k.startswith("optimizer.") for k in tensors)
    objects = stored_keys(folder)
    assert "rng_state/shard_0.0_1.1" in objects
    assert f"decoder.layers.mlp.linear_fc1._extra_state/shard_0_{layers}" in objects
    info = describe(ckpt)
    assert info.model_config["hidden_size"] == 32
    assert info.tokenizer_config["tokenizer_type"] == "NullTokenizer"


def test_finetune_and_no_load_flags(tmp_path, mock_argv, train) -> None:
    ckpt = str(tmp_path / "ckpt")
    train(mock_argv(tmp_path, "--save", ckpt, iters=3))
    tuned = train(mock_argv(tmp_path, "--load", ckpt, "--finetune", iters=3))
    assert tuned.state.iteration == 3 and tuned.state.consumed_train_samples == 24
    fresh = train(mock_argv(tmp_path, iters=3))
    assert tuned.losses[0] < fresh.losses[0]  # started from trained weights
    resumed = train(
        mock_argv(tmp_path, "--load", ckpt, "--no-load-optim", "--no-load-rng", iters=5)
    )
    assert resumed.state.iteration == 5 and len(resumed.losses) == 2


def test_sigterm_saves_and_exits(tmp_path, mock_argv, train) -> None:
    ckpt = tmp_path / "ckpt"

    def send_sigterm(trainer) -> None:
        if trainer.state.iteration == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    result = train(mock_argv(tmp_path, "--save", str(ckpt), iters=10), on_iteration=send_sigterm)
    assert result.exit_reason == "received SIGTERM"
    assert result.state.iteration == 2
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


def test_exit_duration_and_save_interval(tmp_path, mock_argv, train) -> None:
    ckpt = tmp_path / "ckpt"
    result = train(
        mock_argv(
            tmp_path,
            "--save",
            str(ckpt),
            "--save-interval",
            "2",
            "--exit-duration-in-mins",
            "0",
            iters=10,
        )
    )
    assert result.exit_reason.startswith("--exit-duration-in-mins")
    assert result.state.iteration == 1
    assert (ckpt / "iter_0000001").is_dir()


def test_rampup_batch_size(tmp_path, mock_argv, train) -> None:
    argv = mock_argv(tmp_path, "--rampup-batch-size", "4", "4", "16", mbs=4, gbs=12, iters=1)
    at = argv.index("--train-iters")
    argv[at : at + 2] = ["--train-samples", "64"]
    at = argv.index("--lr-warmup-iters")
    argv[at : at + 2] = ["--lr-warmup-samples", "8"]
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    trainer = Trainer(parse_args(argv))
    sizes = []
    trainer.train(on_iteration=lambda t: sizes.append(t.state.consumed_train_samples))
    # 16 samples ramp 4 -> 12 in steps of 4 (one step per 8 samples), then 12 per iteration
    assert sizes == [4, 8, 16, 28, 40, 52, 64]
    assert trainer.train_iters == 7


def test_bf16_and_fp16_run(tmp_path, mock_argv, train) -> None:
    bf16 = train(mock_argv(tmp_path, "--bf16", iters=3))
    assert all(math.isfinite(x) for x in bf16.losses)
    fp16 = train(
        mock_argv(
            tmp_path,
            "--fp16",
            "--initial-loss-scale",
            "1e10",
            "--hysteresis",
            "1",
            mbs=2,
            gbs=2,
            iters=3,
        )
    )
    assert all(math.isfinite(x) for x in fp16.losses)


@pytest.mark.parametrize(("optimizer", "lr"), [("adam", "1e-3"), ("sgd", "0.1")])
def test_optimizers_train(tmp_path, mock_argv, train, optimizer, lr) -> None:
    # SGD moves little at Adam's learning rate: 8 steps of it are within the batch noise
    argv = ["--optimizer", optimizer, "--lr", lr, "--lr-decay-style", "constant"]
    result = train(mock_argv(tmp_path, *argv, "--min-lr", "0", iters=8))
    assert result.losses[-1] < result.losses[0]


def test_deterministic_checkpoints_identical(tmp_path, mock_argv, train) -> None:
    from mg.core.checkpoint import load_checkpoint
    from mg.core.checkpoint.dist_format import load_full_state

    for fmt in ("torch", "torch_dist"):
        for name in ("a", "b"):
            save = str(tmp_path / fmt / name)
            flags = ("--deterministic-mode", "--save", save, "--ckpt-format", fmt)
            train(mock_argv(tmp_path, *flags, iters=4))
    # torch_dist: every stored tensor (model and optimizer state) bitwise equal
    a = load_full_state(tmp_path / "torch_dist" / "a" / "iter_0000004", prefix="")
    b = load_full_state(tmp_path / "torch_dist" / "b" / "iter_0000004", prefix="")
    assert a.keys() == b.keys() and any(k.startswith("optimizer.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    a, _ = load_checkpoint(tmp_path / "torch" / "a")
    b, _ = load_checkpoint(tmp_path / "torch" / "b")
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    exp_avg = [s["exp_avg"] for s in a["optimizer"]["state"].values()]
    exp_avg_b = [s["exp_avg"] for s in b["optimizer"]["state"].values()]
    assert all(torch.equal(x, y) for x, y in zip(exp_avg, exp_avg_b, strict=True))


@pytest.mark.parametrize(
    "flags",
    [
        ["--recompute-activations"],
        [
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
            "--recompute-num-layers",
            "1",
        ],
    ],
    ids=["selective", "full"],
)
def test_recompute_does_not_change_losses(tmp_path, mock_argv, train, flags) -> None:
    plain = train(mock_argv(tmp_path, iters=3))
    recomputed = train(mock_argv(tmp_path, *flags, iters=3))
    for a, b in zip(plain.losses, recomputed.losses, strict=True):
        assert abs(a - b) <= 1e-6 * abs(a)


def test_tensorboard_scalars(tmp_path, mock_argv, train) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    train(
        mock_argv(
            tmp_path,
            "--tensorboard-dir",
            str(tb),
            "--log-interval",
            "2",
            "--eval-interval",
            "4",
            "--eval-iters",
            "1",
            iters=4,
        )
    )
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "lm loss",
        "learning-rate",
        "batch-size",
        "grad-norm",
        "loss-scale",
        "iteration-time",
        "throughput",
        "lm loss validation",
        "lm loss validation ppl",
    } <= tags
    assert [e.step for e in events.Scalars("lm loss")] == [1, 2, 3, 4]


def test_blend_file_and_weighted_data_path(tmp_path, train, botchan_corpus, capsys) -> None:
    prefix, tok_flags = botchan_corpus
    blend = tmp_path / "blend.txt"
    blend.write_text(f"# written like mg-prep refresh's blend.txt\n0.3 {prefix}\n0.7 {prefix}\n")
    base = [
        "gpt",
        "--num-layers",
        "1",
        "--hidden-size",
        "32",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "32",
        "--lr",
        "1e-3",
        "--micro-batch-size",
        "2",
        "--train-iters",
        "3",
        "--eval-iters",
        "0",
        "--split",
        "98,2,0",
        "--data-cache-path",
        str(tmp_path / "cache"),
        "--load",
        str(tmp_path / "nothing-here"),
        *tok_flags,
    ]
    from_file = train([*base, "--data-args-path", str(blend)])
    from_flag = train([*base, "--data-path", "0.3", prefix, "0.7", prefix])
    assert from_file.losses == from_flag.losses and len(from_file.losses) == 3
    assert "no checkpoint in" in capsys.readouterr().out


def test_checkpoint_loads_in_other_tools_without_flags(tmp_path, mock_argv) -> None:
    """`mg.core.checkpoint.load_model` (what mg-eval/mg-serve use) rebuilds the trained model."""
    from mg.core.checkpoint import load_model
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    ckpt = tmp_path / "ckpt"
    trainer = Trainer(parse_args(mock_argv(tmp_path, "--save", str(ckpt), iters=3)))
    trainer.train()
    model, config, tokenizer_config, _ = load_model(ckpt)
    assert config == trainer.model_config
    assert tokenizer_config.tokenizer_type == "NullTokenizer"
    tokens = torch.randint(0, 127, (2, 16))
    trainer.model.eval()
    with torch.no_grad():
        assert torch.equal(model(tokens), trainer.model(tokens))
