"""Megatron's checkpointing flags: saving and resuming."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


ASSUME_OK = "assume_ok_unexpected"
STRICTNESS = (
    ASSUME_OK,
    "log_unexpected",
    "log_all",
    "raise_unexpected",
    "raise_all",
    "return_unexpected",
    "return_all",
    "ignore_all",
)
"""Megatron-Core's `StrictHandling` values (`--dist-ckpt-strictness`, `ckpt_strictness`)."""
SUPPORTED = tuple(s for s in STRICTNESS if not s.startswith("return_"))


@dataclass
class CheckpointArgs:
    """Saving and resuming (`torch_dist` by default, as in Megatron; `torch` on request)."""

    save: str | None = None
    load: str | None = None
    ckpt_step: int | None = None
    save_interval: int | None = None
    finetune: bool = False
    use_checkpoint_args: bool = False
    use_tokenizer_model_from_checkpoint_args: bool = True
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    ckpt_format: str = "torch_dist"
    async_save: bool = False
    perform_initialization: bool = True
    overwrite_checkpoints: bool = False
    exit_on_missing_checkpoint: bool = False
    auto_detect_ckpt_format: bool = False
    dist_ckpt_strictness: str = ASSUME_OK


def add_checkpointing_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--save", help="Checkpoint folder to write.")
    p.add_argument("--load", help="Checkpoint folder to resume from (latest iteration).")
    p.add_argument(
        "--ckpt-step",
        type=int,
        metavar="N",
        help="Load iteration N of --load (iter_000000N) instead of the one "
        "latest_checkpointed_iteration.txt names.",
    )
    p.add_argument("--save-interval", type=int, help="Save every N iterations.")
    p.add_argument(
        "--exit-on-missing-checkpoint",
        action="store_true",
        help="With --load: stop with an error when it holds no checkpoint, instead of "
        "training from scratch.",
    )
    p.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="Let this run's saves overwrite newer checkpoints already in --save (refused "
        "otherwise, e.g. when --load finds nothing but --save holds checkpoints).",
    )
    p.add_argument(
        "--finetune", action="store_true", help="Load the model only; restart at iteration 0."
    )
    p.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="Take the model config (and the tokenizer, unless tokenizer flags are given) from "
        "the checkpoint in --load; model-shape flags become optional and must agree with it.",
    )
    p.add_argument(
        "--no-use-tokenizer-model-from-checkpoint-args",
        dest="use_tokenizer_model_from_checkpoint_args",
        action="store_false",
        help="With --use-checkpoint-args, keep the tokenizer flags' tokenizer.",
    )
    p.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer state.")
    p.add_argument("--no-load-rng", action="store_true", help="Do not load RNG states.")
    p.add_argument("--no-save-optim", action="store_true", help="Do not save optimizer state.")
    p.add_argument("--no-save-rng", action="store_true", help="Do not save RNG states.")
    p.add_argument(
        "--ckpt-format",
        default="torch_dist",
        choices=["torch", "torch_dist", "fsdp_dtensor"],
        help="Checkpoint format: torch_dist (the default, as in Megatron: "
        "torch.distributed.checkpoint, saved in parallel and loadable into any TP/PP/DP "
        "layout), torch (one mp_rank_TT[_PPP]/model_optim_rng.pt file per model-parallel "
        "rank) or fsdp_dtensor (with FSDP: each rank writes its shards; loads at any data-"
        "parallel size, with or without FSDP). --load reads any, whatever --ckpt-format says.",
    )
    p.add_argument(
        "--auto-detect-ckpt-format",
        action="store_true",
        help="Megatron's: read --load in whatever format it was saved. mg-train always does "
        "(the flag is accepted for Megatron's scripts); --ckpt-format is what --save writes.",
    )
    p.add_argument(
        "--dist-ckpt-strictness",
        default=ASSUME_OK,
        choices=STRICTNESS,
        help="Megatron-Core's handling of model keys a torch_dist checkpoint lacks "
        "(unexpected) and checkpoint keys the model lacks (missing): assume_ok_unexpected "
        "fails on the first, log_unexpected / log_all / ignore_all load without them (kept "
        "as initialised) and print them / also the missing ones / nothing, raise_unexpected "
        "/ raise_all stop naming them; return_* are refused (no caller to return to).",
    )
    p.add_argument(
        "--no-initialization",
        action="store_false",
        dest="perform_initialization",
        help="Allocate the model without drawing initial weights (faster start-up when "
        "--load certainly holds a checkpoint; gpt).",
    )
    p.add_argument(
        "--async-save",
        action="store_true",
        help="torch_dist: write the checkpoint in the background while training goes on.",
    )


def check_initialization(args: Args) -> None:
    c = args.checkpoint
    if not c.perform_initialization and (args.family != "gpt" or not c.load):
        fail(
            "--no-initialization leaves the weights unset until a checkpoint fills them: it "
            "needs --load (and the gpt family); drop the flag to initialise them"
        )


def check_checkpointing(args: Args) -> None:
    c = args.checkpoint
    if c.dist_ckpt_strictness not in SUPPORTED:
        fail(
            f"--dist-ckpt-strictness {c.dist_ckpt_strictness}: returns the mismatching keys "
            "to a caller of Megatron-Core's load(); mg-train has none: use "
            f"{c.dist_ckpt_strictness.replace('return_', 'log_')} to have them printed"
        )
    if c.ckpt_step is not None and c.ckpt_step <= 0:
        fail(f"--ckpt-step {c.ckpt_step}: must be an iteration of --load (at least 1)")
    if c.save_interval is not None and c.save_interval <= 0:
        fail(f"--save-interval {c.save_interval}: must be at least 1 (iterations between saves)")
