"""Regenerate golden/gpt_tiny_mock.json: the first 50 losses of a tiny GPT on CPU.

    cd /work/main && uv run --frozen python packages/trainer/tests/golden/make_golden.py

Only regenerate on purpose (a deliberate numerical change), and say why in the commit.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch

from mg.trainer.arguments import parse_args
from mg.trainer.training import Trainer

HERE = Path(__file__).parent
ARGV = [
    "gpt",
    "--num-layers",
    "2",
    "--hidden-size",
    "32",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "32",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--min-lr",
    "1e-4",
    "--lr-decay-style",
    "cosine",
    "--lr-warmup-iters",
    "5",
    "--train-iters",
    "50",
    "--seed",
    "1234",
    "--mock-data",
    "--vocab-size",
    "127",
    "--log-interval",
    "10",
    "--eval-iters",
    "0",
    "--deterministic-mode",
]


def run(cache_dir: str) -> list[float]:
    return Trainer(parse_args([*ARGV, "--data-cache-path", cache_dir])).train().losses


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as cache:
        losses = run(cache)
    record = {
        "how": "mg-train gpt with `argv` (+ --data-cache-path TMP) on CPU, fp32, one process, "
        "by packages/trainer/tests/golden/make_golden.py",
        "command": "uv run --frozen python packages/trainer/tests/golden/make_golden.py",
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "argv": ARGV,
        "lm_loss": losses,
    }
    (HERE / "gpt_tiny_mock.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {len(losses)} losses, first {losses[0]:.6f}, last {losses[-1]:.6f}")
