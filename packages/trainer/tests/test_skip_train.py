"""`--skip-train`: load, one validation pass from the validation set's start, no step, no save."""

from __future__ import annotations

from pathlib import Path

import pytest

from mg.trainer.cli import main

EVAL = ["--eval-iters", "2", "--eval-interval", "4"]


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*")}


def test_skip_train_evaluates_the_loaded_model_and_saves_nothing(
    tmp_path: Path, mock_argv, train, capsys
) -> None:
    ckpt = tmp_path / "ckpt"
    trained = train(mock_argv(tmp_path, *EVAL, "--save", str(ckpt), iters=4))
    assert [i for i, _ in trained.validation] == [4]
    before = _files(ckpt)
    capsys.readouterr()

    evaluated = train(mock_argv(tmp_path, *EVAL, "--load", str(ckpt), "--skip-train", iters=4))
    out = capsys.readouterr().out
    assert evaluated.losses == [] and evaluated.exit_reason == "--skip-train"
    # the same samples as the training run's validation at iteration 4 (its first pass)
    [(at, loss)] = evaluated.validation
    assert at == 4 and loss == pytest.approx(trained.validation[0][1], rel=1e-6)
    assert "skipping training (--skip-train) at iteration 4" in out
    assert "iteration 4 on validation set" in out
    assert _files(ckpt) == before


def test_skip_train_without_a_validation_set_is_one_line(tmp_path: Path, mock_argv, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:  # the tiny runs' --eval-iters 0
        main(["gpt", *mock_argv(tmp_path, "--skip-train")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--skip-train" in err and "Traceback" not in err
