"""mg-train with Megatron's MoE flags: parsed into core's config, refused when they cannot
apply, and a training run whose log line reports the balancing losses."""

from __future__ import annotations

import pytest

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.arguments_moe import parse_moe_layer_freq
from mg.trainer.families import gpt_config
from mg.trainer.moe_step import logged_losses

MOE = [
    "--swiglu",
    "--disable-bias-linear",
    "--num-experts",
    "4",
    "--moe-ffn-hidden-size",
    "16",
    "--moe-router-topk",
    "2",
    "--moe-aux-loss-coeff",
    "1e-2",
]


def test_flags_become_core_config_fields(tmp_path, mock_argv):
    argv = mock_argv(
        tmp_path,
        *MOE,
        "--moe-layer-freq",
        "[0]+[1]*1",
        "--moe-grouped-gemm",
        "--moe-z-loss-coeff",
        "1e-3",
        "--moe-token-dispatcher-type",
        "alltoall",
        "--moe-shared-expert-intermediate-size",
        "24",
        "--moe-shared-expert-gate",
        "--moe-expert-capacity-factor",
        "1.5",
        "--moe-token-drop-policy",
        "position",
    )
    config = gpt_config(parse_args(argv), 128)
    assert config.num_moe_experts == 4
    assert config.moe_layer_pattern == [False, True]
    assert config.moe_grouped_gemm and config.moe_shared_expert_gate
    assert config.moe_token_dispatcher_type == "alltoall"
    assert (config.moe_expert_capacity_factor, config.moe_token_drop_policy) == (1.5, "position")
    assert logged_losses(config) == ["load_balancing_loss", "z_loss"]
    dense = gpt_config(parse_args(mock_argv(tmp_path)), 128)
    assert dense.num_moe_experts is None and logged_losses(dense) == []


def test_moe_layer_freq_forms():
    assert parse_moe_layer_freq("2") == 2
    assert parse_moe_layer_freq("[0]+[1]*3") == [0, 1, 1, 1]
    with pytest.raises(Exception, match="0/1 list"):
        parse_moe_layer_freq("__import__('os')")


@pytest.mark.parametrize(
    ("extra", "world", "message"),
    [
        (["--moe-router-topk", "4"], 1, "--moe-router-topk needs --num-experts"),
        ([*MOE, "--moe-router-topk", "5"], 1, r"--moe-router-topk \(5\) must be between 1"),
        ([*MOE, "--expert-model-parallel-size", "3"], 1, "not divisible by"),
        ([*MOE, "--expert-model-parallel-size", "2"], 1, "must divide the 1 ranks"),
        ([*MOE, "--expert-model-parallel-size", "2"], 2, "does not shard experts"),
        ([*MOE, "--moe-pad-expert-input-to-capacity"], 1, "needs --moe-expert-capacity-factor"),
        ([*MOE, "--tensor-model-parallel-size", "2"], 2, "not supported yet"),
    ],
)
def test_bad_moe_flags_are_refused_in_one_line(tmp_path, mock_argv, extra, world, message):
    with pytest.raises(ArgumentError, match=message) as info:
        parse_args(mock_argv(tmp_path, *extra, gbs=4 * world), world_size=world)
    assert "\n" not in str(info.value)


def test_moe_flag_for_bert_is_refused(tmp_path, mock_argv):
    argv = ["bert", *mock_argv(tmp_path, *MOE)[1:]]
    with pytest.raises(ArgumentError, match="gpt family only"):
        parse_args(argv)


def test_moe_gpt_trains_and_logs_balancing_losses(tmp_path, mock_argv, train, capsys):
    argv = mock_argv(
        tmp_path,
        *MOE,
        "--moe-z-loss-coeff",
        "1e-3",
        "--log-interval",
        "5",
        iters=10,
    )
    result = train(argv)
    assert result.losses[-1] < result.losses[0]
    balance = result.extra_losses["load_balancing_loss"]
    # E·Σ f_i P_i is 1 for perfectly even routing and at least ~1 otherwise
    assert all(0.9 < value < 4.0 for value in balance)
    assert len(result.extra_losses["z_loss"]) == 10
    out = capsys.readouterr().out
    assert "load_balancing_loss:" in out and "z_loss:" in out


def test_expert_bias_moves_during_training(tmp_path, mock_argv):
    from mg.core.models.moe import TopKRouter
    from mg.trainer.training import Trainer

    argv = mock_argv(
        tmp_path,
        *MOE[:-2],
        "--moe-router-score-function",
        "sigmoid",
        "--moe-router-enable-expert-bias",
        "--moe-router-bias-update-rate",
        "0.01",
        iters=3,
    )
    trainer = Trainer(parse_args(argv))
    trainer.train()
    router = next(m for m in trainer.model.modules() if isinstance(m, TopKRouter))
    # three steps of ±0.01: every entry moved, by a multiple of the rate
    assert (router.expert_bias.abs() > 0.005).all()
    assert router.local_tokens_per_expert.sum() == 0
