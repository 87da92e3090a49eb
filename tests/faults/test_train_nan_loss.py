"""A NaN loss stops the run with one line naming the iteration, as Megatron's default
`--check-for-nan-in-loss-and-grad` does; `--no-check-for-nan-in-loss-and-grad` goes on
and counts such iterations (what mg-train did before, for every run)."""

from __future__ import annotations

import math

import pytest
from fault_helpers import exit_code, train_argv


@pytest.fixture
def nan_at_second_iteration(monkeypatch):
    from mg.trainer.training import Trainer

    real = Trainer.train_step
    calls = []

    def train_step(self, *args, **kwargs):
        loss, grad_norm, skipped, gbs = real(self, *args, **kwargs)
        calls.append(loss)
        return (math.nan if len(calls) == 2 else loss), grad_norm, skipped, gbs

    monkeypatch.setattr(Trainer, "train_step", train_step)
    return calls


def test_nan_loss_stops_the_run_in_one_line(tmp_path, capsys, nan_at_second_iteration):
    from mg.trainer.cli import main

    argv = train_argv(tmp_path / "cache", iters=4)
    capsys.readouterr()
    assert exit_code(lambda: main(argv)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mg-train: error: iteration 2: the loss is nan"), line
    assert "--no-check-for-nan-in-loss-and-grad" in line
    assert len(nan_at_second_iteration) == 2  # nothing ran after it


def test_without_the_check_the_run_goes_on(tmp_path, capsys, nan_at_second_iteration):
    from mg.trainer.cli import main

    argv = [*train_argv(tmp_path / "cache", iters=4), "--no-check-for-nan-in-loss-and-grad"]
    assert exit_code(lambda: main(argv)) == 0
    assert len(nan_at_second_iteration) == 4
