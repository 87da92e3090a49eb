"""--deterministic-mode as Megatron's (megatron/training/determinism.py): NCCL_ALGO,
NVTE_ALLOW_NONDETERMINISTIC_ALGO and CUBLAS_WORKSPACE_CONFIG set before the process
group exists, a non-deterministic value the user set refused by the variable's name,
and the flags Megatron refuses with it refused naming both."""

from __future__ import annotations

import os

import pytest

from mg.trainer import stages
from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.cli import main
from mg.trainer.deterministic import ENV_DEFAULTS, apply_determinism_env

VARIABLES = (*ENV_DEFAULTS, "MAMBA_DETERMINISTIC")


@pytest.fixture
def clean_env(monkeypatch):
    """The determinism variables unset (and restored after the test)."""
    for name in VARIABLES:
        monkeypatch.setenv(name, "unset-by-the-test")
        monkeypatch.delenv(name)
    return monkeypatch


def test_unset_variables_get_megatrons_values() -> None:
    env: dict[str, str] = {}
    apply_determinism_env(env)
    assert env == {
        "NCCL_ALGO": "Ring",
        "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    }


def test_deterministic_values_the_user_set_are_kept() -> None:
    env = {
        "NCCL_ALGO": "Ring,CollnetDirect",
        "CUBLAS_WORKSPACE_CONFIG": ":16:8",
        "MAMBA_DETERMINISTIC": "1",
    }
    apply_determinism_env(env)
    assert env["NCCL_ALGO"] == "Ring,CollnetDirect"
    assert env["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    assert env["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] == "0"


@pytest.mark.parametrize(
    "name, value",
    [
        ("NCCL_ALGO", "Tree"),
        ("NCCL_ALGO", "Ring,NVLS"),
        ("NCCL_ALGO", ""),
        ("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1"),
        ("CUBLAS_WORKSPACE_CONFIG", ":0:0"),
        ("MAMBA_DETERMINISTIC", "0"),
    ],
)
def test_a_contradicting_value_is_refused_by_name(name: str, value: str) -> None:
    env = {name: value}
    with pytest.raises(ArgumentError) as err:
        apply_determinism_env(env)
    message = str(err.value)
    assert message.startswith(f"{name}={value} in the environment") and "\n" not in message
    assert "--deterministic-mode" in message
    assert env == {name: value}, "nothing is set when a value is refused"


def test_training_sets_the_variables_before_the_process_group(
    tmp_path, mock_argv, train, clean_env
) -> None:
    """NCCL reads NCCL_ALGO when the communicator is made (init_process_group with a
    device id): the variables are in the environment when init_distributed runs."""
    seen: dict[str, str | None] = {}
    init = stages.distributed.init_distributed

    def spy(*args, **kwargs):
        seen.update({name: os.environ.get(name) for name in ENV_DEFAULTS})
        return init(*args, **kwargs)

    clean_env.setattr(stages.distributed, "init_distributed", spy)
    result = train(mock_argv(tmp_path, "--deterministic-mode", iters=3))
    assert len(result.losses) == 3
    assert seen == ENV_DEFAULTS
    assert {name: os.environ[name] for name in ENV_DEFAULTS} == ENV_DEFAULTS


def test_mg_train_refuses_a_contradicting_variable_in_one_line(
    tmp_path, mock_argv, clean_env, capsys
) -> None:
    clean_env.setenv("NCCL_ALGO", "Tree")
    assert main(mock_argv(tmp_path, "--deterministic-mode", iters=3)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mg-train: error: NCCL_ALGO=Tree "), err


def test_without_the_flag_the_environment_is_left_alone(
    tmp_path, mock_argv, train, clean_env
) -> None:
    clean_env.setenv("NCCL_ALGO", "Tree")
    train(mock_argv(tmp_path, iters=3))
    assert os.environ["NCCL_ALGO"] == "Tree"
    assert "NVTE_ALLOW_NONDETERMINISTIC_ALGO" not in os.environ


@pytest.mark.parametrize(
    "flag", ["--cross-entropy-loss-fusion", "--use-flash-attn"], ids=lambda f: f[2:]
)
def test_megatrons_refused_flags_are_refused_naming_both(mock_argv, tmp_path, flag) -> None:
    with pytest.raises(ArgumentError) as err:
        parse_args(mock_argv(tmp_path, "--deterministic-mode", flag))
    message = str(err.value)
    assert "--deterministic-mode" in message and flag in message and "\n" not in message
