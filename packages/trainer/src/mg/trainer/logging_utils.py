"""Megatron's log lines, throughput and MFU, tensorboard and (optional) wandb.

The training line is Megatron's `training_log` string, field for field, with one
addition after the throughput: `MFU: x% |` (model FLOPs utilisation against the
device's dense bf16 peak; on a CPU against an estimate for the run's precision, see
:mod:`.cpu_peak`) or
`MFU: n/a |` where the peak is unknown. Small throughputs get more digits than
Megatron's one decimal, so a CPU run does not read "0.0".
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

import torch

from mg.trainer.cpu_peak import estimate_cpu_peak

# Dense bf16 peak TFLOP/s per device, from the vendors' data sheets (no sparsity).
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10": 125.0,
}


def device_peak_tflops(device: torch.device, *, bf16: bool = False) -> float | None:
    """Peak bf16 TFLOP/s of a GPU (a CPU's estimate for bf16 or FP32 math), or None when
    unknown."""
    if device.type == "cpu":
        peak = estimate_cpu_peak(torch.get_num_threads(), bf16=bf16)
        return peak.tflops if peak is not None else None
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name:
            return value
    return None


def training_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    elapsed_ms: float,
    throughput: float,
    mfu: float | None,
    learning_rate: float,
    global_batch_size: int,
    losses: dict[str, float],
    loss_scale: float,
    grad_norm: float | None,
    skipped: int,
    nan_iterations: int,
    num_zeros: int | None = None,
    params_norm: float | None = None,
    now: datetime | None = None,
) -> str:
    """Megatron's training log line (`num_zeros`, `params_norm`: --log-num-zeros-in-grad,
    --log-params-norm)."""
    stamp = (now or datetime.now()).strftime("%Y-%m-%d %H:%M:%S")
    s = f" [{stamp}]"
    s += f" iteration {iteration:8d}/{train_iters:8d} |"
    s += f" consumed samples: {consumed_samples:12d} |"
    s += f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
    s += f" throughput per GPU (TFLOP/s/GPU): {_digits(throughput)} |"
    s += f" MFU: {_digits(mfu * 100)}% |" if mfu is not None else " MFU: n/a |"
    s += f" learning rate: {learning_rate:.6E} |"
    s += f" global batch size: {global_batch_size:5d} |"
    for key, value in losses.items():
        s += f" {key}: {value:.6E} |"
    s += f" loss scale: {loss_scale:.1f} |"
    if grad_norm is not None:
        s += f" grad norm: {grad_norm:.3f} |"
    if num_zeros is not None:
        s += f" num zeros: {num_zeros} |"
    if params_norm is not None:
        s += f" params norm: {params_norm:.3f} |"
    s += f" number of skipped iterations: {skipped:3d} |"
    s += f" number of nan iterations: {nan_iterations:3d} |"
    return s


def _digits(value: float) -> str:
    """Megatron's one decimal for 10 and more; enough digits to be non-zero below."""
    if value >= 10 or value == 0:
        return f"{value:.1f}"
    return f"{value:.3f}" if value >= 0.01 else f"{value:.5f}"


def perplexity(loss: float) -> float:
    """Megatron clamps the exponent at 20."""
    return math.exp(min(20.0, loss))


def validation_log_line(
    prefix: str, losses: dict[str, float], samples: tuple[int, int, int] | None = None
) -> str:
    """` validation loss at iteration N | lm loss value: ... | lm loss PPL: ... |`, then
    which validation samples were scored, `(first, end, built)`: each validation takes
    the next --eval-iters x --global-batch-size samples, so its loss differs from
    mg-eval ppl's on other samples of the split (mg-eval's line names its samples too)."""
    s = f" validation loss at {prefix} | "
    for key, value in losses.items():
        s += f"{key} value: {value:.6E} | {key} PPL: {perplexity(value):.6E} | "
    if samples is not None:
        first, end, built = samples
        s += f"samples: {first}-{end - 1} of the {built} built from the validation split | "
    return s


class MetricsWriter:
    """Tensorboard (`--tensorboard-dir`) and wandb (`--wandb-project`) on rank 0; else no-op."""

    def __init__(
        self,
        tensorboard_dir: str | None,
        wandb_project: str | None,
        wandb_exp_name: str | None = None,
        wandb_save_dir: str | None = None,
        config: dict[str, Any] | None = None,
        enabled: bool = True,
    ) -> None:
        self.tb = None
        self.wandb = None
        if not enabled:
            return
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter  # lazy: tensorboard is optional

            self.tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
        if wandb_project:
            try:
                import wandb  # lazy: wandb is optional
            except ImportError as error:
                raise RuntimeError(
                    "--wandb-project needs the wandb package: pip install wandb "
                    "(or drop --wandb-project)"
                ) from error
            wandb.init(
                project=wandb_project, name=wandb_exp_name, dir=wandb_save_dir, config=config
            )
            self.wandb = wandb

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.tb is not None:
            for name, value in values.items():
                self.tb.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
