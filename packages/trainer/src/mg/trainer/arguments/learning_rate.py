"""Megatron's learning-rate, regularisation and mixed-precision flags: the optimizer's knobs.

Megatron splits these over its "learning rate", "regularization" and "mixed
precision" groups; they fill one `OptimizerArgs`, the object `optimizer.py`,
`lr_scheduler.py` and the loss scaler read.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class OptimizerArgs:
    """Optimizer, learning-rate schedule, clipping and fp16 loss scaling."""

    optimizer: str = "adam"
    lr: float | None = None
    min_lr: float = 0.0
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_fraction: float | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


def add_learning_rate_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"], help="adam is AdamW.")
    p.add_argument("--lr", type=float, help="Peak learning rate.")
    p.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor after decay.")
    p.add_argument(
        "--decoupled-lr",
        type=float,
        help="Peak learning rate of the input embedding and the output layer (their own "
        "optimizer group, on the same schedule).",
    )
    p.add_argument(
        "--decoupled-min-lr",
        type=float,
        help="Learning rate floor of the --decoupled-lr group; default --min-lr.",
    )
    p.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        help="Shape of the learning rate after warmup.",
    )
    p.add_argument("--lr-decay-iters", type=int, help="Decay over N iterations (default all).")
    p.add_argument("--lr-decay-samples", type=int, help="Decay over N samples.")
    p.add_argument("--lr-warmup-fraction", type=float, help="Warmup as a fraction of decay (wins).")
    p.add_argument("--lr-warmup-iters", type=int, default=0, help="Warmup iterations.")
    p.add_argument("--lr-warmup-samples", type=int, default=0, help="Warmup samples.")
    p.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at step 0.")
    p.add_argument(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="Shape of WSD's final decay.",
    )
    p.add_argument("--lr-wsd-decay-iters", type=int, help="Length of WSD's decay, iterations.")
    p.add_argument("--lr-wsd-decay-samples", type=int, help="Length of WSD's decay, samples.")
    p.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled weight decay.")
    p.add_argument(
        "--clip-grad", type=float, default=1.0, help="Clip the global grad norm (0: no clip)."
    )
    p.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    p.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    p.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    p.add_argument("--loss-scale", type=float, help="Static fp16 loss scale (else dynamic).")
    p.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="Dynamic scale start.")
    p.add_argument("--min-loss-scale", type=float, default=1.0, help="Dynamic scale floor.")
    p.add_argument(
        "--loss-scale-window", type=int, default=1000, help="Clean steps before doubling."
    )
    p.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before halving.")


REQUIRED = ("lr",)


def check_learning_rate(args: Args) -> None:
    """LR bounds, WSD's decay length, and warmup inside the decay (iters or samples, not both)."""
    o, t = args.optimizer, args.training
    if o.lr < 0 or o.min_lr < 0 or o.min_lr > o.lr:
        fail(f"need 0 <= --min-lr ({o.min_lr}) <= --lr ({o.lr})")
    if o.decoupled_lr is not None:
        floor = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        if o.decoupled_lr < 0 or floor < 0 or floor > o.decoupled_lr:
            fail(f"need 0 <= --decoupled-min-lr ({floor}) <= --decoupled-lr ({o.decoupled_lr})")
    if o.lr_decay_style == "WSD" and (
        o.lr_wsd_decay_iters is None and o.lr_wsd_decay_samples is None
    ):
        fail("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
    if t.train_iters is not None and (o.lr_decay_samples or o.lr_warmup_samples):
        fail("with --train-iters, give --lr-decay-iters/--lr-warmup-iters, not *-samples")
    if t.train_samples is not None and (o.lr_decay_iters or o.lr_warmup_iters):
        fail("with --train-samples, give --lr-decay-samples/--lr-warmup-samples, not *-iters")
    if t.train_iters is not None:
        decay, warmup_explicit, unit = o.lr_decay_iters or t.train_iters, o.lr_warmup_iters, "iters"
    else:
        decay, warmup_explicit, unit = (
            o.lr_decay_samples or t.train_samples,
            o.lr_warmup_samples,
            ("samples"),
        )
    warmup = o.lr_warmup_fraction * decay if o.lr_warmup_fraction is not None else warmup_explicit
    if decay <= 0 or warmup >= decay:
        fail(
            f"learning rate warmup ({warmup} {unit}) must be shorter than the decay "
            f"({decay} {unit}, --lr-decay-{unit} or the training length)"
        )
