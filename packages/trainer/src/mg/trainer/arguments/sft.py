"""Megatron's supervised-finetuning flags (`--sft`): chat data, loss on the assistant only.

mg-train reads SFT data already tokenized by `mg-prep sft` (the conversation ids and
a `_loss_mask` dataset beside them) instead of rendering JSONL on the fly as
Megatron's SFTDataset does; the prompt format is chosen there, and checked here
against what the data was made with. Conversations are always packed into
`--seq-length` sequences with block-diagonal causal attention and positions that
restart per conversation (Megatron's SFT packing), so `--sft-sequence-packing`,
`--reset-attention-mask` and `--reset-position-ids` only confirm it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args

PROMPT_FORMATS = ("chatml", "chat_template")
"""What `mg-prep sft` renders: Megatron's chatml, or the tokenizer folder's own template."""


@dataclass
class SFTArgs:
    """Supervised finetuning on chat data (`mg-prep sft` output)."""

    sft: bool = False
    sft_tokenizer_prompt_format: str | None = None
    sft_sequence_packing: bool = False
    sft_mock_dataset_config_json: str | None = None


def add_sft_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--sft",
        action="store_true",
        help="Finetune on chat data from `mg-prep sft`: loss on assistant tokens only, "
        "conversations packed with attention that does not cross them (gpt); with retro, "
        "one conversation a sample with neighbours retrieved for it (InstructRetro).",
    )
    p.add_argument(
        "--sft-tokenizer-prompt-format",
        help="The prompt format the data was rendered with (chatml or chat_template); "
        "checked against the data. Megatron's other formats are refused by name.",
    )
    p.add_argument(
        "--sft-sequence-packing",
        action="store_true",
        help="Accepted for Megatron scripts: --sft always packs conversations.",
    )
    p.add_argument(
        "--sft-mock-dataset-config-json",
        help="Megatron's mock SFT data; not supported (prepare a small set with mg-prep sft).",
    )


def check_sft(args: Args) -> None:
    """--sft's needs: gpt or retro, real data, the local attention that takes a packed mask."""
    s = args.sft
    fmt = s.sft_tokenizer_prompt_format
    if fmt is not None and fmt not in PROMPT_FORMATS:
        fail(
            f"--sft-tokenizer-prompt-format {fmt}: not supported; mg-prep sft renders "
            + " or ".join(PROMPT_FORMATS)
        )
    if s.sft_mock_dataset_config_json is not None:
        fail(
            "--sft-mock-dataset-config-json is not supported; make a small dataset with "
            "mg-prep sft and give --data-path"
        )
    if not s.sft:
        return
    if args.family not in ("gpt", "retro"):
        fail(f"--sft is for mg-train gpt, not {args.family} (mg-train retro takes it too)")
    if args.data.mock_data:
        fail("--sft needs --data-path (made by mg-prep sft), not --mock-data")
    if args.transformer_engine.transformer_impl != "local":
        fail("--sft needs --transformer-impl local (packed conversations need a block mask)")
    if args.data.eod_mask_loss:
        fail(
            "--eod-mask-loss does not go with --sft: the loss mask comes from the data "
            "(mg-prep sft), which trains each reply's end-of-turn token on purpose"
        )
    if args.distributed.context_parallel_size > 1:
        fail("--sft does not support --context-parallel-size > 1 (packed conversations)")
