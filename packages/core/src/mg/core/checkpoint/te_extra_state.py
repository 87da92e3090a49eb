"""Transformer Engine's `_extra_state` handed back on a resume, its refusal said in one line.

TE 2.x keeps a module's FP8 scaling state as a uint8 tensor of a pickled dict
(TransformerEngineBaseModule.get_extra_state) and, loading it, refuses a pickled
delayed-scaling state unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1
(should_load_extra_state_pickle): unpickling can run code. Megatron leaves that choice to
the user's environment, and so does mg; what a resume says when TE refuses is one line
naming the variable and the checkpoint, in both checkpoint formats (torch_dist hands each
module its state here, torch's `load_state_dict` calls `set_extra_state` itself).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from mg.core.checkpoint.layout import CheckpointError

TE_UNSAFE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


def te_pickle_refusal(error: Exception, where: str) -> CheckpointError | None:
    """The one-line error for TE's refusal to unpickle an FP8 state (`error`, raised by
    its set_extra_state) of the checkpoint `where`; None for any other error."""
    if TE_UNSAFE_PICKLE_ENV not in str(error):
        return None
    return CheckpointError(
        f"{where}: Transformer Engine refuses to unpickle the FP8 delayed-scaling state "
        f"(_extra_state) unless {TE_UNSAFE_PICKLE_ENV}=1; set it in the environment if "
        "the checkpoint is trusted"
    )


def restore_extra_state(module: nn.Module, data: Any, where: str) -> None:
    """Hand `module` its stored `_extra_state` as `load_state_dict` would (None, a
    local-spec save's, restores nothing; TE itself skips an empty state, saved before FP8
    ran); TE's refusal to unpickle it is one line naming `where` (the checkpoint)."""
    if data is None:
        return
    try:
        module.set_extra_state(data)
    except RuntimeError as error:
        refusal = te_pickle_refusal(error, where)
        if refusal is None:
            raise
        raise refusal from None
