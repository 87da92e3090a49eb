"""`--use-checkpoint-args`: the model config (and tokenizer) come from `--load`."""

from __future__ import annotations

import pytest

from mg.core.checkpoint import save_model
from mg.core.checkpoint.torch_format import save_checkpoint_shards
from mg.core.models import GPTModel, TransformerConfig
from mg.core.tokenizers import TokenizerConfig
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.families import gpt_config

TRAIN = ["--micro-batch-size", "2", "--lr", "1e-3", "--train-iters", "3", "--mock-data"]


def _config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=256,
        seq_length=64,
        max_position_embeddings=128,
        position_embedding_type="rope",
        rope_scaling={"factor": 8.0, "original_max_position_embeddings": 64},
        window_size=(15, 0),
        normalization="RMSNorm",
        activation="gelu_tanh",
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
    )


@pytest.fixture
def ckpt(tmp_path):
    config = _config()
    save_model(
        tmp_path / "ckpt",
        GPTModel(config),
        config,
        TokenizerConfig("NullTokenizer", vocab_size=200),
    )
    return str(tmp_path / "ckpt"), config


def test_config_taken_whole_from_checkpoint(ckpt) -> None:
    load, saved = ckpt
    args = parse_args(["gpt", "--use-checkpoint-args", "--load", load, *TRAIN])
    config = gpt_config(args, 999)  # the padded vocab is the checkpoint's, not recomputed
    assert config.to_dict() == saved.to_dict()
    assert config.activation == "gelu_tanh" and config.window_size == (15, 0)
    assert config.rope_scaling == saved.rope_scaling
    assert args.model.num_layers == 2 and args.model.seq_length == 64
    assert args.model.group_query_attention and args.model.num_query_groups == 2
    assert args.data.tokenizer_type == "NullTokenizer" and args.data.vocab_size == 200


def test_training_knobs_from_the_command_line_win(ckpt) -> None:
    load, _ = ckpt
    argv = ["gpt", "--use-checkpoint-args", "--load", load, *TRAIN, "--seq-length", "16"]
    argv += ["--hidden-dropout", "0.2", "--num-layers", "2", "--recompute-activations"]
    args = parse_args(argv)
    config = gpt_config(args, 256)
    assert config.seq_length == 16 and config.hidden_dropout == 0.2
    assert config.attention_dropout == 0.0 and config.activation == "gelu_tanh"
    assert args.model.recompute_granularity == "selective"


def test_tokenizer_flags_replace_the_checkpoint_tokenizer(ckpt) -> None:
    load, _ = ckpt
    argv = ["gpt", "--use-checkpoint-args", "--load", load, *TRAIN]
    args = parse_args([*argv, "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])
    assert args.data.vocab_size == 100 and args.checkpoint_tokenizer_config is None


def test_disagreeing_shape_flag_is_refused(ckpt) -> None:
    load, _ = ckpt
    with pytest.raises(ArgumentError, match=r"--hidden-size 64 disagrees .*\(32\)"):
        parse_args(["gpt", "--use-checkpoint-args", "--load", load, *TRAIN, "--hidden-size", "64"])
    with pytest.raises(ArgumentError, match=r"--swiglu True disagrees .*\(False\)"):
        parse_args(["gpt", "--use-checkpoint-args", "--load", load, *TRAIN, "--swiglu"])


def test_checkpoint_without_mg_metadata(tmp_path) -> None:
    state = {"model": {}, "args": {}, "iteration": 0, "checkpoint_version": 3.0}
    save_checkpoint_shards(tmp_path / "old", "release", {(0, 0): state})
    with pytest.raises(ArgumentError, match="records no model config.*Pass the model flags"):
        parse_args(["gpt", "--use-checkpoint-args", "--load", str(tmp_path / "old"), *TRAIN])


def test_use_checkpoint_args_needs_load() -> None:
    with pytest.raises(ArgumentError, match="needs --load"):
        parse_args(["gpt", "--use-checkpoint-args", *TRAIN])


def test_finetune_without_model_flags_suggests_use_checkpoint_args(ckpt) -> None:
    load, _ = ckpt
    with pytest.raises(ArgumentError, match="missing required.*--use-checkpoint-args"):
        parse_args(["gpt", "--finetune", "--load", load, *TRAIN])


def test_config_from_a_torch_dist_checkpoint_the_trainer_wrote(tmp_path, mock_argv, train) -> None:
    """The default format (torch_dist) keeps the config in common.pt: finetune needs no flags."""
    from mg.core.checkpoint import describe

    ckpt = str(tmp_path / "ckpt")
    train(mock_argv(tmp_path, "--save", ckpt, iters=4))
    args = parse_args(["gpt", "--use-checkpoint-args", "--load", ckpt, "--finetune", *TRAIN])
    saved = describe(ckpt).model_config
    assert args.checkpoint_model_config == saved
    assert args.model.hidden_size == saved["hidden_size"] == 32
    assert args.model.num_layers == saved["num_layers"]
    tuned = train(["gpt", "--use-checkpoint-args", "--load", ckpt, "--finetune", *TRAIN])
    assert tuned.state.iteration == 3
