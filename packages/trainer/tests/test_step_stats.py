"""Megatron's optional logging flags: --log-params-norm, --log-num-zeros-in-grad,
--log-timers-to-tensorboard and --log-memory-to-tensorboard (one process; the
multi-rank check is in test_step_stats_parallel.py)."""

from __future__ import annotations

from datetime import datetime

import torch
from torch import nn

from mg.core.parallel.layout import ParallelLayout
from mg.trainer.logging_utils import training_log_line
from mg.trainer.memory_stats import memory_scalars
from mg.trainer.param_stats import num_zeros_in_grads, params_l2_norm

FLAGS = [
    "--log-params-norm",
    "--log-num-zeros-in-grad",
    "--log-timers-to-tensorboard",
    "--log-memory-to-tensorboard",
]


def test_flags_log_line_and_tensorboard(tmp_path, mock_argv, train, capsys) -> None:
    """The params norm is torch's norm over the model's parameters after each step, the
    zeros a count over its gradients; the log line and tensorboard carry them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    seen: list[tuple[float, float, int, int]] = []

    def check(trainer) -> None:
        params = list(trainer.model.parameters())
        norm = torch.linalg.vector_norm(torch.stack([p.detach().norm() for p in params]))
        zeros = sum(int((p.grad == 0).sum()) for p in params if p.grad is not None)
        seen.append((trainer.stats.params_norm, float(norm), trainer.stats.num_zeros, zeros))

    tb = tmp_path / "tb"
    argv = mock_argv(tmp_path, *FLAGS, "--tensorboard-dir", str(tb), "--log-interval", "2", iters=4)
    train(argv, on_iteration=check)
    assert len(seen) == 4
    for ours, reference, zeros, hand in seen:
        assert abs(ours - reference) <= 1e-6 * reference
        assert zeros == hand
    line = [s for s in capsys.readouterr().out.splitlines() if "iteration        4/" in s][0]
    assert f" num zeros: {seen[-1][2]} | params norm: {seen[-1][0]:.3f} |" in line

    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "params-norm",
        "num-zeros",
        "forward-backward-time",
        "optimizer-time",
        "mem-rss-bytes",
        "mem-max-rss-bytes",
    } <= tags
    assert [e.step for e in events.Scalars("params-norm")] == [1, 2, 3, 4]
    assert [e.value for e in events.Scalars("params-norm")] == [
        torch.tensor(s[0], dtype=torch.float32).item() for s in seen
    ]
    assert [e.step for e in events.Scalars("forward-backward-time")] == [2, 4]
    assert all(e.value > 0 for e in events.Scalars("optimizer-time"))
    rss = events.Scalars("mem-rss-bytes")[-1].value
    assert 0 < rss <= events.Scalars("mem-max-rss-bytes")[-1].value


def test_flags_off_write_nothing(tmp_path, mock_argv, train) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = tmp_path / "tb"
    result = train(mock_argv(tmp_path, "--tensorboard-dir", str(tb), iters=3))
    assert len(result.losses) == 3
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert not tags & {"params-norm", "num-zeros", "forward-backward-time", "mem-rss-bytes"}


def test_num_zeros_is_a_hand_count_over_trained_gradients() -> None:
    """Frozen parameters (no gradient) are left out; unused embedding rows and gradients
    zeroed by hand are counted."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 3), nn.Linear(3, 2))
    model[2].weight.requires_grad_(False)  # frozen: no gradient, not counted
    model(torch.tensor([1, 2, 3])).sum().backward()
    model[1].bias.grad[0] = 0.0
    # 7 unused embedding rows x 4 + the zeroed bias element
    assert num_zeros_in_grads(model, None, ParallelLayout()) == 7 * 4 + 1
    every = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert abs(params_l2_norm(model, None, ParallelLayout()) - float(every.norm())) < 1e-6


def test_log_line_fields_in_megatron_order() -> None:
    line = training_log_line(
        iteration=2,
        train_iters=4,
        consumed_samples=16,
        elapsed_ms=1.0,
        throughput=1.0,
        mfu=None,
        learning_rate=1e-3,
        global_batch_size=8,
        losses={"lm loss": 1.0},
        loss_scale=1.0,
        grad_norm=0.5,
        skipped=0,
        nan_iterations=0,
        num_zeros=12,
        params_norm=3.14159,
        now=datetime(2026, 1, 1),
    )
    assert "| grad norm: 0.500 | num zeros: 12 | params norm: 3.142 | number of skipped" in line


def test_memory_on_cpu_is_the_resident_set() -> None:
    figures = memory_scalars(torch.device("cpu"))
    assert set(figures) == {"mem-rss-bytes", "mem-max-rss-bytes"}
    assert 0 < figures["mem-rss-bytes"] <= figures["mem-max-rss-bytes"]


def test_memory_on_gpu_is_megatrons_four(monkeypatch) -> None:
    stats = {
        "reserved_bytes.all.current": 4096,
        "allocated_bytes.all.current": 1024,
        "allocated_bytes.all.peak": 2048,
        "allocation.all.current": 7,
    }
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: stats)
    assert memory_scalars(torch.device("cuda", 0)) == {
        "mem-reserved-bytes": 4096,
        "mem-allocated-bytes": 1024,
        "mem-max-allocated-bytes": 2048,
        "mem-allocated-count": 7,
    }
