"""Megatron's logging flags: what is printed and where metrics go."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class LoggingArgs:
    """What is printed and where metrics go."""

    log_interval: int = 100
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    log_throughput: bool = False
    logging_level: int | None = None
    log_validation_ppl_to_tensorboard: bool = False
    enable_experimental: bool = False
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_timers_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False


def add_logging_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--log-interval", type=int, default=100, help="Print every N iterations.")
    p.add_argument("--tensorboard-dir", help="Write tensorboard scalars here.")
    p.add_argument("--wandb-project", help="Log to Weights & Biases (needs wandb installed).")
    p.add_argument("--wandb-exp-name", help="wandb run name.")
    p.add_argument("--wandb-save-dir", help="wandb local folder.")
    p.add_argument(
        "--log-throughput",
        action="store_true",
        help="Megatron prints TFLOP/s per GPU only with this flag; mg-train always prints it "
        "(and MFU) on the log line and to tensorboard/wandb.",
    )
    p.add_argument(
        "--log-validation-ppl-to-tensorboard",
        action="store_true",
        help="Megatron writes the validation perplexity to tensorboard only with this flag; "
        "mg-train always writes it ('lm loss validation ppl').",
    )
    p.add_argument(
        "--log-params-norm",
        action="store_true",
        help="Compute the L2 norm of all parameters after each step (every parameter once "
        "over the tensor, pipeline, expert and data-parallel ranks): 'params norm' on the "
        "log line, 'params-norm' in tensorboard/wandb.",
    )
    p.add_argument(
        "--log-num-zeros-in-grad",
        action="store_true",
        help="Count the zero elements of the gradients the optimizer steps with (unscaled "
        "and clipped, every element once over the ranks): 'num zeros' on the log line, "
        "'num-zeros' in tensorboard/wandb.",
    )
    p.add_argument(
        "--log-timers-to-tensorboard",
        action="store_true",
        help="Write the step's timers at each log line as '<name>-time' (seconds per "
        "iteration, the slowest rank's): forward-backward (the micro-batches' forward and "
        "backward) and optimizer (from the end of backward to the end of the step: the "
        "gradient reduction, unscaling, clipping and the update).",
    )
    p.add_argument(
        "--log-memory-to-tensorboard",
        action="store_true",
        help="Write memory figures every iteration: on GPU torch.cuda.memory_stats()'s "
        "mem-reserved-bytes, mem-allocated-bytes, mem-max-allocated-bytes and "
        "mem-allocated-count (as Megatron); on CPU the process's resident memory, "
        "mem-rss-bytes, and its peak, mem-max-rss-bytes.",
    )
    p.add_argument(
        "--enable-experimental",
        action="store_true",
        help="Megatron's switch for its experimental features; mg-train has none behind it "
        "(every feature it has is on by its own flag), so it changes nothing and says so.",
    )
    p.add_argument(
        "--logging-level",
        type=int,
        help="Python logging level of the run (10 debug, 20 info, 30 warning, ...), as "
        "Megatron's flag sets it: the libraries' log records at or above it are shown.",
    )


def check_logging(args: Args) -> None:
    """Metric sinks whose package is missing are refused up front, not at the first log."""
    if args.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        fail("--wandb-project needs the wandb package: pip install wandb (or drop the flag)")
    if args.logging.enable_experimental:
        print(
            "mg-train: --enable-experimental: mg-train keeps no features behind it (each is on "
            "by its own flag); nothing changes",
            file=sys.stderr,
        )
