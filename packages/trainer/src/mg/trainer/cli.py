"""`mg-train gpt|bert|t5 [Megatron flags]`: parse, validate, then train.

Flag errors are reported before any dataset, model or process group is built,
with exit status 2 (argparse's convention for usage errors); so is a run whose
saves would overwrite newer checkpoints in `--save` (see :mod:`.save_guard`).
Domain errors met later (a dataset, a checkpoint, a config) are one line and
exit status 2 as well, never a traceback.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.save_guard import (
    SaveGuardError,
    check_free_space,
    check_save_target,
    check_writable,
    planned_saves,
)


def main(argv: list[str] | None = None) -> int:
    try:
        # WORLD_SIZE as torchrun sets it; no torch import before argparse answers --help
        args = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        if args.logging.logging_level is not None:  # Megatron's --logging-level
            logging.basicConfig(level=args.logging.logging_level)
            logging.getLogger().setLevel(args.logging.logging_level)
        from mg.trainer.families import get_family  # lazy: --help stays instant (torch)

        family = get_family(args.family)
        if args.family != "gpt":
            family.build_config(args, 1)  # bert/t5 data/shape flag errors, before anything heavy
        if args.training.dry_run:
            from mg.trainer.dry_run import report  # lazy: --help stays instant (torch)

            print(report(args), flush=True)
            return 0
        c = args.checkpoint
        if args.moe.moe_use_upcycling:  # before the save guard: its --save must be empty
            from mg.trainer.upcycling import check_sources  # lazy: --help stays instant (torch)

            check_sources(c.load, c.save, c.ckpt_step)
        check_save_target(
            c.save,
            c.load,
            finetune=c.finetune,
            overwrite=c.overwrite_checkpoints,
            ckpt_step=c.ckpt_step,
        )
        check_writable(c.save)
        if warning := check_free_space(c.save, *planned_saves(args)):
            print(warning, file=sys.stderr, flush=True)
    except (ArgumentError, SaveGuardError) as error:
        print(f"mg-train: error: {error}", file=sys.stderr)
        return 2
    # lazy: --help stays instant; the training stack (torch, numpy) loads once flags are good
    from mg.core.checkpoint import CheckpointError
    from mg.core.parallel.watchdog import exit_on_distributed_error
    from mg.indexed_dataset.errors import IndexedDatasetError
    from mg.trainer.training import pretrain

    try:
        # A dead or stuck peer: print rank, stage and operation, exit at once (non-zero),
        # so torchrun stops the other ranks instead of leaving them waiting.
        with exit_on_distributed_error():
            pretrain(args)
    except (CheckpointError, IndexedDatasetError, SaveGuardError, ValueError) as error:
        # ValueError: the model config's and the checkpoint readers' checks (ConfigError is one)
        message = _one_line(error)
        data = args.data.data_path or (
            [args.data.data_args_path] if args.data.data_args_path else []
        )
        if _from_dataset(error) and data and not any(p in message for p in data):
            flag = "--data-path" if args.data.data_path else "--data-args-path"
            message = f"{flag} {' '.join(data)}: {message}"
        print(f"mg-train: error: {message}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # before the loop's handler is in place, or a second Ctrl-C
        print(
            "mg-train: interrupted (Ctrl-C) before a checkpoint could be saved; the last one "
            "in --save is as it was",
            file=sys.stderr,
            flush=True,
        )
        return 130
    finally:
        with _ctrl_c_ignored():  # exiting: a late Ctrl-C changes nothing
            import torch.distributed as dist  # lazy: --help stays instant (torch)

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
    return 0


@contextlib.contextmanager
def _ctrl_c_ignored() -> Iterator[None]:
    """SIGINT ignored inside, the caller's handler restored after (main may run in-process)."""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: signals are not ours to handle
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _from_dataset(error: BaseException) -> bool:
    """Raised by mg.indexed_dataset (its messages name the split, not always the files)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "") if tb is not None else ""
    return type(error).__name__ == "IndexedDatasetError" or module.startswith("mg.indexed_dataset")


def _one_line(error: BaseException) -> str:
    """The message, with the hint for a corrupt checkpoint file in --load."""
    # lazy: --help stays instant (mg.core.checkpoint imports torch)
    from mg.core.checkpoint.reader_guard import CorruptFileError

    text = str(error) or type(error).__name__
    # the core reader's advice in mg-train's words
    text = text.replace("pass iteration=N to load one of them", "load one with --ckpt-step N")
    if isinstance(error, CorruptFileError):
        text = text.rstrip(".") + (" (load an earlier iteration of --load with --ckpt-step N).")
    return text


if __name__ == "__main__":
    sys.exit(main())
