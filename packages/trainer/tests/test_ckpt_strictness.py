"""`--dist-ckpt-strictness` (Megatron-Core's StrictHandling) on a torch_dist load whose model
has tensors the checkpoint lacks (`--qk-layernorm`'s norms: "unexpected" in Megatron's
words) or lacks tensors the checkpoint has ("missing")."""

from __future__ import annotations

import pytest

from mg.core.checkpoint.layout import CheckpointError
from mg.trainer.arguments import ArgumentError, parse_args

FLAGS = ["--attention-dropout", "0", "--hidden-dropout", "0"]
FINETUNE = ["--finetune", "--no-load-optim", "--no-load-rng"]


def test_strictness_values(tmp_path, mock_argv, train, capsys) -> None:
    argv = mock_argv(tmp_path, *FLAGS, mbs=2, gbs=2, iters=3)
    plain, normed = str(tmp_path / "plain"), str(tmp_path / "normed")
    train([*argv, "--save", plain, "--save-interval", "3"])
    train([*argv, "--qk-layernorm", "--save", normed, "--save-interval", "3"])

    def load(ckpt: str, strictness: str, *more: str):
        return train(
            [*argv, *more, "--load", ckpt, *FINETUNE, "--dist-ckpt-strictness", strictness]
        )

    # the model's q/k norms are not in `plain`
    with pytest.raises(Exception, match="q_layernorm"):
        load(plain, "assume_ok_unexpected", "--qk-layernorm")
    with pytest.raises(CheckpointError, match="raise_unexpected: the model's .*q_layernorm"):
        load(plain, "raise_unexpected", "--qk-layernorm")
    capsys.readouterr()
    logged = load(plain, "log_unexpected", "--qk-layernorm")
    assert "kept as initialised" in capsys.readouterr().err
    ignored = load(plain, "ignore_all", "--qk-layernorm")
    assert "kept as initialised" not in capsys.readouterr().err
    assert logged.losses == ignored.losses
    # `normed` holds norms this model does not have: only raise_all minds
    with pytest.raises(CheckpointError, match="raise_all: the checkpoint's .*q_layernorm"):
        load(normed, "raise_all")
    load(normed, "log_all")
    assert "in the checkpoint, not in the model" in capsys.readouterr().err
    assert load(normed, "raise_unexpected").losses == load(normed, "assume_ok_unexpected").losses


def test_return_values_are_refused_by_name(tmp_path, mock_argv) -> None:
    argv = mock_argv(tmp_path, "--dist-ckpt-strictness", "return_all")
    with pytest.raises(ArgumentError, match="--dist-ckpt-strictness return_all: .* use log_all"):
        parse_args(argv)
