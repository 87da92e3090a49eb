"""bench/bench_vlm.py at tiny shapes: both sides built with the same weights (logits
checked equal), every pair timed, and the results table written with ratios."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).parents[1] / "bench" / "bench_vlm.py"
TINY = [
    "--vision-layers", "1", "--vision-hidden", "32", "--vision-heads", "2", "--img", "16",
    "--patch", "8", "--images", "2", "--layers", "1", "--hidden", "32", "--heads", "2",
    "--vocab", "128", "--seq", "12", "--repeats", "1", "--tower-repeats", "1", "--warmup", "0",
    "--threads", "1", "--fused-ce",
]  # fmt: skip


@pytest.mark.slow
def test_a_tiny_run_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "vlm.md"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    text = out.read_text()
    assert "logits equal" in text and "ISA " in text and "1 threads on every side" in text
    assert "Command: `python bench/bench_vlm.py --vision-layers 1" in text
    tower = [line for line in text.splitlines() if line.startswith(("| fp32 |", "| bf16 |"))]
    # the tower's two rows, then two of ours (plain, fused CE) per dtype for training
    assert len(tower) == 6, text
    assert all(line.count("x |") == 1 for line in tower), text  # one ratio per row
    assert "Load average at the end" in text


def test_bad_flags_are_refused_by_name() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--img", "30", "--patch", "16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "--img 30 is not a multiple of --patch 16" in done.stderr
