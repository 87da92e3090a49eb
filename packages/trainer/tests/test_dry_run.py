"""mg-train --dry-run: the numbers a real run would have, printed without building the model."""

from __future__ import annotations

import re

import pytest
import torch

from mg.trainer.arguments import parse_args
from mg.trainer.cli import main
from mg.trainer.dry_run import estimate
from mg.trainer.training import Trainer

GPT3_175B = [
    "gpt",
    "--dry-run",
    "--num-layers",
    "96",
    "--hidden-size",
    "12288",
    "--num-attention-heads",
    "96",
    "--seq-length",
    "2048",
    "--max-position-embeddings",
    "2048",
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1536",
    "--train-iters",
    "100",
    "--lr",
    "6e-5",
    "--mock-data",
    "--vocab-size",
    "50257",
    "--tensor-model-parallel-size",
    "8",
    "--pipeline-model-parallel-size",
    "16",
    "--sequence-parallel",
    "--use-distributed-optimizer",
    "--bf16",
    "--recompute-activations",
]


def _value(pattern: str, text: str) -> float:
    match = re.search(pattern, text)
    assert match, (pattern, text)
    return float(match.group(1))


def test_gpt3_175b_plan(monkeypatch, capsys) -> None:
    """GPT-3 175B on 1536 GPUs (TP 8, PP 16, DP 12): ~1.46B parameters on the first stage
    (the published ~1.4B per GPU: 175B / 128 model-parallel ranks, plus the embeddings)."""
    monkeypatch.setenv("WORLD_SIZE", "1536")
    assert main(GPT3_175B) == 0
    out = capsys.readouterr().out
    assert "world 1536 = TP 8 x PP 16 x DP 12" in out
    assert _value(r"number of parameters: ([\d.]+) B", out) == pytest.approx(174.6, abs=0.1)
    per_gpu = _value(r"most loaded GPU \(stage 0\): ([\d.]+) B", out)
    assert 1.35 < per_gpu < 1.5
    # fp32 weights and grads, distributed AdamW over 12 ranks: 4 + 4 + 8/12 bytes/parameter.
    assert _value(r"optimizer state\s+([\d.]+)", out) == pytest.approx(8 / 12, abs=0.01)
    assert _value(r"weights\s+[\d.]+\s+([\d.]+)", out) == pytest.approx(
        per_gpu * 1e9 * 4 / 2**30, rel=1e-3
    )
    assert "theoretical memory footprints" in out


def test_layout_errors_exit_2(monkeypatch, capsys) -> None:
    monkeypatch.setenv("WORLD_SIZE", "100")
    assert main(GPT3_175B) == 2
    assert "not divisible by tensor x pipeline x context" in capsys.readouterr().err


def test_dry_run_matches_a_real_cpu_run(tmp_path, mock_argv) -> None:
    """Parameter count and optimizer-state bytes of a real (three-iteration) CPU run equal
    the dry run's, exactly (AdamW: two fp32 moments per parameter)."""
    check_dry_run_against_real_run(tmp_path, mock_argv)


def check_dry_run_against_real_run(tmp_path, mock_argv, *flags: str) -> None:
    args = parse_args(mock_argv(tmp_path, *flags, mbs=2, gbs=2, iters=3))
    trainer = Trainer(args)
    trainer.train()
    planned = estimate(args, trainer.model_config).stages[0]
    numel = sum(p.numel() for p in trainer.model.parameters())
    assert planned.parameters == numel
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # distributed: wrapped
    state_bytes = sum(
        v.numel() * v.element_size()
        for entry in inner.state.values()
        for v in entry.values()
        if isinstance(v, torch.Tensor) and v.dim() > 0
    )
    assert state_bytes == planned.optimizer_state == 8 * numel


@pytest.mark.parametrize(
    ("etp", "routing"),
    [
        ("4", "each TP rank routes the whole sequence"),
        ("2", "each group of 2 TP ranks routes its sequence slices together"),
        ("1", "each TP rank routes its own sequence slice"),
    ],
)
def test_moe_plan_says_which_tokens_a_router_sees(tmp_path, mock_argv, etp, routing) -> None:
    """TP = 4 + SP: the expert tensor-parallel size decides what each rank routes."""
    from mg.trainer.dry_run import report

    moe = ["--swiglu", "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--dry-run"]
    moe += ["--tensor-model-parallel-size", "4", "--sequence-parallel"]
    moe += ["--expert-tensor-parallel-size", etp, "--expert-model-parallel-size", "2"]
    text = report(parse_args(mock_argv(tmp_path, *moe, gbs=16), world_size=8))
    ep_line = f"EP 2 x expert TP {etp} x expert DP {8 // (2 * int(etp))}, 2 experts per GPU"
    assert f"{ep_line}; {routing}\n" in text
