"""Open an mg checkpoint of any format and layout as one whole model, read lazily.

`torch` format: the ``mp_rank_TT[_PPP]/model_optim_rng.pt`` files are opened
once to learn the names, shapes and dtypes of their tensors; the pipeline
stages' local layer names are mapped to the whole model's
(:mod:`mg.core.checkpoint.pp_split`, virtual stages ``model0``, ``model1``…
included). `torch_dist`: names, shapes and dtypes come from DCP's index. Either
way no tensor data is read until :meth:`CheckpointSource.tensors` asks for it,
a tensor's TP shards are joined then, and :meth:`CheckpointSource.release`
lets go of what was read (:mod:`.tensor_readers`), so a converter that walks
the model layer by layer holds about one layer.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.megatron_args import megatron_source_state
from mg.ckpt_convert.tensor_readers import (
    MODEL_PREFIX,
    DistReader,
    ShardRef,
    TensorReader,
    TorchFilesReader,
    model_chunks,
)
from mg.core.checkpoint import MODEL_FILENAME, find_rank_file
from mg.core.checkpoint.dist_format import is_torch_dist, load_common
from mg.core.checkpoint.ep_merge import (
    is_routed_expert,
    merge_expert_parallel,
    rank_files_present,
    whole_expert_sources,
    with_dense_from,
)
from mg.core.checkpoint.layout import Iteration, Layout, detect_layout, scan_rank_dirs
from mg.core.checkpoint.megatron_dist import is_megatron_layout, stored_parameters
from mg.core.checkpoint.pp_split import merge_pipeline
from mg.core.checkpoint.reader_guard import read_dcp_metadata
from mg.core.checkpoint.serialization import load_file
from mg.core.checkpoint.torch_format import iteration_dir, resolve_iteration
from mg.core.checkpoint.tp_merge import merge_tensor_parallel
from mg.core.models import ConfigError, TransformerConfig
from mg.core.models.mamba import decoder_config_from_dict, decoder_model

# Entries that describe one rank's optimizer or random state: their layout depends on
# the parallel layout, so a conversion drops them (Megatron's converter does the same).
LAYOUT_BOUND = ("optimizer", "rng_state")
TOKENIZER_PATH_FIELDS = ("vocab_file", "merge_file", "tokenizer_model")

ConfigReader = Callable[[Mapping[str, Any], Path], TransformerConfig]


@dataclass
class CheckpointSource:
    """A checkpoint's whole-model view: names, configs, and tensors joined on demand."""

    load_dir: Path
    folder: Path
    iteration: Iteration
    format: str  # "torch" or "torch_dist"
    tp: int
    pp: int
    config: TransformerConfig
    state: dict[str, Any]
    """Rank 0's entries other than the model and the layout-bound ones (args, mg, …)."""
    dropped: list[str]
    """Layout-bound entries the source has (and a conversion leaves out)."""
    shards: dict[str, list[Tensor]] = field(repr=False)
    """Whole-model name → its tensor-parallel shards in rank order ([whole] if unsplit),
    on the meta device: shapes and dtypes, no data."""
    reader: TensorReader = field(repr=False)
    ep: int = 1
    """Expert-parallel ranks the `torch` files were saved with (their experts merged here)."""

    @property
    def names(self) -> list[str]:
        return list(self.shards)

    def meta(self, name: str) -> Tensor:
        """The whole tensor ``name`` on the meta device (its shape and dtype, nothing read)."""
        return self._join(name, self.shards[name])

    def tensors(self, names: Sequence[str]) -> dict[str, Tensor]:
        """The whole tensors ``names`` (TP shards joined along Megatron's partition dims)."""
        parts = self.reader.read(list(names))
        return {name: self._join(name, parts[name]) for name in names}

    def tensor(self, name: str) -> Tensor:
        return self.tensors([name])[name]

    def release(self) -> None:
        """Let go of the files read so far (the tensors returned stay valid)."""
        self.reader.release()

    def _join(self, name: str, parts: list[Tensor]) -> Tensor:
        if len(parts) == 1:
            return parts[0]
        merged = merge_tensor_parallel(
            [{name: p} for p in parts], self.config.gated_linear_unit, self.config
        )
        return merged[name]

    @property
    def args(self) -> dict[str, Any]:
        raw = self.state.get("args")
        return vars(raw) if isinstance(raw, argparse.Namespace) else dict(raw or {})


def open_checkpoint(
    load_dir: str | Path, iteration: Iteration | None = None, *, check_gpt: bool = True
) -> CheckpointSource:
    """Open ``load_dir`` (latest iteration unless given); with `check_gpt`, checks that it
    holds a whole GPT model (reshard and format conversion need one; export also reads BERT)."""
    load_dir = Path(load_dir)
    iteration = resolve_iteration(load_dir, iteration)
    folder = iteration_dir(load_dir, iteration)
    if is_torch_dist(folder):
        source = _open_torch_dist(load_dir, folder, iteration)
    else:
        source = open_torch_files(load_dir, folder, iteration, recorded_config)
    if check_gpt:
        _check_names(source)
    return source


def recorded_config(state: Mapping[str, Any], where: Path) -> TransformerConfig:
    """The model config an mg checkpoint records under ``mg.model_config``."""
    meta = state.get("mg") or {}
    if not meta.get("model_config"):
        raise ConvertError(
            f"{where} records no model config (state['mg']['model_config']); it was not written "
            "by mg tools. For a Megatron-LM checkpoint run `mg-convert import-megatron` first."
        )
    try:
        config = decoder_config_from_dict(dict(meta["model_config"]))  # or a MambaConfig
    except ConfigError as exc:
        raise ConvertError(f"{where}: the recorded model config is not valid: {exc}") from None
    return config


def _owned(value: Any) -> Any:
    """A copy of small state in which no tensor still points into a memory-mapped file
    (one such tensor would keep the whole file mapped)."""
    if isinstance(value, Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _owned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_owned(v) for v in value)
    return value


def _other_entries(state: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Rank 0's entries but the model and layout-bound ones; which layout-bound ones it had."""
    dropped = [k for k in LAYOUT_BOUND if state.get(k)]
    kept = {
        k: _owned(v)
        for k, v in state.items()
        if not k.startswith("model") and k not in LAYOUT_BOUND
    }
    return kept, dropped


def _open_torch_dist(load_dir: Path, folder: Path, iteration: Iteration) -> CheckpointSource:
    """A torch_dist folder of either key layout, written by mg or by Megatron-LM (whose
    model config comes from its args, as for import-megatron)."""
    common = load_common(folder, allow_pickle=True)  # Megatron-LM's args: see import-megatron
    metadata = read_dcp_metadata(folder)
    index = metadata.state_dict_metadata
    stored = None
    state, dropped = _other_entries(common)
    dropped += [k for k in _stored_layout_bound(index) if k not in dropped]
    if (common.get("mg") or {}).get("model_config"):
        config = recorded_config(common, folder)
        parallel = (common.get("mg") or {}).get("parallel") or {}
        tp, pp = int(parallel.get("tp", 1)), int(parallel.get("pp", 1))
    else:  # Megatron-LM's: its args say what the model is
        config, state, tp, pp = megatron_source_state(common, folder)
    if is_megatron_layout(metadata):  # routed experts named as the config builds them
        stored = stored_parameters(metadata, bool(getattr(config, "moe_grouped_gemm", False)))
        metas = {
            name: torch.empty(where.shape, dtype=where.dtype, device="meta")
            for name, where in stored.items()
        }
    else:
        metas = {
            key[len(MODEL_PREFIX) :]: torch.empty(
                meta.size, dtype=meta.properties.dtype, device="meta"
            )
            for key, meta in index.items()
            if key.startswith(MODEL_PREFIX) and isinstance(meta, TensorStorageMetadata)
        }
    return CheckpointSource(
        load_dir,
        folder,
        iteration,
        "torch_dist",
        tp,
        pp,
        config,
        state,
        dropped,
        {name: [meta] for name, meta in metas.items()},
        DistReader(folder, metas, stored),
    )


def _stored_layout_bound(index: Mapping[str, Any]) -> list[str]:
    """The layout-bound entries a torch_dist index holds (optimizer state, generators)."""
    found = []
    if any(k.startswith("optimizer.") for k in index):
        found.append("optimizer")
    if any(k.startswith(("rng_state", "rng.")) for k in index):
        found.append("rng_state")
    return found


def open_torch_files(
    load_dir: Path,
    folder: Path,
    iteration: Iteration,
    config_of: ConfigReader,
    *,
    rename: Callable[[str], str] | None = None,
    allow_pickle: bool = False,
) -> CheckpointSource:
    """A `torch`-format iteration folder of any TP × PP × EP layout as a whole model.

    ``config_of(rank-0 state, its path)`` gives the model config (recorded by mg,
    or derived from Megatron-LM's args); ``rename`` maps a stored tensor name to the
    name the model uses (Transformer Engine's fused-norm names, for one).
    ``allow_pickle`` is for files that pickle more than plain data (Megatron-LM's).
    Expert-parallel ranks (``mp_rank_TT[_PPP]_EEE``) hold the dense weights alike and
    their own experts numbered from 0; their experts are renumbered to their place in
    the layer (:func:`mg.core.checkpoint.ep_merge.merge_expert_parallel`). With
    --expert-tensor-parallel-size 1 the experts are whole in every file and are read once,
    from whichever file holds each expert-parallel rank's.
    """
    dirs = scan_rank_dirs(folder)
    if not dirs:
        find_rank_file(folder)  # raises the format's own message
    first_path = folder / dirs[0].name / MODEL_FILENAME  # TP, PP and EP rank 0
    first_state: Mapping[str, Any] = load_file(first_path, mmap=True, allow_pickle=allow_pickle)
    # mp_rank_TT_NNN is PP or EP: the rank-0 file says which (Megatron's args, or mg's)
    layout = detect_layout(folder, _second_is_expert(first_state))
    assert layout is not None
    config = config_of(first_state, first_path)
    experts = config.num_moe_experts
    etp = _recorded_args(first_state).get("expert_tensor_parallel_size")
    if experts and etp is not None and int(etp) not in (1, layout.tp):
        raise ConvertError(
            f"{folder} was saved with {layout} and --expert-tensor-parallel-size {etp}; "
            "converting reads experts whole (1) or split over TP as the MLP is (= TP). "
            "Save it with --ckpt-format torch_dist, which loads at any layout"
        )
    # expert TP 1 under TP > 1: each file's experts are whole, and only the files some
    # writer held exist (Megatron-LM's legacy save: data- or expert-data-parallel rank 0)
    whole = bool(experts) and etp is not None and int(etp) == 1 and layout.tp > 1
    present = rank_files_present([d.numbers for d in dirs], layout.pp, layout.ep)
    try:
        dense_ep, experts_tp = whole_expert_sources(present, layout.tp, layout.pp, layout.ep)
    except KeyError as missing:
        raise ConvertError(f"{folder}: {missing.args[0]}: the checkpoint is incomplete") from None
    if layout.ep > 1 and (not experts or experts % layout.ep):
        raise ConvertError(
            f"{folder} was saved with {layout}, but its model has {experts or 'no'} experts "
            "per MoE layer: the checkpoint is inconsistent"
        )
    # stages[pp_rank][chunk][name] -> [(ref, meta) of tp rank 0, 1, ...]
    stages: list[list[dict[str, list[tuple[ShardRef, Tensor]]]]] = []
    for pp_rank in range(layout.pp):
        chunks: list[dict[str, list[tuple[ShardRef, Tensor]]]] | None = None
        for tp_rank in range(layout.tp):
            per_ep = [
                _rank_tensors(
                    folder,
                    layout,
                    (experts_tp[(e, pp_rank)] if whole else tp_rank, pp_rank, e),
                    rename,
                    allow_pickle,
                )
                for e in range(layout.ep)
            ]
            path = per_ep[0][0]
            if any(len(models) != len(per_ep[0][1]) for _, models in per_ep):
                raise ConvertError(
                    f"{folder}: the expert-parallel ranks of {path.parent.name} hold different "
                    "numbers of model chunks: the checkpoint is inconsistent"
                )
            models = [
                merge_expert_parallel(parts, experts) if layout.ep > 1 else parts[0]
                for parts in zip(*(m for _, m in per_ep), strict=True)
            ]
            if whole:  # this TP rank's dense shards, from a file of its own
                rank = (tp_rank, pp_rank, dense_ep[(tp_rank, pp_rank)])
                path, dense = _rank_tensors(folder, layout, rank, rename, allow_pickle)
                if len(dense) != len(models):
                    raise ConvertError(
                        f"{path} holds {len(dense)} model chunks, its expert-parallel ranks "
                        f"{len(models)}: the checkpoint is inconsistent"
                    )
                models = [with_dense_from(m, d) for m, d in zip(models, dense, strict=True)]
            if chunks is None:
                chunks = [{} for _ in models]
            if len(models) != len(chunks):
                raise ConvertError(
                    f"{path} holds {len(models)} model chunks, tensor-parallel rank 0 of the "
                    f"same stage {len(chunks)}: the checkpoint is inconsistent"
                )
            for chunk, tensors in zip(chunks, models, strict=True):
                if tp_rank and set(chunk) != set(tensors):
                    raise ConvertError(
                        f"{path} holds other tensors than tensor-parallel rank 0 of the same "
                        "stage: the checkpoint is inconsistent"
                    )
                for name, ref_meta in tensors.items():
                    if whole and tp_rank and is_routed_expert(name):
                        continue  # whole on every TP rank: one copy
                    chunk.setdefault(name, []).append(ref_meta)
        stages.append(chunks or [])
    state, dropped = _other_entries(first_state)
    del first_state  # its tensors point into the mapped file
    tied = not config.untie_embeddings_and_output_weights
    try:
        merged = merge_pipeline(stages, config.num_layers, tied=tied)
    except ValueError as exc:
        raise ConvertError(f"{folder}: {exc}") from None
    reader = TorchFilesReader(
        {name: [ref for ref, _ in parts] for name, parts in merged.items()}, allow_pickle
    )
    return CheckpointSource(
        load_dir,
        folder,
        iteration,
        "torch",
        layout.tp,
        layout.pp,
        config,
        state,
        dropped,
        {name: [meta for _, meta in parts] for name, parts in merged.items()},
        reader,
        layout.ep,
    )


def _recorded_args(state: Mapping[str, Any]) -> Mapping[str, Any]:
    """A rank file's args: Megatron-LM's Namespace or mg's dict (empty if neither)."""
    raw = state.get("args")
    args = vars(raw) if isinstance(raw, argparse.Namespace) else raw
    return args if isinstance(args, Mapping) else {}


def _second_is_expert(state: Mapping[str, Any]) -> bool | None:
    """Whether an ``mp_rank_TT_NNN`` name counts expert-parallel ranks (PP = 1, EP > 1),
    from what the rank-0 file records (mg's ``parallel``, or Megatron-LM's args)."""
    parallel = (state.get("mg") or {}).get("parallel")
    if not parallel:
        args = _recorded_args(state)
        if not args:
            return None
        parallel = {
            "pp": args.get("pipeline_model_parallel_size") or 1,
            "ep": args.get("expert_model_parallel_size") or 1,
        }
    return parallel.get("pp", 1) == 1 and parallel.get("ep", 1) > 1


def _rank_tensors(
    folder: Path,
    layout: Layout,
    rank: tuple[int, int, int],
    rename: Callable[[str], str] | None,
    allow_pickle: bool,
) -> tuple[Path, list[dict[str, tuple[ShardRef, Tensor]]]]:
    """One rank file's path and, per model chunk, {name: (where it is, its meta tensor)}."""
    tp_rank, pp_rank, ep_rank = rank
    path = folder / layout.rank_dirname(tp_rank, pp_rank, ep_rank) / MODEL_FILENAME
    if not path.is_file():
        find_rank_file(folder, tp_rank, pp_rank, layout.pp, ep_rank)  # names what is missing
        raise ConvertError(f"{path} is missing: the checkpoint is incomplete")
    state = load_file(path, mmap=True, allow_pickle=allow_pickle)
    models = [
        {
            (rename(k) if rename else k): (
                ShardRef(path, c, k),
                torch.empty_like(v, device="meta"),
            )
            for k, v in model.items()
            if not k.endswith("_extra_state") and isinstance(v, Tensor)
        }
        for c, model in enumerate(model_chunks(state, path))
    ]
    return path, models


def _check_names(source: CheckpointSource) -> None:
    with torch.device("meta"):
        expected = decoder_model(source.config).state_dict()  # GPTModel or MambaModel
    unexpected = [n for n in source.names if n not in expected]
    missing = [n for n in expected if n not in source.shards]
    if unexpected or missing:
        raise ConvertError(
            f"{source.folder}: the weights do not fit the GPT model its config describes "
            f"(unexpected {unexpected[:4]}, missing {missing[:4]}); only GPT-family "
            "checkpoints can be converted"
        )


def copy_tokenizer_files(source: CheckpointSource, target: Path) -> None:
    """Copy tokenizer files the config names relative to the source folder (kept relative)."""
    tokenizer = (source.state.get("mg") or {}).get("tokenizer_config") or {}
    for name in TOKENIZER_PATH_FIELDS:
        value = tokenizer.get(name)
        if not value or Path(value).is_absolute():
            continue
        top = Path(value).parts[0]  # the whole folder (tokenizer/), not just the named file
        src, dst = source.load_dir / top, target / top
        if dst.exists() or not src.exists():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
