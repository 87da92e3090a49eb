"""Flags into dataclasses, YAML with command-line overrides, and refusals before heavy work."""

from __future__ import annotations

import pytest

from mg.trainer.arguments import ArgumentError, parse_args

BASE = [
    "gpt",
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--lr",
    "1e-3",
    "--train-iters",
    "10",
    "--mock-data",
]


def test_flags_land_in_typed_groups() -> None:
    args = parse_args([*BASE, "--global-batch-size", "8", "--bf16"])
    assert args.model.hidden_size == 64 and args.training.global_batch_size == 8
    assert args.training.bf16 and args.optimizer.optimizer == "adam"
    assert args.optimizer.weight_decay == 0.01 and args.optimizer.clip_grad == 1.0
    assert args.training.seed == 1234 and args.logging.log_interval == 100
    assert args.optimizer.initial_loss_scale == 2.0**32 and args.optimizer.hysteresis == 2
    # GBS defaults to MBS * DP, as in Megatron
    assert parse_args(BASE, world_size=4).training.global_batch_size == 8


def test_yaml_config_and_command_line_override(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        "num_layers: 3\nhidden-size: 128\nnum_attention_heads: 8\nseq_length: 64\n"
        "micro_batch_size: 4\nglobal_batch_size: 16\nlr: 3.0e-4\ntrain_iters: 100\n"
        "mock_data: true\nbf16: true\ndata_path: null\nrampup_batch_size: null\n"
    )
    args = parse_args(["gpt", "--config", str(config), "--hidden-size", "256", "--lr", "1e-3"])
    assert args.model.num_layers == 3
    assert args.model.hidden_size == 256  # the flag wins
    assert args.optimizer.lr == 1e-3
    assert args.training.global_batch_size == 16 and args.training.bf16


def test_yaml_unknown_key_is_named(tmp_path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("hiden_size: 64\n")
    with pytest.raises(ArgumentError, match="unknown key 'hiden_size'"):
        parse_args(["gpt", "--config", str(config)])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--hidden-size", "60", "--num-attention-heads", "7"],
            r"hidden size \(60\) is not divisible by the number of attention heads \(7\)",
        ),
        (
            ["--global-batch-size", "6", "--micro-batch-size", "4"],
            r"global batch size \(6\) is not divisible by micro batch size \(4\) times data "
            r"parallel size \(1\)",
        ),
        (
            ["--seq-length", "128", "--max-position-embeddings", "64"],
            r"sequence length \(128\) is longer than --max-position-embeddings \(64\)",
        ),
        (["--fp16", "--bf16"], "--fp16 and --bf16 cannot both be set"),
        (["--tensor-model-parallel-size", "2"], r"world size \(1\) is not divisible by tensor"),
        (["--overlap-param-gather"], "only works with --use-distributed-optimizer"),
        (["--use-flash-attn"], "^--use-flash-attn"),
        (
            ["--async-save", "--ckpt-format", "torch"],
            "--async-save needs --ckpt-format torch_dist",
        ),
        (
            ["--rampup-batch-size", "2", "2", "100"],
            "--rampup-batch-size needs --train-samples: no batch-size rampup for "
            "iteration-based training",
        ),
        (["--train-samples", "100"], "exactly one of --train-iters and --train-samples"),
        (["--lr-warmup-iters", "10"], r"warmup \(10 iters\) must be shorter than the decay"),
        (["--save-interval", "5"], "--save-interval needs --save"),
    ],
)
def test_inconsistent_flags_are_refused(extra: list[str], message: str) -> None:
    with pytest.raises(ArgumentError, match=message):
        parse_args([*BASE, *extra])


def test_sequence_parallel_without_tensor_parallel_is_turned_off(capsys) -> None:
    """Megatron's rule: with TP 1 sequence parallelism changes nothing but numerics, so
    validate_args switches it off with a warning (Megatron's example scripts pass it)."""
    args = parse_args([*BASE, "--sequence-parallel"])
    assert args.distributed.sequence_parallel is False
    assert "Disabling sequence parallelism" in capsys.readouterr().err


def test_global_batch_checked_against_data_parallel_size() -> None:
    with pytest.raises(ArgumentError, match=r"times data parallel size \(4\)"):
        parse_args([*BASE, "--global-batch-size", "12"], world_size=4)


def test_missing_files_are_named(tmp_path) -> None:
    no_mock = [a for a in BASE if a != "--mock-data"]
    missing = str(tmp_path / "nope" / "corpus_text_document")
    with pytest.raises(ArgumentError, match=f"{missing}.bin not found"):
        parse_args(
            [
                *no_mock,
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "10",
                "--data-path",
                missing,
            ]
        )
    vocab = str(tmp_path / "vocab.json")
    with pytest.raises(ArgumentError, match=f"--vocab-file {vocab}: file not found"):
        parse_args(
            [
                *no_mock,
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                vocab,
                "--data-path",
                missing,
            ]
        )
    with pytest.raises(ArgumentError, match="no data"):
        parse_args(no_mock)


def test_blend_file_prefixes_checked(tmp_path) -> None:
    blend = tmp_path / "blend.txt"
    blend.write_text(f"0.5 {tmp_path}/a_text_document\n0.5 {tmp_path}/b_text_document\n")
    no_mock = [a for a in BASE if a != "--mock-data"]
    with pytest.raises(ArgumentError, match="a_text_document.bin not found"):
        parse_args(
            [
                *no_mock,
                "--tokenizer-type",
                "NullTokenizer",
                "--vocab-size",
                "10",
                "--data-args-path",
                str(blend),
            ]
        )


def test_wandb_missing_is_explained(monkeypatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ArgumentError, match="--wandb-project needs the wandb package"):
        parse_args([*BASE, "--wandb-project", "demo"])


def test_train_samples_sets_iterations() -> None:
    from mg.trainer.batch_schedule import BatchSchedule, train_iterations

    no_iters = [a for a in BASE if a not in ("--train-iters", "10")]
    args = parse_args([*no_iters, "--global-batch-size", "8", "--train-samples", "100"])
    assert train_iterations(args, BatchSchedule(8, 2, 1)) == 12  # 100 // 8, as Megatron
