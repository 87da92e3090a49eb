"""--moe-use-upcycling: an MoE model started from a dense checkpoint computes the dense
model's function, mg-train saves it to --save and trains on from it, and what cannot be
upcycled is refused in one line naming the flag (exit status 2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mg.core.models import GPTModel, presets
from mg.trainer.cli import main
from mg.trainer.upcycling import copy_dense_into_moe

DENSE = ["--swiglu", "--disable-bias-linear", "--ffn-hidden-size", "64"]
DENSE += ["--attention-dropout", "0", "--hidden-dropout", "0"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2"]


@pytest.mark.parametrize(
    "moe",
    [
        {"num_moe_experts": 4, "moe_router_topk": 2},
        {"num_moe_experts": 8, "moe_router_topk": 3, "moe_grouped_gemm": True},
        {"num_moe_experts": 4, "moe_router_topk": 2, "moe_router_score_function": "sigmoid"},
    ],
    ids=["softmax-top2", "grouped-top3", "sigmoid-top2"],
)
@pytest.mark.parametrize("gelu_bias", [False, True], ids=["swiglu", "gelu-bias"])
def test_upcycled_model_computes_the_dense_function(moe, gelu_bias):
    """Experts copied from the dense MLP, the router freshly initialised: with top-k
    weights that sum to one (softmax over the top-k; sigmoid scores are normalised over
    the top-k when k > 1) the logits equal the dense model's within 1e-6. The first layer
    stays dense."""
    shape = {"activation": "gelu", "add_bias_linear": True} if gelu_bias else {}
    dense_cfg = presets.tiny_llama(num_layers=3, **shape)
    torch.manual_seed(0)
    dense = GPTModel(dense_cfg)
    moe_cfg = dataclasses.replace(dense_cfg, moe_layer_freq=[0, 1, 1], **moe)
    torch.manual_seed(1)
    upcycled = GPTModel(moe_cfg)
    kept = copy_dense_into_moe(upcycled, dense)
    assert kept and all(".router." in name for name in kept)
    ids = torch.randint(0, dense_cfg.vocab_size, (2, 16))
    with torch.no_grad():
        want, got = dense(ids), upcycled(ids)
    assert (got - want).abs().max() <= 1e-6 * want.abs().max()


def _fails(argv: list[str], capsys, *needles: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_mg_train_upcycles_a_dense_checkpoint_saves_and_trains(tmp_path, mock_argv, train, capsys):
    """A dense run saved at iteration 2; the upcycled run reads it, saves the MoE model to
    --save as iteration 1 (Megatron's numbering) with the dense run's consumed samples, and
    its first loss equals the dense run's third (same weights, same batch) within 1e-6.
    Resuming the upcycled checkpoint (no optimizer state, as in Megatron) without the flag
    and with --no-load-optim gives the same losses bitwise; the
    refusals need these checkpoints, so they are checked here too."""
    from mg.core.checkpoint import describe

    dense_ckpt, moe_ckpt = str(tmp_path / "dense"), str(tmp_path / "moe")
    straight = train(
        mock_argv(tmp_path, *DENSE, "--save", dense_ckpt, "--save-interval", "2", iters=3)
    )
    upcycle = [*DENSE, *MOE, "--moe-use-upcycling", "--load", dense_ckpt, "--ckpt-step", "2"]
    upcycle += ["--save", moe_ckpt]
    upcycled = train(mock_argv(tmp_path, *upcycle, iters=5))
    assert len(upcycled.losses) == 4  # iterations 2..5
    assert upcycled.losses[0] == pytest.approx(straight.losses[2], rel=1e-6, abs=0)
    assert all(0.9 < v < 4.0 for v in upcycled.extra_losses["load_balancing_loss"])
    first = describe(moe_ckpt, 1)
    assert first.model_config["num_moe_experts"] == 4
    # iteration 1 holds no optimizer state (as in Megatron): resumed with --no-load-optim
    resume = [*DENSE, *MOE, "--load", moe_ckpt, "--ckpt-step", "1", "--no-load-optim"]
    resumed = train(mock_argv(tmp_path, *resume, iters=4))
    assert resumed.losses == upcycled.losses[:3]

    capsys.readouterr()
    again = mock_argv(tmp_path, *upcycle)
    _fails(again, capsys, "--moe-use-upcycling", "already holds a checkpoint")
    from_moe = [*DENSE, *MOE, "--moe-use-upcycling", "--load", moe_ckpt, "--save"]
    _fails(mock_argv(tmp_path, *from_moe, str(tmp_path / "x")), capsys, "already an MoE")
    too_far = [*upcycle[:-1], str(tmp_path / "w"), "--ckpt-step", "7"]
    _fails(mock_argv(tmp_path, *too_far), capsys, "--moe-use-upcycling: --load")
    empty = tmp_path / "empty"
    empty.mkdir()
    no_ckpt = [*DENSE, *MOE, "--moe-use-upcycling", "--load", str(empty), "--save"]
    _fails(mock_argv(tmp_path, *no_ckpt, str(tmp_path / "y")), capsys, "no checkpoint in --load")
    args = [*upcycle[:-1], str(tmp_path / "z"), "--use-checkpoint-args"]
    _fails(mock_argv(tmp_path, *args), capsys, "--moe-use-upcycling with --use-checkpoint-args")


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--save", "s"], "--moe-use-upcycling needs --load"),
        (["--load", "l"], "--moe-use-upcycling needs --save"),
        (
            ["--load", "l", "--save", "s", "--moe-upcycling-granularity", "2"],
            "--moe-upcycling-granularity 2: mg-train upcycles with granularity 1 only",
        ),
        (
            ["--load", "l", "--save", "s", "--moe-ffn-hidden-size", "16"],
            "--moe-ffn-hidden-size (16) must equal --ffn-hidden-size (64)",
        ),
    ],
)
def test_bad_upcycling_flags_exit_2_naming_the_flag(tmp_path, mock_argv, capsys, extra, needle):
    _fails(mock_argv(tmp_path, *DENSE, *MOE, "--moe-use-upcycling", *extra), capsys, needle)


def test_upcycling_flags_need_their_partners(tmp_path, mock_argv, capsys):
    _fails(mock_argv(tmp_path, "--moe-use-upcycling"), capsys, "--moe-use-upcycling needs --num")
    granular = mock_argv(tmp_path, *MOE, "--moe-upcycling-granularity", "2")
    _fails(granular, capsys, "--moe-upcycling-granularity needs --moe-use-upcycling")
