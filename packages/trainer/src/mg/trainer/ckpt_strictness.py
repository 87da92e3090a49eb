"""`--dist-ckpt-strictness`: Megatron-Core's handling of keys that differ between a
`torch_dist` checkpoint and the model that loads it (`StrictHandling`).

In Megatron's words, a key is *unexpected* when the model asks for it and the
checkpoint lacks it, *missing* when the checkpoint holds it and the model does not
ask for it. DCP itself fails on an unexpected key and never reads a missing one,
which is `assume_ok_unexpected` (the default). The other values look at the
checkpoint's index first: `log_*` and `ignore_all` leave the unexpected tensors out
of the load (they keep the values they have: their initialisation) and say so
(`log_unexpected` those, `log_all` both kinds, `ignore_all` nothing); `raise_*` stop
before reading with every such key named. `return_*` hands the keys to the caller
of Megatron-Core's `load()`; a command line has none, so they are refused.
"""

from __future__ import annotations

import sys
from collections.abc import Collection

from mg.core.checkpoint.layout import CheckpointError
from mg.trainer.arguments.checkpointing import ASSUME_OK

_SHOWN = 8  # keys named in a message, then a count


def _names(keys: Collection[str]) -> str:
    shown = sorted(keys)[:_SHOWN]
    more = len(keys) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


def keys_to_skip(
    strictness: str, requested: Collection[str], stored: Collection[str], folder: str
) -> set[str]:
    """The requested model keys to leave out of the load (the unexpected ones, where
    `strictness` allows them); raises CheckpointError where it does not. `stored`: the
    checkpoint's model keys."""
    if strictness == ASSUME_OK:
        return set()
    unexpected = set(requested) - set(stored)
    missing = set(stored) - set(requested)
    if strictness.startswith("raise_"):
        if unexpected:
            raise CheckpointError(
                f"{folder}: --dist-ckpt-strictness {strictness}: the model's "
                f"{_names(unexpected)} are not in the checkpoint"
            )
        if strictness == "raise_all" and missing:
            raise CheckpointError(
                f"{folder}: --dist-ckpt-strictness raise_all: the checkpoint's "
                f"{_names(missing)} are not in the model"
            )
        return set()
    if strictness in ("log_unexpected", "log_all") and unexpected:
        print(
            f" WARNING: {folder}: not in the checkpoint, kept as initialised "
            f"(--dist-ckpt-strictness {strictness}): {_names(unexpected)}",
            file=sys.stderr,
            flush=True,
        )
    if strictness == "log_all" and missing:
        print(
            f" WARNING: {folder}: in the checkpoint, not in the model (not read): "
            f"{_names(missing)}",
            file=sys.stderr,
            flush=True,
        )
    return unexpected
