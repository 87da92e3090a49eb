"""mg-train gpt with the Gemma 3 flags: parsed into core's config, refused by name where
they cannot apply, a run whose loss falls, and a resume equal to the straight run."""

from __future__ import annotations

import pytest

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.families import gpt_config

NO_DROPOUT = ["--attention-dropout", "0", "--hidden-dropout", "0"]
GEMMA3 = [
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--apply-layernorm-1p",
    "--qk-layernorm",
    "--disable-bias-linear",
    "--geglu",
    "--openai-gelu",
    "--sandwich-norms",
    "--scale-embeddings-by-sqrt-hidden",
    "--softmax-scale",
    "0.2",
    "--window-size",
    "7,0",  # seq 32: the sliding layers see 8 of the keys
    "--window-attn-skip-freq",
    "2",
    "--rotary-base",
    "1000000",
    "--rotary-base-local",
    "10000",
    "--rotary-seq-len-interpolation-factor",
    "2",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]


def test_gemma3_flags_become_core_config_fields(tmp_path, mock_argv):
    config = gpt_config(parse_args(mock_argv(tmp_path, *GEMMA3)), 128)
    assert config.activation == "geglu_tanh"
    assert config.window_size == (7, 0) and config.window_attn_skip_freq == 2
    assert [config.is_window_layer(i) for i in (1, 2)] == [True, False]
    assert (config.rotary_base, config.rotary_base_local) == (1e6, 1e4)
    assert config.rotary_seq_len_interpolation_factor == 2.0
    assert config.softmax_scale == 0.2 and config.attention_softmax_scale == 0.2
    assert config.sandwich_norms and config.scale_embeddings_by_sqrt_hidden
    plain = gpt_config(parse_args(mock_argv(tmp_path)), 128)
    assert plain.activation == "gelu" and plain.window_size is None and not plain.sandwich_norms
    list_form = ["--window-size", "7,0", "--window-attn-skip-freq", "[1]+[0]"]
    assert gpt_config(parse_args(mock_argv(tmp_path, *list_form)), 128).window_attn_skip_freq == [
        1,
        0,
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--window-attn-skip-freq", "2"], "--window-attn-skip-freq needs --window-size"),
        (["--window-size", "7,1"], "--window-size 7,1: a decoder"),
        (["--window-size", "7,0", "--window-attn-skip-freq", "[1]*3"], "one 0 or 1 per layer"),
        (["--rotary-base-local", "1e4"], "--rotary-base-local needs --window-size"),
        (["--geglu", "--swiglu"], "--geglu and --swiglu"),
        (["--softmax-scale", "-1"], "--softmax-scale -1.0: must be positive"),
        (
            ["--sandwich-norms", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
            "--sandwich-norms with --sequence-parallel",
        ),
        (
            ["--window-size", "7,0", "--context-parallel-size", "2", *NO_DROPOUT]
            + ["--transformer-impl", "transformer_engine"],
            "--window-size with --context-parallel-size 2 and --transformer-impl",
        ),
        (
            ["--attn-logit-softcapping", "50", "--attention-backend", "unfused"]
            + ["--transformer-impl", "transformer_engine"],
            "--attn-logit-softcapping needs --transformer-impl local",
        ),
        (
            ["--attn-logit-softcapping", "50", "--context-parallel-size", "2", *NO_DROPOUT],
            "--attn-logit-softcapping with --context-parallel-size 2",
        ),
    ],
)
def test_bad_gemma3_flags_are_refused_in_one_line(tmp_path, mock_argv, extra, message):
    world = 2 if {"--tensor-model-parallel-size", "--context-parallel-size"} & set(extra) else 1
    with pytest.raises(ArgumentError, match=message) as info:
        parse_args(mock_argv(tmp_path, *extra), world_size=world)
    assert "\n" not in str(info.value)


def test_gemma3_flag_for_bert_is_refused(tmp_path, mock_argv):
    argv = ["bert", *mock_argv(tmp_path, "--sandwich-norms")[1:]]
    with pytest.raises(ArgumentError, match="--sandwich-norms is supported for gpt, not bert"):
        parse_args(argv)


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
def test_gemma3_trains_and_resumes_bitwise(tmp_path, mock_argv, train, ckpt_format):
    """The post-norms and the config's new fields survive a save and load in both formats:
    4 + 4 iterations equal 8 straight."""
    flags = [*GEMMA3, "--ckpt-format", ckpt_format]
    straight = train(mock_argv(tmp_path, *flags, iters=8))
    assert straight.losses[-1] < straight.losses[0] - 0.05
    ckpt = str(tmp_path / "ckpt")
    first = train(mock_argv(tmp_path, *flags, "--save", ckpt, "--exit-interval", "4", iters=8))
    second = train(mock_argv(tmp_path, *flags, "--load", ckpt, iters=8))
    assert first.losses + second.losses == straight.losses  # bitwise


def test_gemma3_dry_run_matches_a_real_cpu_run(tmp_path, mock_argv):
    """The dry run counts the sandwich and q/k norms: its parameter count equals a real
    run's, and its FLOPs count the sliding layers' windows."""
    import dataclasses

    from mg.core.models.flops import num_floating_point_operations
    from mg.trainer.dry_run import estimate
    from mg.trainer.training import Trainer

    args = parse_args(mock_argv(tmp_path, *GEMMA3, mbs=2, gbs=2, iters=3))
    trainer = Trainer(args)
    trainer.train()
    planned = estimate(args, trainer.model_config).stages[0]
    assert planned.parameters == sum(p.numel() for p in trainer.model.parameters())
    config = trainer.model_config
    full = dataclasses.replace(
        config, window_size=None, window_attn_skip_freq=None, rotary_base_local=None
    )
    assert num_floating_point_operations(config, 2) < num_floating_point_operations(full, 2)


def test_gemma3_tensor_parallel_matches_one_process(tmp_path, mock_argv, train):
    """TP = 2 on two gloo ranks (post-norms, q/k norms and the embedding scale replicated,
    each rank's heads with their own window) equals one process to fp32 rounding."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "_gemma3_ddp", Path(__file__).with_name("test_ddp.py")
    )
    ddp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ddp)
    base = mock_argv(tmp_path, *GEMMA3, mbs=2, gbs=4, iters=6)
    tp2 = [*base, "--tensor-model-parallel-size", "2", "--make-vocab-size-divisible-by", "64"]
    (two,) = ddp.run_ranks([tp2], 2, tmp_path / "two.json")
    one = train([*base, "--make-vocab-size-divisible-by", "128"])
    assert two["losses"] == pytest.approx(one.losses, rel=1e-5)
    assert one.losses[-1] < one.losses[0]


def test_attention_logit_softcapping_flag_trains(tmp_path, mock_argv, train):
    """--attn-logit-softcapping reaches the model (a small cap changes the losses) and the
    run trains."""
    plain = train(mock_argv(tmp_path, *GEMMA3, iters=4))
    capped = train(mock_argv(tmp_path, *GEMMA3, "--attn-logit-softcapping", "0.5", iters=4))
    assert capped.losses != plain.losses
    assert capped.losses[-1] < capped.losses[0]
