"""Megatron's `torch_dist` checkpoint format: torch.distributed.checkpoint (DCP) directories.

    <save>/latest_checkpointed_iteration.txt
    <save>/iter_0000200/.metadata            DCP's index: every tensor's global shape and chunks
    <save>/iter_0000200/__0_0.distcp …       the tensor data each rank wrote
    <save>/iter_0000200/common.pt            non-sharded state (args, iteration, scheduler, rng, mg)
    <save>/iter_0000200/metadata.json        written last: its presence marks a complete checkpoint

Tensor keys are global names without ranks, each stored once with its global
shape whatever the layout that wrote it; a tensor-parallel shard is a chunk of
it. Which keys a model's tensors get is a key layout (`formats.dist_layout`
chooses it from the model's configuration): Megatron-Core's
(`decoder.layers.self_attention.linear_qkv.weight`, layers stacked along a leading
axis: `megatron_dist`) or mg's per-parameter one
(`model.decoder.layers.0.self_attention.linear_qkv.weight`); optimizer state by
parameter name (`optimizer.state.<name>.exp_avg`). So loading into another tensor-
or data-parallel layout is DCP reading the chunks that overlap the new shards
(resharding), and one process can read the whole model (`load_full_state`). This
module is the DCP writer and reader; which keys go in is the caller's, except for
the two model readers (`load_full_state`, `load_model_tensors`), which tell the key
layouts apart by the stored keys. What DCP is handed for a rank's tensors
(`GlobalChunks`, views over their own storage) is `global_chunks`'.

Saves are atomic: every rank writes into `iter_XXXXXXX.tmp/`, then rank 0
writes common.pt and metadata.json, renames the folder into place and
updates the latest pointer. With `async_save=True` the state is copied to host
memory, written by a background thread, and committed when the write is done;
a process killed during an async save leaves only a `.tmp` folder, never read.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mg.core.checkpoint.dcp_index import write_portable_index
from mg.core.checkpoint.global_chunks import (
    GlobalChunks,
    dcp_ready,
    single_process_is_intended,
)

# What DCP is handed lives in `global_chunks`; `own_storage` is also read from here.
from mg.core.checkpoint.global_chunks import own_storage as own_storage
from mg.core.checkpoint.layout import (
    DISPLACED_SUFFIX,
    RELEASE,
    STAGING_SUFFIX,
    CheckpointError,
    Iteration,
    checkpoint_dir,
    tracker_file,
)
from mg.core.checkpoint.megatron_dist import (
    is_megatron_layout,
    megatron_model_state,
    read_parameters,
    stored_parameters,
)
from mg.core.checkpoint.megatron_sharded_keys import key_layout
from mg.core.checkpoint.reader_guard import guard_dcp_load, read_dcp_metadata
from mg.core.checkpoint.save_errors import describe_write_error, save_failed
from mg.core.checkpoint.serialization import atomic_write, fsync_dir, load_file, save_file
from mg.core.models.config import TransformerConfig

COMMON_FILENAME = "common.pt"
METADATA_FILENAME = "metadata.json"
# Megatron's metadata.json for a torch_dist checkpoint (dist_checkpointing/core.py).
TORCH_DIST_METADATA = {
    "sharded_backend": "torch_dist",
    "sharded_backend_version": 1,
    "common_backend": "torch",
    "common_backend_version": 1,
}


def is_torch_dist(folder: str | Path) -> bool:
    """True for a complete torch_dist iteration folder (metadata.json says so)."""
    path = Path(folder) / METADATA_FILENAME
    if not path.is_file():
        return False
    try:
        return json.loads(path.read_text()).get("sharded_backend") == "torch_dist"
    except (OSError, ValueError):
        return False


# --------------------------------------------------------------------------- save


def staging_dirs(save_dir: Path, iteration: Iteration) -> tuple[Path, Path]:
    """The iteration folder and the staging folder a save writes before renaming it."""
    final = checkpoint_dir(save_dir, iteration)
    return final, final.with_name(final.name + STAGING_SUFFIX)


_staging = staging_dirs


def commit_staged(
    save_dir: Path,
    final: Path,
    staging: Path,
    iteration: Iteration,
    common: Mapping[str, Any] | None,
) -> None:
    """One process's commit of a staged save: common.pt (with the iteration, 0 for a
    release), metadata.json, rename into place, latest pointer."""
    common_state = {**(common or {}), "iteration": 0 if iteration == RELEASE else iteration}
    _commit(save_dir, final, staging, common_state)


def _commit(save_dir: Path, final: Path, staging: Path, common: Mapping[str, Any]) -> None:
    """Rank 0, once every rank's data is on disk: DCP's index in the form older torch
    releases read (`dcp_index`), common.pt, metadata.json, rename, pointer."""
    write_portable_index(staging)
    save_file(dict(common), staging / COMMON_FILENAME)
    atomic_write(
        staging / METADATA_FILENAME,
        lambda handle: handle.write(json.dumps(TORCH_DIST_METADATA)),
        binary=False,
    )
    # A re-saved iteration: the old copy is removed only once the new one is in place, so
    # a kill in between leaves one of them under the name (or `.old`), never neither.
    displaced = final.with_name(final.name + DISPLACED_SUFFIX)
    if final.exists():
        shutil.rmtree(displaced, ignore_errors=True)
        os.rename(final, displaced)
    os.rename(staging, final)
    fsync_dir(save_dir)
    shutil.rmtree(displaced, ignore_errors=True)
    iteration = RELEASE if final.name == RELEASE else common.get("iteration", final.name)
    atomic_write(tracker_file(save_dir), lambda h: h.write(str(iteration)), binary=False)


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


class PendingSave:
    """An async save in flight; `wait()` blocks until it is written and committed."""

    def __init__(self, future: Future | None, path: Path) -> None:
        self.future = future
        self.path = path

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def wait(self) -> Path:
        if self.future is not None:
            self.future.result()
        return self.path


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner, but an `io.BytesIO` value is stored as the bytes it holds: Megatron's
    ShardedObjects (`rng_state`, `_extra_state`) are `torch.save([data])` under their key,
    which DCP would otherwise pickle a second time (or flatten, for a list of dicts)."""

    def transform_object(self, write_item: Any, object: Any) -> Any:
        if isinstance(object, io.BytesIO):
            return object
        return super().transform_object(write_item, object)


def save_planner() -> DefaultSavePlanner:
    """The planner every torch_dist save uses (ShardedObjects' bytes stored as they are)."""
    return _SavePlanner()


class _HostCopyStager:
    """DCP's async stager for our states: plain tensors and `GlobalChunks` pieces copied
    to host memory (DCP's default stager does not know `GlobalChunks`)."""

    should_synchronize_after_execute = False

    def stage(self, state: Any) -> Any:
        if isinstance(state, Mapping):
            return {k: self.stage(v) for k, v in state.items()}
        if isinstance(state, list):
            return [self.stage(v) for v in state]
        if isinstance(state, GlobalChunks):
            return state.host_copy()
        if isinstance(state, Tensor):
            return state.detach().to("cpu", copy=True)
        return state

    def synchronize_staging(self) -> None:
        """Staging is synchronous: nothing to wait for."""

    def close(self) -> None:
        """Nothing held."""


_ASYNC_GROUP: list[dist.ProcessGroup] = []


def _async_save_group() -> dist.ProcessGroup | None:
    """A gloo group of the whole world for background saves (made once, collectively).

    DCP's background thread runs collectives to finish a save; on the default group
    they would interleave with the training's own collectives (the trainer's next
    all-reduce) in a different order on different ranks, and hang."""
    if not dist.is_initialized():
        return None
    if not _ASYNC_GROUP:
        _ASYNC_GROUP.append(dist.new_group(backend="gloo"))
    return _ASYNC_GROUP[0]


def save_dist_checkpoint(
    save_dir: str | Path,
    iteration: Iteration,
    sharded: Mapping[str, Any],
    common: Mapping[str, Any] | None,
    *,
    async_save: bool = False,
    process_group: dist.ProcessGroup | None = None,
) -> PendingSave:
    """Save `sharded` (nested dicts of tensors/DTensors) collectively; rank 0 passes `common`.

    Every rank of `process_group` calls this. Returns a `PendingSave`; for a
    synchronous save it is already complete. With `async_save` the caller
    must `wait()` on it before the next save and before exiting. `iteration` may be
    "release" (converted weights; common.pt then records iteration 0, as the `torch`
    format does).
    """
    if iteration != RELEASE and (not isinstance(iteration, int) or iteration <= 0):
        raise ValueError(f"iteration must be an int > 0 or 'release', got {iteration!r}")
    save_dir = Path(save_dir)
    final, staging = _staging(save_dir, iteration)
    is_main = not dist.is_initialized() or dist.get_rank(process_group) == 0
    if is_main:
        save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    _barrier(process_group)
    state = dcp_ready(dict(sharded))
    no_dist = not dist.is_initialized()
    common_state = {**(common or {}), "iteration": 0 if iteration == RELEASE else iteration}
    if not async_save:
        failure: BaseException | None = None
        try:
            with single_process_is_intended():
                dcp.save(
                    state,
                    checkpoint_id=staging,
                    process_group=process_group,
                    planner=_SavePlanner(),
                    no_dist=no_dist,
                )
            if is_main:
                _commit(save_dir, final, staging, common_state)
        except (OSError, RuntimeError, dcp.api.CheckpointException) as error:  # a full disk
            failure = error  # DCP fails on every rank; a commit on rank 0 only: see below
        _barrier(process_group)
        # every rank reads the same answer from the shared folder: committed or not
        if failure is not None or not final.is_dir() or staging.exists():
            _barrier(process_group)  # every rank has looked before the folder goes
            if is_main:
                shutil.rmtree(staging, ignore_errors=True)
            reason = describe_write_error(failure) if failure else "another rank could not write"
            raise save_failed(save_dir, iteration, staging, reason) from None
        _barrier(process_group)
        return PendingSave(None, final)
    with single_process_is_intended():
        response = dcp.async_save(
            state,
            checkpoint_id=staging,
            process_group=process_group or _async_save_group(),
            planner=_SavePlanner(),
            async_stager=_HostCopyStager(),
            no_dist=no_dist,
        )
    future: Future = getattr(response, "upload_completion", response)
    if not is_main:
        return PendingSave(future, final)
    # DCP's coordinator (rank 0) finishes only after every rank's data is written
    # and .metadata is saved, so committing after it is safe.
    committed: Future = Future()

    def commit(done: Future) -> None:
        try:
            done.result()
            _commit(save_dir, final, staging, common_state)
            committed.set_result(final)
        except BaseException as exc:  # surfaced by PendingSave.wait()
            committed.set_exception(exc)

    future.add_done_callback(commit)
    return PendingSave(committed, final)


# --------------------------------------------------------------------------- load


def _check_complete(folder: Path) -> None:
    if not is_torch_dist(folder):
        raise CheckpointError(
            f"{folder} is not a complete torch_dist checkpoint (no metadata.json naming "
            "torch_dist); it may be a torch-format checkpoint (use --ckpt-format torch) or a "
            "save that was interrupted"
        )


def load_common(folder: str | Path, *, allow_pickle: bool = False) -> dict[str, Any]:
    """The non-sharded state (common.pt) of a torch_dist iteration folder. Megatron-LM's
    pickles its args Namespace with enums in it: `allow_pickle` reads those (DCP unpickles
    the checkpoint's objects, `rng_state` among them, in any case)."""
    folder = Path(folder)
    _check_complete(folder)
    return load_file(folder / COMMON_FILENAME, allow_pickle=allow_pickle)


def load_dist_checkpoint(
    folder: str | Path,
    sharded: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Fill `sharded` (this rank's tensors/DTensors, any layout) in place; returns common.pt.

    Keys absent from the checkpoint raise a CheckpointError naming them.
    """
    folder = Path(folder)
    common = load_common(folder, allow_pickle=allow_pickle)
    reader = dcp.FileSystemReader(folder)
    index = read_dcp_metadata(folder).state_dict_metadata
    stored = set(index)
    wanted = set(_flat_keys(sharded))
    missing = sorted(wanted - stored)
    if missing:
        shown = ", ".join(missing[:5]) + (" …" if len(missing) > 5 else "")
        raise CheckpointError(
            f"{folder}: the checkpoint has no {shown}; it was saved from a different model "
            "(check --num-layers, --untie-embeddings-and-output-weights, the optimizer), or "
            "load without the optimizer (--no-load-optim)"
        )
    ready = dcp_ready(sharded)
    _check_shapes(folder, index, ready)
    with single_process_is_intended(), guard_dcp_load(folder):
        dcp.load(
            ready,
            storage_reader=reader,
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    _copy_objects(ready, sharded)
    return common


def _copy_objects(loaded: Any, target: Any) -> None:
    """DCP replaces non-tensor entries (optimizer options) in the copy it was given;
    tensors were filled in place, other values are copied back into `target` (a stored
    list of another length, e.g. one pipeline stage's parameter names, replaces ours)."""
    items = loaded.items() if isinstance(loaded, Mapping) else enumerate(loaded)
    for key, value in items:
        inner = target[key]
        both_dicts = isinstance(value, Mapping) and isinstance(inner, Mapping)
        same_lists = isinstance(value, list) and isinstance(inner, list)
        if both_dicts or (same_lists and len(value) == len(inner)):
            _copy_objects(value, inner)
        elif not isinstance(value, Tensor):
            target[key] = value


def _check_shapes(folder: Path, index: Mapping[str, Any], ready: Mapping[str, Any]) -> None:
    """A stored tensor of another global shape than the one asked for is a different
    model, not a corrupt file: say so before DCP fails on it."""
    for key, tensor in _flat_tensors(ready):
        meta = index.get(key)
        if isinstance(meta, TensorStorageMetadata) and tuple(meta.size) != tuple(tensor.shape):
            raise CheckpointError(
                f"{folder}: {key} is stored with shape {tuple(meta.size)}, this model's is "
                f"{tuple(tensor.shape)}; it was saved from a different model (check "
                "--num-layers, --hidden-size, --ffn-hidden-size, --num-query-groups, the "
                "padded vocabulary)"
            )


def _flat_tensors(state: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Tensor]]:
    out = []
    for k, v in state.items():
        if isinstance(v, Mapping):
            out.extend(_flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, Tensor):
            out.append((f"{prefix}{k}", v))
    return out


def _flat_keys(state: Mapping[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            keys.extend(_flat_keys(v, name + "."))
        elif isinstance(v, Tensor):
            keys.append(name)
    return keys


def stored_tensors(folder: str | Path, prefix: str = "") -> dict[str, Tensor]:
    """Empty tensors of the stored global shape and dtype for every key under `prefix`
    (keys in full): what a reader asks DCP for when it wants the whole tensors."""
    folder = Path(folder)
    _check_complete(folder)
    metadata = read_dcp_metadata(folder)
    return {
        key: torch.empty(meta.size, dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)
    }


def stored_keys(folder: str | Path, prefix: str = "") -> set[str]:
    """The checkpoint's keys under `prefix`, tensors and objects (from DCP's index)."""
    metadata = read_dcp_metadata(folder)
    return {key for key in metadata.state_dict_metadata if key.startswith(prefix)}


def load_full_state(
    folder: str | Path, prefix: str = "model.", grouped: bool = False
) -> dict[str, Tensor]:
    """Every tensor under `prefix`, whole (unsharded), on one process without a process group.

    With the default prefix, the model's tensors by our parameter names, whichever
    layout stores them (Megatron-Core's layer-stacked keys or mg's earlier `model.<name>`);
    `grouped`: routed experts of Megatron-Core's keys under grouped GEMM's names."""
    folder = Path(folder)
    _check_complete(folder)
    metadata = read_dcp_metadata(folder)
    if prefix == "model." and is_megatron_layout(metadata):  # Megatron-Core's keys
        stored = stored_parameters(metadata, grouped)
        return read_parameters(folder, stored, stored)
    flat = stored_tensors(folder, prefix)
    reader = dcp.FileSystemReader(folder)
    nested: dict[str, Any] = {}
    for key, tensor in flat.items():
        _set_nested(nested, key, tensor)
    with single_process_is_intended(), guard_dcp_load(folder):
        dcp.load(nested, storage_reader=reader, no_dist=True)
    return {key[len(prefix) :]: tensor for key, tensor in flat.items()}


def _set_nested(root: dict[str, Any], dotted: str, value: Any) -> None:
    """DCP flattens nested dicts with dots; rebuild the nesting it expects on load.

    Only the first component is a nesting level for our keys (`model.<name>`),
    since module names themselves contain dots."""
    head, _, rest = dotted.partition(".")
    root.setdefault(head, {})[rest] = value


def load_model_tensors(
    folder: str | Path,
    named: Mapping[str, Tensor],
    config: TransformerConfig,
    *,
    process_group: Any = None,
) -> dict[str, Any]:
    """Fill `named` (our global names → this rank's tensors or DTensors) of a model with
    `config` from a torch_dist checkpoint of either layout, collectively; returns common.pt."""
    if not is_megatron_layout(read_dcp_metadata(folder)):
        return load_dist_checkpoint(folder, {"model": dict(named)}, process_group=process_group)
    state = megatron_model_state(named, key_layout(config))
    common = load_dist_checkpoint(folder, dict(state.tensors), process_group=process_group)
    state.finish_load()
    return common
