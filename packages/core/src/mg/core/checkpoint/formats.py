"""The checkpoint formats, and which `torch_dist` key layout a model is written in.

| format (`--ckpt-format`) | on disk | written | read |
| --- | --- | --- | --- |
| `torch` | `mp_rank_TT[_PPP]/model_optim_rng.pt` per model-parallel rank | yes | yes |
| `torch_dist` | a torch.distributed.checkpoint folder (`dist_format`) | yes | yes |
| `fsdp_dtensor` | a torch_dist folder with the state-dict API's keys (`fsdp_dtensor`) | yes | yes |

A `torch_dist` folder keys its tensors in one of two layouts:

- `DistLayout.MEGATRON`, Megatron-Core's `sharded_state_dict` keys
  (`megatron_dist`, `megatron_sharded_keys.key_layout`): what Megatron-LM reads and
  writes, and what mg writes for every family — a GPT (dense or MoE, the local
  layer spec or Transformer Engine's, whose fused norms and `_extra_state` objects
  are Megatron's own TE-spec keys), a BERT, a T5 and a hybrid Mamba.
- `DistLayout.PER_PARAMETER`, mg's earlier `model.<name>` keys: read only (older
  checkpoints of any family), never written.

The layout follows from the model's family and configuration (`dist_layout`),
never from its parameter names, so a model saves in the layout its configuration
promises. A reader tells the two apart by the stored keys
(`megatron_dist.is_megatron_layout`). A run asking for what cannot be written
learns it at start-up (`check_savable`), not at its first save.
"""

from __future__ import annotations

import enum

from mg.core.checkpoint.layout import CheckpointError
from mg.core.models.config import TransformerConfig

TORCH = "torch"
TORCH_DIST = "torch_dist"
FSDP_DTENSOR = "fsdp_dtensor"
FORMATS = (TORCH, TORCH_DIST, FSDP_DTENSOR)
WRITTEN = (TORCH, TORCH_DIST, FSDP_DTENSOR)  # the formats with a writer (and a reader)


class DistLayout(enum.Enum):
    """How a `torch_dist` checkpoint keys a model's tensors."""

    MEGATRON = "Megatron-Core's sharded_state_dict keys"
    PER_PARAMETER = "mg's per-parameter keys (model.<name>)"


# The families whose Megatron layout mg writes (mg.trainer's family names): all of them; a
# new family declares its layout here (and its keys in `megatron_sharded_keys`).
MEGATRON_LAYOUT_FAMILIES = ("gpt", "bert", "t5", "mamba", "retro", "vlm")


def dist_layout(family: str, config: TransformerConfig) -> DistLayout:
    """The key layout a `torch_dist` save of a `family` model with `config` is written in:
    Megatron-Core's (`key_layout(config)` says how). A family without one is refused in one
    line naming `--ckpt-format`."""
    if family not in MEGATRON_LAYOUT_FAMILIES:
        raise CheckpointError(
            f"--ckpt-format {TORCH_DIST}: a {family!r} model has no Megatron-Core key layout "
            f"to be written in; use --ckpt-format {TORCH}"
        )
    return DistLayout.MEGATRON


def check_savable(ckpt_format: str, config: TransformerConfig, *, family: str) -> DistLayout | None:
    """Refuse, in one line naming the flag, a format this model cannot be saved in; else
    the `torch_dist` key layout it will be saved in (None for `torch`).

    Meant for start-up, right after the model's config is built: a run learns before
    training, not at its first save, that its checkpoints cannot be written."""
    require_writer(ckpt_format)
    if ckpt_format in (TORCH, FSDP_DTENSOR):  # fsdp_dtensor: the state-dict API's keys
        return None
    return dist_layout(family, config)


def require_writer(ckpt_format: str) -> None:
    """Refuse, in one line naming `--ckpt-format`, a format that has no writer."""
    if ckpt_format not in WRITTEN:
        raise CheckpointError(
            f"--ckpt-format {ckpt_format}: not a checkpoint format; use {TORCH_DIST} or {TORCH}"
        )
