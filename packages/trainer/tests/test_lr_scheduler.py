"""Learning rate at chosen steps for each of the five styles, against numbers worked by hand.

Schedule used below (in samples): init 0, max 1.0, min 0.1, warmup 10, decay 110.
"""

from __future__ import annotations

import math

import pytest

from mg.trainer.arguments import parse_args
from mg.trainer.lr_scheduler import OptimizerParamScheduler, build_scheduler


def lr_at(style: str, step: int, **kwargs) -> float:
    sched = OptimizerParamScheduler(
        None,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=10,
        lr_decay_steps=110,
        lr_decay_style=style,
        **kwargs,
    )
    return sched.step(step)


@pytest.mark.parametrize(
    ("style", "step", "expected", "extra"),
    [
        # warmup: 0 + (1 - 0) * 5 / 10
        ("linear", 5, 0.5, {}),
        ("cosine", 10, 1.0, {}),
        ("constant", 50, 1.0, {}),
        ("constant", 500, 1.0, {}),
        # linear: r = (60 - 10) / 100 = 0.5 -> 0.1 + 0.5 * 0.9
        ("linear", 60, 0.55, {}),
        ("linear", 110, 0.1, {}),
        ("linear", 200, 0.1, {}),
        # cosine: r = 0.25 -> coeff = (cos(pi/4) + 1) / 2 = 0.8535534; 0.1 + 0.9 * coeff
        ("cosine", 35, 0.8681981, {}),
        ("cosine", 60, 0.55, {}),
        # inverse square root: 1.0 * sqrt(10) / sqrt(40) = 0.5; sqrt(10/100) = 0.3162278
        ("inverse-square-root", 40, 0.5, {}),
        ("inverse-square-root", 100, 0.3162278, {}),
        # WSD, last 20 samples anneal (start at 90): stable 1.0 before;
        # exponential at ratio 0.5: coeff = 2 * 0.5**0.5 - 1 = 0.4142136 -> 0.4727922
        ("WSD", 80, 1.0, {"wsd_decay_steps": 20}),
        ("WSD", 100, 0.4727922, {"wsd_decay_steps": 20}),
        ("WSD", 100, 0.55, {"wsd_decay_steps": 20, "lr_wsd_decay_style": "linear"}),
        ("WSD", 110, 0.1, {"wsd_decay_steps": 20}),
    ],
)
def test_schedule_values(style: str, step: int, expected: float, extra: dict) -> None:
    assert lr_at(style, step, **extra) == pytest.approx(expected, abs=1e-7)


def _argv(*extra: str) -> list[str]:
    return [
        "gpt",
        "--num-layers",
        "1",
        "--hidden-size",
        "8",
        "--num-attention-heads",
        "2",
        "--seq-length",
        "8",
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "8",
        "--lr",
        "1.0",
        "--min-lr",
        "0.1",
        "--mock-data",
        *extra,
    ]


def test_flags_count_in_samples_and_fraction_wins() -> None:
    args = parse_args(
        _argv(
            "--train-iters",
            "100",
            "--lr-warmup-fraction",
            "0.1",
            "--lr-warmup-iters",
            "50",
            "--lr-decay-style",
            "cosine",
        )
    )
    sched = build_scheduler(args, None, 100)
    assert sched.lr_decay_steps == 800  # 100 iterations * 8 samples
    assert sched.lr_warmup_steps == 80  # the fraction wins over --lr-warmup-iters
    assert sched.step(8) == pytest.approx(0.1)  # after iteration 1: 8 / 80 of the peak
    sched.step(440 - 8)  # r = (440 - 80) / 720 = 0.5
    assert sched.get_lr() == pytest.approx(0.55)


def test_sample_based_flags_and_wsd() -> None:
    args = parse_args(
        _argv(
            "--train-samples",
            "800",
            "--lr-warmup-samples",
            "80",
            "--lr-decay-style",
            "WSD",
            "--lr-wsd-decay-samples",
            "100",
            "--lr-wsd-decay-style",
            "cosine",
        )
    )
    sched = build_scheduler(args, None, 100)
    assert (sched.lr_decay_steps, sched.lr_warmup_steps, sched.wsd_decay_steps) == (800, 80, 100)
    sched.step(750)  # anneal starts at 700; ratio 0.5 -> coeff (cos(pi/2) + 1) / 2 = 0.5
    assert sched.get_lr() == pytest.approx(0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1))


def test_state_round_trip() -> None:
    sched = OptimizerParamScheduler(
        None,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=10,
        lr_decay_steps=110,
        lr_decay_style="linear",
    )
    sched.step(60)
    other = OptimizerParamScheduler(
        None,
        init_lr=0.0,
        max_lr=1.0,
        min_lr=0.1,
        lr_warmup_steps=10,
        lr_decay_steps=110,
        lr_decay_style="linear",
    )
    other.load_state_dict(sched.state_dict())
    assert other.get_lr() == sched.get_lr() == pytest.approx(0.55)
