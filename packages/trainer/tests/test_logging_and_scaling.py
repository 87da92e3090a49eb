"""Megatron's log lines (format checked by regex) and fp16 dynamic loss scaling."""

from __future__ import annotations

import re
from datetime import datetime

import torch

from mg.trainer.logging_utils import device_peak_tflops, training_log_line, validation_log_line
from mg.trainer.loss_scaler import DynamicLossScaler, unscale_and_check

NUM = r"[-+]?\d+\.\d+E[-+]\d+"
LINE = re.compile(
    r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration +\d+/ +\d+ \|"
    r" consumed samples: +\d+ \|"
    r" elapsed time per iteration \(ms\): \d+\.\d \|"
    r" throughput per GPU \(TFLOP/s/GPU\): \d+\.\d+ \|"
    r" MFU: (\d+\.\d+%|n/a) \|"
    rf" learning rate: {NUM} \|"
    r" global batch size: +\d+ \|"
    rf" lm loss: {NUM} \|"
    r" loss scale: \d+\.\d \|"
    r" grad norm: \d+\.\d{3} \|"
    r" number of skipped iterations: +\d+ \|"
    r" number of nan iterations: +\d+ \|$"
)


def test_training_line_is_megatrons() -> None:
    line = training_log_line(
        iteration=100,
        train_iters=1000,
        consumed_samples=12800,
        elapsed_ms=512.345,
        throughput=401.23,
        mfu=0.4056,
        learning_rate=1.5e-4,
        global_batch_size=128,
        losses={"lm loss": 4.312345},
        loss_scale=1.0,
        grad_norm=0.8731,
        skipped=0,
        nan_iterations=0,
        now=datetime(2026, 11, 22, 10, 0, 0),
    )
    assert LINE.match(line), line
    assert line == (
        " [2026-11-22 10:00:00] iteration      100/    1000 | consumed samples:        12800 |"
        " elapsed time per iteration (ms): 512.3 | throughput per GPU (TFLOP/s/GPU): 401.2 |"
        " MFU: 40.6% | learning rate: 1.500000E-04 | global batch size:   128 |"
        " lm loss: 4.312345E+00 | loss scale: 1.0 | grad norm: 0.873 |"
        " number of skipped iterations:   0 | number of nan iterations:   0 |"
    )


def test_printed_lines_from_a_run(tmp_path, mock_argv, train, capsys) -> None:
    train(
        mock_argv(
            tmp_path, "--log-interval", "2", "--eval-interval", "4", "--eval-iters", "1", iters=4
        )
    )
    out = capsys.readouterr().out.splitlines()
    first = [x for x in out if "first iteration done" in x]
    assert len(first) == 1, out  # the first iteration's line, before the first log interval
    lines = [x for x in out if "iteration" in x and "consumed samples" in x and x not in first]
    assert len(lines) == 2 and all(LINE.match(x) for x in lines), lines
    # CPU: MFU against an FP32 peak estimate, and the throughput with non-zero digits
    assert "MFU: n/a |" not in lines[0] and "(TFLOP/s/GPU): 0.0 |" not in lines[0], lines[0]
    assert device_peak_tflops(torch.device("cpu")) > 0
    assert any(x.startswith(" CPU peak estimate for MFU:") for x in out)
    valid = [x for x in out if x.startswith(" validation loss at")]
    assert len(valid) == 1
    assert re.match(
        rf"^ validation loss at iteration 4 \| lm loss value: {NUM} \| lm loss PPL: {NUM} \| "
        r"samples: 0-\d+ of the \d+ built from the validation split \| $",
        valid[0],
    )


def test_validation_line_ppl() -> None:
    line = validation_log_line("iteration 10", {"lm loss": 2.0})
    assert (
        line == " validation loss at iteration 10 | lm loss value: 2.000000E+00 | "
        "lm loss PPL: 7.389056E+00 | "
    )


def test_dynamic_loss_scaler_hysteresis_and_growth() -> None:
    s = DynamicLossScaler(initial_scale=2.0**32, min_scale=1.0, growth_interval=3, hysteresis=2)
    s.update(found_inf=True)
    assert s.scale == 2.0**32  # first overflow absorbed by hysteresis
    s.update(found_inf=True)
    assert s.scale == 2.0**31
    s.update(found_inf=True)
    assert s.scale == 2.0**30  # hysteresis stays spent until a growth
    for _ in range(3):
        s.update(found_inf=False)
    assert s.scale == 2.0**31
    s.update(found_inf=True)
    assert s.scale == 2.0**31  # hysteresis restored by the growth
    tiny = DynamicLossScaler(initial_scale=2.0, min_scale=1.0, growth_interval=100, hysteresis=1)
    for _ in range(5):
        tiny.update(found_inf=True)
    assert tiny.scale == 1.0


def test_unscale_detects_overflow() -> None:
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([4.0, 8.0, 2.0])
    assert not unscale_and_check([p], 2.0)
    assert p.grad.tolist() == [2.0, 4.0, 1.0]
    p.grad = torch.tensor([1.0, float("inf"), 0.0])
    assert unscale_and_check([p], 1.0)


def test_fp16_overflow_skips_and_counts(tmp_path, mock_argv, train) -> None:
    # 2**126 overflows fp16 gradients at once: with hysteresis 1 each skip halves the scale
    result = train(
        mock_argv(
            tmp_path,
            "--fp16",
            "--initial-loss-scale",
            str(2.0**126),
            "--hysteresis",
            "1",
            mbs=2,
            gbs=2,
            iters=4,
        )
    )
    assert result.state.skipped_iterations == 4
    assert all(g != g for g in result.grad_norms)  # no norm on skipped steps (NaN)


def test_bf16_nan_gradient_skips_the_step_without_a_scan(tmp_path, mock_argv) -> None:
    """Without fp16 loss scaling there is no per-gradient inf/NaN scan (as in Megatron);
    a NaN gradient shows as a NaN grad norm and the step is skipped, weights untouched."""
    from mg.trainer.arguments import parse_args
    from mg.trainer.training import Trainer

    trainer = Trainer(parse_args(mock_argv(tmp_path, "--bf16", mbs=2, gbs=2), world_size=1))
    weight = trainer.model.decoder.final_layernorm.weight
    with torch.no_grad():
        weight[0] = float("nan")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    loss, grad_norm, skipped, _ = trainer.train_step()
    assert skipped and grad_norm is None and loss != loss
    for name, p in trainer.model.named_parameters():
        assert torch.equal(p.detach(), before[name]) or p is weight, name
