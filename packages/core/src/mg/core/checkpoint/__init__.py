"""Checkpoints in Megatron-LM's `torch` format, saved atomically and self-describing.

    from mg.core.checkpoint import save_checkpoint, load_checkpoint, describe

    save_checkpoint("ckpt", 200, state, barrier=torch.distributed.barrier, ...)
    state, iteration = load_checkpoint("ckpt")          # follows the latest pointer
    describe("ckpt").model_config                       # no model flags needed
    model, config, tokenizer_config, info = load_model("ckpt")   # eval and serving

See :mod:`.layout` for the names on disk, :mod:`.torch_format` for the save
protocol, :mod:`.serialization` for what loads with ``weights_only=True``.
"""

from mg.core.checkpoint.layout import (
    MODEL_FILENAME,
    RELEASE,
    TRACKER_FILENAME,
    CheckpointError,
    Layout,
    checkpoint_dir,
    checkpoint_file,
    detect_layout,
    list_iterations,
    rank_dirname,
    read_latest_iteration,
)
from mg.core.checkpoint.model_io import ModelInfo, load_model, resolve_tokenizer_paths, save_model
from mg.core.checkpoint.rng import get_rng_state, rng_state_list, set_rng_state
from mg.core.checkpoint.torch_format import (
    CHECKPOINT_VERSION,
    FORMAT_VERSION,
    CheckpointInfo,
    describe,
    find_rank_file,
    load_checkpoint,
    mg_metadata,
    save_checkpoint,
    save_checkpoint_shards,
    saved_layout,
)

__all__ = [
    "CHECKPOINT_VERSION",
    "FORMAT_VERSION",
    "MODEL_FILENAME",
    "RELEASE",
    "TRACKER_FILENAME",
    "CheckpointError",
    "CheckpointInfo",
    "Layout",
    "ModelInfo",
    "checkpoint_dir",
    "checkpoint_file",
    "describe",
    "detect_layout",
    "find_rank_file",
    "get_rng_state",
    "list_iterations",
    "load_checkpoint",
    "load_model",
    "mg_metadata",
    "rank_dirname",
    "read_latest_iteration",
    "resolve_tokenizer_paths",
    "rng_state_list",
    "save_model",
    "save_checkpoint",
    "save_checkpoint_shards",
    "saved_layout",
    "set_rng_state",
]
