"""Megatron-LM's pickled enums, read as plain names without running code from the file.

Megatron-LM pickles its ``args`` Namespace into every checkpoint (``common.pt``,
``model_optim_rng.pt``), and some values are enums: ``attention_backend`` is
``megatron.core.transformer.enums.AttnBackend.auto``, ``exit_signal`` is
``signal.SIGTERM``, the rerun state machine's entry holds ``RerunMode``. A pickle
stores such a value as "call this class with the member's value"
(``AttnBackend(5)``), and ``torch.load(weights_only=True)`` refuses every class
outside its allowlist.

Here each such class is replaced by a stand-in registered under its name for
torch's weights-only unpickler: called with the value, it returns the member's
name as a plain ``str`` (``"auto"``, ``"SIGTERM"``, ``"disabled"``), the words
the tools' flags use. Nothing named by the file is imported or run, so
megatron-core need not be installed. Only enum-shaped values (class called with
one value) are read this way; anything else Megatron might pickle is still
refused by the loader, with its class named.
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

# Module prefixes whose classes are read as enum names.
FOREIGN_MODULES = ("megatron.", "signal.")
# pathlib paths (Megatron's args may hold one) are read as their string.
_PATH_CLASSES = ("pathlib.PosixPath", "pathlib.PurePosixPath")

# Integer-valued enums of megatron-core 0.16 (value -> member name); str-valued ones
# (RerunMode, Fp8Recipe, ...) carry their name as the value and need no table.
_ATTN_BACKEND = {1: "flash", 2: "fused", 3: "unfused", 4: "local", 5: "auto"}
_MODEL_TYPE = {1: "encoder_or_decoder", 2: "encoder_and_decoder"}
_MEMBERS: dict[str, dict[Any, str]] = {
    "AttnBackend": _ATTN_BACKEND,
    "ModelType": _MODEL_TYPE,
    "LayerType": {1: "embedding", 2: "loss", 3: "encoder", 4: "decoder", 5: "mtp"},
    "AttnType": {1: "self_attn", 2: "cross_attn"},
    "AttnMaskType": {
        1: "padding",
        2: "causal",
        3: "no_mask",
        4: "padding_causal",
        5: "arbitrary",
        6: "causal_bottom_right",
    },
    "CudaGraphScope": {
        1: "full_iteration",
        2: "attn",
        3: "mlp",
        4: "moe",
        5: "moe_router",
        6: "moe_preprocess",
        7: "mamba",
    },
    "RerunState": {
        0: "NOT_RUNNING_YET",
        1: "INITIAL_RUN",
        2: "RERUNNING_IN_PLACE",
        3: "WILL_RERUN_FROM_CHECKPOINT",
        4: "RERUNNING_FROM_CHECKPOINT",
        5: "RERUNNING_AGAIN_FROM_CHECKPOINT",
    },
}


def is_foreign(qualified_name: str) -> bool:
    """Whether the loader reads this pickled class as a plain name (or path string)."""
    return qualified_name.startswith(FOREIGN_MODULES) or qualified_name in _PATH_CLASSES


def enum_name(qualified_name: str, value: Any) -> str:
    """The member's name for ``value`` of the enum class ``qualified_name``."""
    cls = qualified_name.rsplit(".", 1)[-1]
    if qualified_name.startswith("signal."):
        try:
            return signal.Signals(value).name if cls == "Signals" else str(value)
        except ValueError:
            return f"{cls}({value!r})"
    if isinstance(value, str):  # a str-valued enum: the value is the name
        return value
    member = _MEMBERS.get(cls, {}).get(value)
    return member if member is not None else f"{cls}({value!r})"


def stand_in(qualified_name: str) -> Callable[..., str]:
    """A callable the weights-only unpickler may call in place of ``qualified_name``."""
    if qualified_name in _PATH_CLASSES:

        def path_string(*parts: Any) -> str:
            return str(PurePosixPath(*(str(p) for p in parts)))

        return path_string

    def name_of(value: Any = None, *rest: Any) -> str:
        if rest:
            raise TypeError(f"{qualified_name} is not an enum value (called with {len(rest) + 1})")
        return enum_name(qualified_name, value)

    name_of.__qualname__ = f"stand_in[{qualified_name}]"
    return name_of


def stand_ins(names: list[str]) -> list[tuple[Callable[..., str], str]]:
    """torch.serialization.safe_globals entries for the foreign classes in ``names``."""
    return [(stand_in(name), name) for name in names if is_foreign(name)]
