"""`mg-train gpt|bert|t5 [Megatron flags]`: parse, validate, then train.

Flag errors are reported before any dataset, model or process group is built,
with exit status 2 (argparse's convention for usage errors).
"""

from __future__ import annotations

import sys

from mg.trainer.arguments import ArgumentError, parse_args
from mg.trainer.distributed import read_world_size
from mg.trainer.families import get_family


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv, world_size=read_world_size())
        family = get_family(args.family)
        if args.family != "gpt":
            family.build_config(args, 1)  # bert/t5 data/shape flag errors, before anything heavy
        if args.training.dry_run:
            from mg.trainer.dry_run import report

            print(report(args), flush=True)
            return 0
    except ArgumentError as error:
        print(f"mg-train: error: {error}", file=sys.stderr)
        return 2
    from mg.core.parallel.watchdog import exit_on_distributed_error
    from mg.trainer.training import pretrain  # heavy imports only once flags are good

    try:
        # A dead or stuck peer: print rank, stage and operation, exit at once (non-zero),
        # so torchrun stops the other ranks instead of leaving them waiting.
        with exit_on_distributed_error():
            pretrain(args)
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
