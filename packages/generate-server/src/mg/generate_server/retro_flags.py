"""`mg-serve`'s Retro flags (Megatron's names); read by `retro_serving`."""

from __future__ import annotations

import argparse

from mg.core.retro.flags import add_retrieval_flags


def add_retro_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Retro", "a Retro checkpoint retrieves per request")
    add_retrieval_flags(g)
