"""Megatron-LM's `torch` checkpoint format: atomic save, checked load, describe.

A state dict holds Megatron's keys — ``args``, ``checkpoint_version`` (3.0),
``iteration``, ``model`` (``model0``, ``model1``… per virtual stage),
``optimizer``, ``opt_param_scheduler``, ``rng_state``,
``num_floating_point_operations_so_far`` — plus our ``mg`` entry that makes a
checkpoint self-describing::

    "mg": {"format_version": 1, "model_config": {...}, "tokenizer_config": {...},
           "parallel": {"tp": 2, "pp": 1, "ep": 1}}

Store ``args`` as a plain dict: then every file loads with
``torch.load(weights_only=True)`` (see :mod:`.serialization`).

How a save stays atomic (several ranks, one shared file system):

1. the writer of ``latest`` (global rank 0) empties ``iter_XXXXXXX.tmp/``; barrier;
2. each rank writes its ``mp_rank_*/model_optim_rng.pt`` inside it, through a
   temporary file that is fsynced and renamed into place; barrier; each rank looks
   for every rank's file there (a write that failed left none); barrier;
3. the writer renames ``iter_XXXXXXX.tmp/`` to ``iter_XXXXXXX/`` (an existing copy
   of that iteration is first moved to ``iter_XXXXXXX.old/`` and deleted after),
   then rewrites ``latest_checkpointed_iteration.txt`` via a temporary file and
   ``os.replace``; barrier.

A crash anywhere before step 3 leaves only a ``.tmp`` folder, which no reader
takes for a checkpoint, and the pointer still names the previous save. A write
that fails (a full disk) is cleaned up instead: every rank sees the same files
in step 2, so if one is missing they all know; the staging folder is removed and
every rank raises a :class:`SaveError` that says the previous checkpoint is intact.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from mg.core.checkpoint.dist_format import is_torch_dist, load_common
from mg.core.checkpoint.layout import (
    DISPLACED_SUFFIX,
    MODEL_FILENAME,
    RELEASE,
    STAGING_SUFFIX,
    CheckpointError,
    Iteration,
    Layout,
    checkpoint_dir,
    detect_layout,
    has_release,
    list_iterations,
    rank_dirname,
    read_latest_iteration,
    scan_rank_dirs,
    tracker_file,
)
from mg.core.checkpoint.save_errors import SaveError, describe_write_error, save_failed
from mg.core.checkpoint.serialization import atomic_write, fsync_dir, load_file, save_file

CHECKPOINT_VERSION = 3.0  # Megatron's; < 3.0 means a different QKV layout
FORMAT_VERSION = 1  # of our "mg" entry; bump when its meaning changes

Barrier = Callable[[], Any]


def mg_metadata(
    model_config: Mapping[str, Any] | None = None,
    tokenizer_config: Mapping[str, Any] | None = None,
    *,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    **parallel: int,
) -> dict[str, Any]:
    """The ``mg`` entry of a state dict: what a reader needs to rebuild model and tokenizer."""
    return {
        "format_version": FORMAT_VERSION,
        "model_config": dict(model_config) if model_config is not None else None,
        "tokenizer_config": dict(tokenizer_config) if tokenizer_config is not None else None,
        "parallel": {"tp": tp, "pp": pp, "ep": ep, **parallel},
    }


def _staging_dir(final: Path) -> Path:
    return final.with_name(final.name + STAGING_SUFFIX)


def _displaced_dir(final: Path) -> Path:
    return final.with_name(final.name + DISPLACED_SUFFIX)


def _complete_state(
    state: Mapping[str, Any], iteration: Iteration, tp: int, pp: int, ep: int
) -> dict[str, Any]:
    """A shallow copy with Megatron's fixed keys and our metadata filled in."""
    out = dict(state)
    out.setdefault("checkpoint_version", CHECKPOINT_VERSION)
    if iteration != RELEASE:
        out.setdefault("iteration", iteration)
    meta = dict(out.get("mg") or mg_metadata(tp=tp, pp=pp, ep=ep))
    meta["format_version"] = FORMAT_VERSION
    meta.setdefault("parallel", {"tp": tp, "pp": pp, "ep": ep})
    out["mg"] = meta
    return out


class _Staging:
    """One save in progress: ``iter_XXXXXXX.tmp/`` until :meth:`commit`."""

    def __init__(self, save_dir: str | Path, iteration: Iteration):
        if iteration != RELEASE and (not isinstance(iteration, int) or iteration <= 0):
            raise ValueError(
                f"iteration must be an int > 0 or 'release' (Megatron refuses to load "
                f"iteration 0 from latest_checkpointed_iteration.txt), got {iteration!r}"
            )
        self.save_dir = Path(save_dir)
        self.iteration = iteration
        self.final = checkpoint_dir(save_dir, iteration)
        self.staging = _staging_dir(self.final)

    def reset(self) -> None:
        """Remove what an earlier, interrupted save of this iteration left behind."""
        self.save_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.staging, ignore_errors=True)
        self.staging.mkdir()

    def complete(self, rank_dirs: list[str]) -> bool:
        """Every rank's model file is in the staging folder (read the same by every rank)."""
        return all((self.staging / name / MODEL_FILENAME).is_file() for name in rank_dirs)

    def discard(self) -> None:
        shutil.rmtree(self.staging, ignore_errors=True)

    def write(
        self,
        state: Mapping[str, Any],
        rank_dir: str,
        tp: int,
        pp: int,
        ep: int,
        extra_files: Mapping[str, Any] | None = None,
    ) -> Path:
        folder = self.staging / rank_dir
        try:
            folder.mkdir(exist_ok=True)
            # the extra files first: the model file's presence means "this rank wrote all"
            for name, content in (extra_files or {}).items():
                save_file(content, folder / name)
            save_file(_complete_state(state, self.iteration, tp, pp, ep), folder / MODEL_FILENAME)
            fsync_dir(self.staging)
        except Exception as error:  # a full disk (torch.save says RuntimeError), or any other
            (folder / MODEL_FILENAME).unlink(missing_ok=True)
            raise self.failed(describe_write_error(error)) from None
        return self.final / rank_dir / MODEL_FILENAME

    def failed(self, reason: str) -> SaveError:
        """The error of a save that was discarded, naming what is left as it was."""
        return save_failed(self.save_dir, self.iteration, self.staging, reason)

    def commit(self, update_latest: bool = True) -> None:
        if not self.staging.is_dir():
            raise CheckpointError(
                f"{self.staging}: staging folder vanished before commit; was the same "
                "iteration saved twice at once?"
            )
        displaced = _displaced_dir(self.final)
        if self.final.exists():
            shutil.rmtree(displaced, ignore_errors=True)
            os.rename(self.final, displaced)
        os.rename(self.staging, self.final)
        fsync_dir(self.save_dir)
        shutil.rmtree(displaced, ignore_errors=True)
        if update_latest:
            atomic_write(
                tracker_file(self.save_dir),
                lambda handle: handle.write(str(self.iteration)),
                binary=False,
            )


def _written_dirs(own: str | None) -> list[str] | None:
    """The `mp_rank_*` folders the job's ranks write (`own`: this rank's, None if it writes
    nothing), gathered from every rank; None without a process group. Not every cell of
    the TP x PP x EP grid has a writer: with experts apart from tensor parallelism only
    the expert-data-parallel rank 0 of each position writes, as Megatron's legacy saver."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    return sorted({d for d in gathered if d is not None})


def save_checkpoint(
    save_dir: str | Path,
    iteration: Iteration,
    state: Mapping[str, Any] | None,
    *,
    tp_rank: int = 0,
    pp_rank: int = 0,
    pp_size: int = 1,
    tp_size: int = 1,
    ep_rank: int = 0,
    ep_size: int = 1,
    is_writer_of_latest: bool = True,
    barrier: Barrier | None = None,
    update_latest: bool = True,
    extra_files: Mapping[str, Any] | None = None,
) -> Path:
    """Save this rank's part of the checkpoint of ``iteration`` atomically; returns its path.

    Every rank of the job calls this (collectively, when ``barrier`` is given). Ranks
    that hold a replica of a shard already written by another rank (data-parallel
    ranks > 0) pass ``state=None``: they write nothing but take part in the barriers.
    Exactly one rank, the global rank 0, passes ``is_writer_of_latest=True``: it
    prepares the staging folder, moves it into place once all files are written, and
    then updates ``latest_checkpointed_iteration.txt`` (skipped with
    ``update_latest=False``). ``iteration`` may be ``"release"``.

    ``extra_files`` (name -> object) are saved beside the model file in the same
    ``mp_rank_*`` folder, e.g. the distributed optimizer's ``distrib_optim.pt``.

    To write several shards from one process (a converter), use
    :func:`save_checkpoint_shards`.
    """
    if barrier is None and tp_size * pp_size * ep_size > 1:
        raise ValueError(
            f"saving one rank of a TP={tp_size} PP={pp_size} EP={ep_size} checkpoint needs "
            "barrier= (torch.distributed.barrier), so that the checkpoint is committed only "
            "once every rank has written; from a single process use save_checkpoint_shards"
        )
    sync: Barrier = barrier if barrier is not None else (lambda: None)
    staging = _Staging(save_dir, iteration)
    rank_dir = rank_dirname(tp_rank, pp_rank, pp_size, ep_rank, ep_size)
    if is_writer_of_latest:
        staging.reset()
    sync()
    failure: SaveError | None = None
    if state is not None:
        try:
            staging.write(state, rank_dir, tp_size, pp_size, ep_size, extra_files)
        except SaveError as error:  # raised below, once every rank knows
            failure = error
    sync()
    expected = _written_dirs(rank_dir if state is not None else None) or [
        rank_dirname(t, p, pp_size, e, ep_size)
        for t in range(tp_size)
        for p in range(pp_size)
        for e in range(ep_size)
    ]
    complete = failure is None and staging.complete(expected)
    sync()  # every rank has looked before the folder is renamed or removed
    if not complete:
        if is_writer_of_latest:
            staging.discard()
        raise failure or staging.failed("another rank could not write its part; see its error")
    if is_writer_of_latest:
        staging.commit(update_latest)
    sync()
    return staging.final / rank_dir / MODEL_FILENAME


def save_checkpoint_shards(
    save_dir: str | Path,
    iteration: Iteration,
    shards: Mapping[tuple[int, ...], Mapping[str, Any]],
    *,
    tp_size: int | None = None,
    pp_size: int | None = None,
    ep_size: int = 1,
    update_latest: bool = True,
) -> Path:
    """Write a whole checkpoint from one process; keys are ``(tp, pp)`` or ``(tp, pp, ep)``.

    Sizes default to what the keys cover. Atomic like :func:`save_checkpoint`;
    returns the iteration folder.
    """
    keys = [tuple(k) + (0,) * (3 - len(k)) for k in shards]
    tp_size = tp_size or 1 + max(k[0] for k in keys)
    pp_size = pp_size or 1 + max(k[1] for k in keys)
    ep_size = max(ep_size, 1 + max(k[2] for k in keys))
    staging = _Staging(save_dir, iteration)
    staging.reset()
    try:
        for (tp, pp, ep), state in zip(keys, shards.values(), strict=True):
            name = rank_dirname(tp, pp, pp_size, ep, ep_size)
            staging.write(state, name, tp_size, pp_size, ep_size)
    except SaveError:
        staging.discard()
        raise
    staging.commit(update_latest)
    return staging.final


# --------------------------------------------------------------------------- loading


def _available(root: Path) -> str:
    found = [f"iter_{it:07d}" for it in list_iterations(root)]
    if has_release(root):
        found.append(RELEASE)
    if not found:
        return "no complete iter_XXXXXXX folder is there either"
    shown = ", ".join(found[-5:])
    return f"found {shown}; pass iteration=N to load one of them"


def resolve_iteration(load_dir: str | Path, iteration: Iteration | None = None) -> Iteration:
    """The iteration to load: ``iteration`` if given, else what the pointer names."""
    root = Path(load_dir)
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise CheckpointError(f"checkpoint folder {root} {what}; check --load / load_dir")
    if iteration is None:
        iteration = read_latest_iteration(root)
        if iteration is None:
            raise CheckpointError(
                f"no {tracker_file(root).name} in {root}: not a checkpoint directory, or the "
                f"first save did not finish ({_available(root)})"
            )
    return iteration


def iteration_dir(load_dir: str | Path, iteration: Iteration) -> Path:
    """The folder of ``iteration``, checked to be a finished save."""
    root = Path(load_dir)
    final = checkpoint_dir(root, iteration)
    if final.is_dir():
        return final
    source = f"named by {tracker_file(root)}" if iteration == read_latest_iteration(root) else ""
    if _staging_dir(final).exists():
        raise CheckpointError(
            f"checkpoint {final} {source} is half-written: only {_staging_dir(final).name} "
            f"exists (a save that was interrupted). Load an earlier one ({_available(root)})."
        )
    if _displaced_dir(final).exists():
        raise CheckpointError(
            f"checkpoint {final} {source} is missing but {_displaced_dir(final).name} exists: "
            "a save replacing it was interrupted. Rename that folder back to "
            f"{final.name} to load the previous copy."
        )
    raise CheckpointError(f"checkpoint {final} {source} does not exist ({_available(root)})")


def _peek_parallel(path: Path) -> Mapping[str, Any] | None:
    """``mg.parallel`` (or Megatron's args) from a file, cheaply; ``None`` if unreadable."""
    try:
        state = load_file(path, mmap=True)
    except CheckpointError:
        return None
    meta = state.get("mg") or {}
    if meta.get("parallel"):
        return meta["parallel"]
    args = state.get("args")
    args = vars(args) if hasattr(args, "__dict__") else args
    if isinstance(args, Mapping):
        return {
            "tp": args.get("tensor_model_parallel_size", 1),
            "pp": args.get("pipeline_model_parallel_size", 1),
            "ep": args.get("expert_model_parallel_size", 1),
        }
    return None


def saved_layout(folder: Path, pp_size: int | None = None) -> Layout | None:
    """The layout of the checkpoint in ``folder``, resolving ``mp_rank_TT_NNN`` (see layout.py).

    With ``pp_size`` given, an ``mp_rank_TT_NNN`` name is read as PP when ``pp_size > 1``
    and as EP otherwise; without, from the rank-0 file's metadata.
    """
    dirs = scan_rank_dirs(folder)
    if not dirs:
        return None
    second_is_expert = None
    if max(len(d.numbers) for d in dirs) == 2:
        if pp_size is not None:
            second_is_expert = pp_size == 1
        else:
            parallel = _peek_parallel(folder / dirs[0].name / MODEL_FILENAME)
            if parallel is not None:
                second_is_expert = parallel.get("pp", 1) == 1 and parallel.get("ep", 1) > 1
    return detect_layout(folder, second_is_expert)


def find_rank_file(
    folder: Path, tp_rank: int = 0, pp_rank: int = 0, pp_size: int | None = None, ep_rank: int = 0
) -> tuple[Path, Layout]:
    """This rank's file inside an iteration folder and the layout found on disk."""
    layout = saved_layout(folder, pp_size)
    if layout is None:
        raise CheckpointError(
            f"{folder} holds no mp_rank_*/{MODEL_FILENAME}: the save is incomplete or the "
            "folder is not a `torch`-format checkpoint (a torch_dist one has metadata.json)"
        )
    if pp_size is not None and pp_size != layout.pp:
        raise CheckpointError(
            f"checkpoint {folder} was saved with {layout}; this run asks for PP={pp_size}. "
            "Run with the saved pipeline size, or convert the checkpoint (mg-convert "
            "--target-pipeline-parallel-size)."
        )
    path = folder / layout.rank_dirname(tp_rank, pp_rank, ep_rank) / MODEL_FILENAME
    if not path.is_file():
        asked = f"tp_rank {tp_rank}, pp_rank {pp_rank}" + (
            f", ep_rank {ep_rank}" if layout.ep > 1 else ""
        )
        in_range = tp_rank < layout.tp and pp_rank < layout.pp and ep_rank < layout.ep
        hint = (
            "that rank's file is missing (an incomplete copy?)"
            if in_range
            else "run with the saved parallel sizes, or convert the checkpoint (mg-convert "
            "--target-tensor-parallel-size / --target-pipeline-parallel-size)"
        )
        raise CheckpointError(
            f"checkpoint {folder} was saved with {layout}; this run asks for {asked}, "
            f"but {path} does not exist: {hint}"
        )
    return path, layout


def _check_state(state: Any, path: Path) -> dict[str, Any]:
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{path}: expected a state dict, found a {type(state).__name__}; not a Megatron "
            "`torch`-format checkpoint file"
        )
    meta = state.get("mg")
    if meta is not None:
        version = meta.get("format_version") if isinstance(meta, Mapping) else None
        if version != FORMAT_VERSION:
            raise CheckpointError(
                f"{path}: mg format_version {version!r} is not known to this mg-core "
                f"(it reads version {FORMAT_VERSION}); upgrade mg-core to read it"
            )
    return state


def load_checkpoint(
    load_dir: str | Path,
    iteration: Iteration | None = None,
    *,
    tp_rank: int = 0,
    pp_rank: int = 0,
    pp_size: int | None = None,
    ep_rank: int = 0,
    map_location: Any = "cpu",
    allow_pickle: bool = False,
    mmap: bool = False,
) -> tuple[dict[str, Any], Iteration]:
    """Load one rank's state dict; returns ``(state, iteration)``.

    ``iteration=None`` follows ``latest_checkpointed_iteration.txt``. ``pp_size=None``
    takes the pipeline size found on disk. Files load with ``weights_only=True`` and a
    small allowlist; the enums in a Megatron-LM checkpoint's args read as their names
    (see serialization.py); anything else pickled needs ``allow_pickle=True`` — only
    for files you trust. Every
    problem raises :class:`CheckpointError` naming the path and what to do.
    """
    iteration = resolve_iteration(load_dir, iteration)
    folder = iteration_dir(load_dir, iteration)
    path, _ = find_rank_file(folder, tp_rank, pp_rank, pp_size, ep_rank)
    state = load_file(path, map_location=map_location, allow_pickle=allow_pickle, mmap=mmap)
    return _check_state(state, path), iteration


# --------------------------------------------------------------------------- describe


@dataclass
class CheckpointInfo:
    """What a checkpoint folder holds, read from its rank-0 file without copying tensors."""

    path: Path
    iteration: Iteration
    layout: Layout
    files: list[Path]
    total_bytes: int
    checkpoint_version: float | None
    format_version: int | None
    model_config: dict[str, Any] | None
    tokenizer_config: dict[str, Any] | None
    parallel: dict[str, Any] | None
    args: Any = None
    keys: list[str] = field(default_factory=list)


def describe(
    load_dir: str | Path, iteration: Iteration | None = None, *, allow_pickle: bool = False
) -> CheckpointInfo:
    """Summarise a checkpoint: iteration, layout on disk, files and sizes, configs.

    Reads only the rank-0 file, memory-mapped, so tensors are not copied into memory;
    for a `torch_dist` folder, its common.pt (the layout is the one it was saved from).
    """
    iteration = resolve_iteration(load_dir, iteration)
    folder = iteration_dir(load_dir, iteration)
    if is_torch_dist(folder):
        common = load_common(folder)
        parallel = (common.get("mg") or {}).get("parallel") or {}
        layout = Layout(tp=parallel.get("tp", 1), pp=parallel.get("pp", 1))
        return _checkpoint_info(folder, iteration, layout, common)
    path, layout = find_rank_file(folder)
    state = _check_state(load_file(path, allow_pickle=allow_pickle, mmap=True), path)
    return _checkpoint_info(folder, iteration, layout, state)


def _checkpoint_info(
    folder: Path, iteration: Iteration, layout: Layout, state: Mapping[str, Any]
) -> CheckpointInfo:
    """`state`: the rank-0 file's entries, or a torch_dist folder's common.pt."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    meta = state.get("mg") or {}
    return CheckpointInfo(
        path=folder,
        iteration=iteration,
        layout=layout,
        files=files,
        total_bytes=sum(p.stat().st_size for p in files),
        checkpoint_version=state.get("checkpoint_version"),
        format_version=meta.get("format_version"),
        model_config=meta.get("model_config"),
        tokenizer_config=meta.get("tokenizer_config"),
        parallel=meta.get("parallel"),
        args=state.get("args"),
        keys=sorted(state),
    )
