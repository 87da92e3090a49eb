"""The retrieval flags of the tools that run a Retro checkpoint (Megatron's names).

mg-eval and mg-serve both retrieve at generation time from a project folder; they
take the same two flags, defined here once. Nothing heavy is imported (`--help`).
"""

from __future__ import annotations

import argparse


def add_retrieval_flags(group: argparse._ArgumentGroup) -> None:
    """`--retro-project-dir` and `--retro-num-neighbors` on `group`."""
    group.add_argument(
        "--retro-project-dir",
        metavar="DIR",
        help="the mg-prep retro folder to retrieve from; default: the checkpoint's",
    )
    group.add_argument(
        "--retro-num-neighbors", type=int, help="neighbours per chunk; default: the model's"
    )
