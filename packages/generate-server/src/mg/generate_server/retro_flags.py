"""`mg-serve`'s Retro flags (Megatron's names); read by `retro_serving`."""

from __future__ import annotations

import argparse


def add_retro_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Retro", "a Retro checkpoint retrieves per request")
    g.add_argument(
        "--retro-project-dir",
        metavar="DIR",
        help="the mg-prep retro folder to retrieve from; default: the checkpoint's",
    )
    g.add_argument(
        "--retro-num-neighbors", type=int, help="neighbours per chunk; default: the model's"
    )
