"""bench/bench_gpu.py: skips cleanly without CUDA, trains Megatron's 1.3B shape, and its MFU is
Megatron's FLOPs formula (mg.core.models.flops) over the measured iteration time (CPU smoke run)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mg.core.models import TransformerConfig
from mg.core.models.flops import num_floating_point_operations, num_parameters

SCRIPT = Path(__file__).parents[1] / "bench" / "bench_gpu.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_cuda_it_says_so_and_exits_0() -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no CUDA device here" in done.stdout


def test_the_shape_is_megatrons_1p3b() -> None:
    from mg.trainer.arguments import parse_args
    from mg.trainer.families import gpt_config

    bench = _bench()
    args = parse_args(bench.train_argv(bench.SHAPE_1P3B, 8, 32, 20, ["--bf16"]))
    config = gpt_config(args, 50304)
    assert (config.num_layers, config.hidden_size, config.num_attention_heads) == (24, 2048, 16)
    assert args.model.seq_length == 2048 and args.training.bf16
    assert num_parameters(config) == pytest.approx(1.3e9, rel=0.02)
    # Megatron's formula by hand: 12·B·s·L·h²·(1 + 1 + s/2h + F/h) + 6·B·s·h·V
    b, s, L, h, V = 32, 2048, 24, 2048, 50304
    by_hand = 12 * b * s * L * h**2 * (1 + 1 + s / (2 * h) + 4) + 6 * b * s * h * V
    assert num_floating_point_operations(config, b, s) == pytest.approx(by_hand, rel=1e-12)


def test_cpu_smoke_run_reports_megatrons_mfu(tmp_path) -> None:
    bench = _bench()
    out = tmp_path / "smoke.md"
    argv = ["--device", "cpu", "--iters", "4", "--warmup", "1", "--micro-batch-size", "2"]
    assert bench.main([*argv, "--accumulation", "2", "--output", str(out)]) == 0
    record = json.loads(out.with_suffix(".json").read_text())
    assert len(record["seconds"]) == 4 and len(record["losses"]) == 4
    config = TransformerConfig.from_dict(record["config"])
    flops = num_floating_point_operations(config, 4, 64)  # GBS 2 x 2, sequence 64
    rows = bench.per_iteration(record)
    for row, seconds in zip(rows, record["seconds"], strict=True):
        assert row["tflops_per_gpu"] == pytest.approx(flops / (seconds * 1e12))
        if record["peak_tflops"]:
            assert row["mfu"] == pytest.approx(flops / (seconds * 1e12) / record["peak_tflops"])
    text = out.read_text()
    median = sorted(r["mfu"] for r in rows[1:])[1]
    if record["peak_tflops"]:
        assert f"| {median:.1%} |" in text
    assert "| fp32 (cpu smoke) | 1 | 2 | 4 |" in text


@pytest.mark.slow
def test_runs_go_through_torchrun(tmp_path) -> None:
    """The launch path of the GPU runs (torchrun, one worker writing the record), on CPU,
    with the FSDP2 run's flags (the others' are tested by the trainer's own tests)."""
    bench = _bench()
    argv = bench.train_argv(bench.SHAPE_SMOKE, 2, 2, 2, bench.VARIANTS["bf16 + FSDP2"])
    record = bench.launch(argv, 1, tmp_path)
    assert record["world_size"] == 1 and len(record["seconds"]) == 2
    assert record["config"]["num_layers"] == 2
    assert record["config"]["untie_embeddings_and_output_weights"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_one_short_gpu_run(tmp_path) -> None:
    bench = _bench()
    out = tmp_path / "gpu.md"
    argv = ["--iters", "3", "--warmup", "1", "--micro-batch-size", "1", "--accumulation", "1"]
    assert bench.main([*argv, "--runs", "bf16", "--gpus", "1", "--output", str(out)]) == 0
    assert "| bf16 | 1 | 1 | 1 |" in out.read_text()
