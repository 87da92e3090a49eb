"""The first 50 losses of a tiny GPT match the stored golden curve (1e-5 relative)."""

from __future__ import annotations

import json
from pathlib import Path

from mg.trainer.arguments import parse_args
from mg.trainer.training import Trainer

GOLDEN = Path(__file__).parent / "golden" / "gpt_tiny_mock.json"


def test_tiny_gpt_matches_golden_curve(tmp_path) -> None:
    record = json.loads(GOLDEN.read_text())
    argv = [*record["argv"], "--data-cache-path", str(tmp_path / "cache")]
    losses = Trainer(parse_args(argv)).train().losses
    golden = record["lm_loss"]
    assert len(losses) == len(golden) == 50
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, golden, strict=True))
    assert worst <= 1e-5, f"largest relative difference {worst:.3e}"
    assert golden[-1] < golden[0] - 0.5  # the curve itself goes down
