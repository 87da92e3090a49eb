"""Dropout in tensor-parallel regions: a per-rank stream, replayed by activation recompute.

One process: `RNGStream.fork()` leaves the default stream untouched, and
recompute (checkpoint_context) gives the masks of the original forward. Two
gloo ranks, TP=2 with sequence parallelism and dropout 0.5: the ranks' streams
differ while the default stream stays equal, dropout draws from the stream, and
full recompute gives the same loss and gradients as no recompute.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mg.core.models import GPTModel, apply_activation_recompute, presets
from mg.core.models.rng_stream import (
    RNGStream,
    checkpoint_context,
    model_parallel_stream,
    set_model_parallel_stream,
)
from mg.core.parallel.mesh import ParallelDims
from mg.core.parallel.tensor_parallel import apply_tensor_parallel
from mg.core.testing.launch import launch_workers


def test_fork_leaves_the_default_stream_alone() -> None:
    torch.manual_seed(0)
    expected = torch.rand(3), torch.rand(3)
    torch.manual_seed(0)
    stream = RNGStream(5, torch.device("cpu"))
    first = torch.rand(3)
    with stream.fork():
        inside = torch.rand(3)
    assert torch.equal(first, expected[0]) and torch.equal(torch.rand(3), expected[1])
    assert torch.equal(inside, torch.rand(3, generator=torch.Generator().manual_seed(5)))


def test_recompute_replays_the_stream() -> None:
    stream = RNGStream(11, torch.device("cpu"))
    set_model_parallel_stream(stream)
    try:

        def block(x: torch.Tensor) -> torch.Tensor:
            with stream.fork():
                return F.dropout(x, 0.5) * x

        x = torch.randn(64, requires_grad=True)
        start = stream.state.clone()
        block(x).sum().backward()
        plain = x.grad.clone()
        x.grad = None
        stream.state = start.clone()
        checkpoint(block, x, use_reentrant=False, context_fn=checkpoint_context).sum().backward()
        assert torch.equal(x.grad, plain)
        x.grad = None
        stream.state = start.clone()  # without the replay the recomputed mask differs
        checkpoint(block, x, use_reentrant=False).sum().backward()
        assert not torch.equal(x.grad, plain)
    finally:
        set_model_parallel_stream(None)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = ParallelDims.from_world(2, tp=2).build_mesh()
    config = presets.tiny_gpt2(
        hidden_size=32, seq_length=16, attention_dropout=0.5, hidden_dropout=0.5
    )
    torch.manual_seed(0)
    base = GPTModel(config)
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    default_start = torch.get_rng_state()
    report: dict = {}
    results = []
    for recompute in (False, True):  # each apply seeds a fresh stream alike
        model = copy.deepcopy(base)
        apply_tensor_parallel(model, mesh["tp"], sequence_parallel=True, seed=1234)
        if recompute:
            apply_activation_recompute(model, "full", "uniform", 1)
        stream = model_parallel_stream()
        start = stream.state.clone()
        torch.set_rng_state(default_start)
        model.train()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        loss.backward()
        grads = [_full(p.grad) for p in model.parameters() if p.grad is not None]
        results.append((float(loss), grads))
        report["stream_moved"] = not torch.equal(stream.state, start)
    with stream.fork():
        report["stream_draw"] = torch.rand(4).tolist()
    report["default_draw"] = torch.rand(4).tolist()
    report["loss"] = [results[0][0], results[1][0]]
    report["grad_diff"] = max(
        float((a - b).abs().max()) for a, b in zip(results[0][1], results[1][1], strict=True)
    )
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("rng")
    launch_workers(__file__, 2, [str(out)], timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_tensor_parallel_dropout_streams_differ_per_rank(reports) -> None:
    assert reports[0]["stream_draw"] != reports[1]["stream_draw"]
    assert reports[0]["default_draw"] == reports[1]["default_draw"]
    assert all(r["stream_moved"] for r in reports)  # dropout drew from the stream


def test_recompute_with_tensor_parallel_dropout_matches(reports) -> None:
    for r in reports:
        plain, recomputed = r["loss"]
        assert recomputed == pytest.approx(plain, rel=1e-6)
        assert r["grad_diff"] < 1e-6


if __name__ == "__main__":
    _worker(sys.argv[1])
