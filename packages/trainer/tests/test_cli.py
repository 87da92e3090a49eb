"""`mg-train` as a command: usage errors exit 2 before anything heavy."""

from __future__ import annotations

import subprocess
import sys

from mg.trainer.cli import main


def test_bad_flags_exit_2_with_message(tmp_path, mock_argv, capsys) -> None:
    argv = mock_argv(tmp_path, "--hidden-size", "30")
    assert main(argv) == 2
    assert "hidden size (30) is not divisible by the number of attention heads (4)" in (
        capsys.readouterr().err
    )


def test_help_explains_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mg.trainer.cli", "gpt", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Samples per optimizer step" in out
    assert "--overlap-grad-reduce" in out


def test_cli_trains(tmp_path, mock_argv, capsys) -> None:
    assert main(mock_argv(tmp_path, "--log-interval", "3", iters=3)) == 0
    assert "iteration        3/       3 |" in capsys.readouterr().out


def test_logging_level_sets_the_run_s_python_logging(tmp_path, mock_argv, monkeypatch) -> None:
    """Megatron's --logging-level: the root logger's level for the run."""
    import logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    assert main([*mock_argv(tmp_path, iters=4), "--logging-level", "10", "--dry-run"]) == 0
    assert root.level == logging.DEBUG
