"""--attention-backend / --use-flash-attn of the GPT tasks: the kernel asked for, checked
on this machine's device before a long load.

Kept apart from the command-line modules (``mg-eval``'s parser and the harness
subcommand both use it) so that their parsers build without torch.
"""

from __future__ import annotations

import argparse

import torch

from mg.core.models.attention_backend import BackendUnavailableError, check_attention_backend
from mg.evaluate.errors import EvalInputError


def attention_backend_of(args: argparse.Namespace) -> str:
    """--attention-backend (or --use-flash-attn), refused in one line where it cannot run."""
    backend = "flash" if args.use_flash_attn else args.attention_backend
    if args.use_flash_attn and args.attention_backend not in ("auto", "flash"):
        raise EvalInputError(
            f"--use-flash-attn contradicts --attention-backend {args.attention_backend}"
        )
    try:
        check_attention_backend(backend, "cuda" if torch.cuda.is_available() else "cpu")
    except BackendUnavailableError as err:
        raise EvalInputError(str(err)) from None
    if backend == "flash":  # the flash kernel is 16-bit only
        flag = "--use-flash-attn" if args.use_flash_attn else "--attention-backend flash"
        raise EvalInputError(
            f"{flag}: mg-eval scores in fp32 and FlashAttention runs in 16-bit only; "
            "use --attention-backend fused (or auto) for the fused kernels"
        )
    return backend
