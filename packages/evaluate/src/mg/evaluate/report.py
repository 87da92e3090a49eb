"""Results printed as Megatron prints them, and appended to a JSON-lines report.

The printed line is Megatron's ``evaluate_and_print_results`` format (so logs
compare line by line); the report holds the full-precision numbers plus what
was evaluated, one JSON object per run.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


def megatron_line(task: str, metrics: dict[str, Any]) -> str:
    """`` validation results on TASK | avg loss: ... |`` framed by dashes, like Megatron."""
    text = f" validation results on {task} | "
    if "adjusted_ppl" in metrics:
        text += f"avg loss: {metrics['avg_loss']:.4E} | "
        text += f"ppl: {metrics['ppl']:.4E} | "
        text += f"adjusted ppl: {metrics['adjusted_ppl']:.4E} | "
        text += f"token ratio: {metrics['token_ratio']} |"
    elif "accuracy" in metrics:
        text += f"number correct: {metrics['num_correct']:.4E} | "
        text += f"total examples: {metrics['num_examples']:.4E} | "
        text += f"avg accuracy: {metrics['accuracy']:.4E}"
    else:
        text += f"lm loss: {metrics['loss']:.6E} | lm loss PPL: {metrics['ppl']:.6E} | "
        if "split_samples" in metrics:
            text += _samples_field(metrics)
    rule = "-" * (len(text) + 1)
    return f"{rule}\n{text}\n{rule}"


def _samples_field(metrics: dict[str, Any]) -> str:
    """Which samples were scored: mg-train's validation line names its own, which are
    other samples (the next --eval-iters x --global-batch-size each time), hence
    another loss unless the samples are the same."""
    count, total, split = metrics["num_samples"], metrics["split_samples"], metrics["split"]
    which = "all of them" if count == total else f"the first {count}"
    return (
        f"samples: 0-{count - 1} of the {total} in one pass over the {split} split ({which}; "
        "mg-train's validation line names the samples it scored) | "
    )


def write_report(path: str | Path, task: str, metrics: dict[str, Any], **context: Any) -> dict:
    """Append one record ``{"task", "metrics", ...context, "time"}`` to a JSON-lines file."""
    record = {"task": task, **context, "metrics": metrics, "time": time.time()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(record, default=str) + "\n")
    return record
