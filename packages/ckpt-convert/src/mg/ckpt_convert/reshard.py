"""`mg-convert reshard`: a `torch`-format checkpoint in another TP × PP layout.

Like Megatron's ``tools/checkpoint/convert.py`` with ``--target-tensor-parallel-size``
/ ``--target-pipeline-parallel-size``, but in one process and streaming by
pipeline stage: the source files are memory-mapped, and for each target stage
only that stage's tensors are joined (TP shards merged), split into the target
TP shards and written, so about one stage is in memory at a time. The result is
committed atomically (staging folder, then rename, tracker last) and keeps the
iteration, args (with the new sizes), model and tokenizer configs; optimizer
and RNG state are dropped with a printed note (their layout depends on the
parallel layout).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from mg.ckpt_convert.checkpoint_source import (
    CheckpointSource,
    copy_tokenizer_files,
    open_checkpoint,
)
from mg.ckpt_convert.errors import ConvertError
from mg.ckpt_convert.layout_plan import (
    TargetLayout,
    expert_layout_name,
    plan_target,
    target_state,
    target_tensors,
)
from mg.ckpt_convert.staging import check_target, staged_dir
from mg.core.checkpoint import save_checkpoint_shards
from mg.core.checkpoint.dist_format import load_common
from mg.core.checkpoint.ep_merge import split_expert_parallel
from mg.core.checkpoint.layout import Iteration
from mg.core.checkpoint.pp_split import stage_key_map
from mg.core.checkpoint.tp_split import split_tensor_parallel


class _StageShards(Mapping[tuple[int, int, int], dict[str, Any]]):
    """The target's rank states, built one pipeline stage at a time as they are read.

    Keys ``(tp, pp, ep)`` run stage by stage, then TP rank, then expert-parallel rank,
    so `save_checkpoint_shards` (which reads the values in key order and writes each
    before the next) holds one stage's tensors at a time.
    """

    def __init__(
        self,
        source: CheckpointSource,
        target: TargetLayout,
        common: dict[str, Any],
        rename: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
    ):
        self.source, self.target, self.common, self.rename = source, target, common, rename
        self._keys = [
            (t, p, e) for p in range(target.pp) for t in range(target.tp) for e in range(target.ep)
        ]
        self._stage: int | None = None
        self._shards: list[list[dict[str, Tensor]]] = []

    def __iter__(self) -> Iterator[tuple[int, int, int]]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, key: tuple[int, int, int]) -> dict[str, Any]:
        tp_rank, pp_rank, ep_rank = key
        if self._stage != pp_rank:
            self._shards = []  # free the previous stage before building this one
            self._shards = self._build(pp_rank)
            self._stage = pp_rank
        return {**self.common, "model": self._shards[ep_rank][tp_rank]}

    def _build(self, pp_rank: int) -> list[list[dict[str, Tensor]]]:
        """[ep rank][tp rank] → that rank file's model state for this stage."""
        config = self.target.config
        names = stage_key_map(
            self.source.names,
            config.num_layers,
            self.target.pp,
            pp_rank,
            tied=not config.untie_embeddings_and_output_weights,
        )
        self.source.release()  # the previous stage's files
        tensors = target_tensors(self.source, self.target, list(dict.fromkeys(names.values())))
        grouped = config.moe_grouped_gemm
        if grouped != self.source.config.moe_grouped_gemm:  # the other experts layout
            names = {expert_layout_name(local, grouped): name for local, name in names.items()}
        whole = {local: tensors[name] for local, name in names.items()}
        per_ep = (
            split_expert_parallel(whole, config.num_moe_experts, self.target.ep)
            if self.target.ep > 1
            else [whole]
        )
        gated = config.gated_linear_unit
        shards = [split_tensor_parallel(part, self.target.tp, gated, config) for part in per_ep]
        if self.rename is not None:  # the names the target's reader expects
            shards = [[self.rename(shard) for shard in per_tp] for per_tp in shards]
        return shards


def sizes(tp: int, pp: int, ep: int = 1) -> str:
    """ "TP=2, PP=1" (and ", EP=4" for an expert-parallel layout)."""
    return f"TP={tp}, PP={pp}" + (f", EP={ep}" if ep > 1 else "")


def write_torch(
    save_dir: Path,
    source: CheckpointSource,
    target: TargetLayout,
    iteration: Iteration,
    common: dict[str, Any] | None = None,
    rename: Callable[[dict[str, Tensor]], dict[str, Tensor]] | None = None,
) -> Path:
    """Write ``source`` as a `torch` checkpoint in the target layout; the iteration folder.

    ``common`` (every rank file's entries besides the model) defaults to the source's,
    updated to the target layout; ``rename`` maps each rank file's model state to the
    names the target's reader expects (Megatron's Transformer Engine names, say)."""
    if common is None:
        common = target_state(source, target)
    shards = _StageShards(source, target, common, rename)
    path = save_checkpoint_shards(
        save_dir, iteration, shards, tp_size=target.tp, pp_size=target.pp, ep_size=target.ep
    )
    copy_tokenizer_files(source, save_dir)
    return path


def reshard(
    load: str | Path,
    save: str | Path,
    tp: int | None,
    pp: int | None,
    iteration: Iteration | None = None,
    divisible_by: int | None = None,
    report: Any = print,
    ep: int | None = None,
) -> Path:
    """``load`` (a `torch` checkpoint, or a Megatron-LM `torch_dist` one) → ``save`` with TP
    ``tp``, PP ``pp`` and, for an MoE, EP ``ep`` (None: keep) in the `torch` format."""
    check_target(save)
    source = open_checkpoint(load, iteration)
    if source.format != "torch" and "mg" in load_common(source.folder, allow_pickle=True):
        raise ConvertError(
            f"{source.folder} is a torch_dist checkpoint, which loads into any layout already; "
            "to get a `torch` checkpoint of a given layout use: mg-convert format --to torch "
            "--target-tensor-parallel-size T --target-pipeline-parallel-size P"
        )
    target = plan_target(source, tp, pp, divisible_by, ep)
    with staged_dir(save) as staging:
        write_torch(staging, source, target, source.iteration)
    report(
        f"resharded iteration {source.iteration}: {sizes(source.tp, source.pp, source.ep)} → "
        f"{sizes(target.tp, target.pp, target.ep)}"
    )
    for note in target.notes:
        report(f"note: {note}")
    return Path(save)
