"""The parallel layout: this rank's place in tp × cp × dp × pp and the groups it uses.

One object for every tool that runs a model over several ranks: the trainer,
the evaluator and the server build it with `build_parallel_layout` (a
collective: it creates process groups) and read sizes, ranks and groups from
it. One process without torch.distributed gets `ParallelLayout()`: every size
1, no groups (a group of None means "the whole world" to the data-parallel
code, which is the same thing there).

Random streams follow Megatron (`megatron/training/initialize.py`): the
default generators of pipeline rank p are seeded `seed + 100 * p`
(`stage_seed`), so dropout differs per stage; the tensor-parallel stream of
`mg.core.models.rng_stream` is seeded `stage_seed + 2718 + tp_rank`
(`tensor_parallel_seed`). Weights are initialised before that from the plain
`seed`, so every layout starts from the single-process model's values
(`mg.core.parallel.materialize`).

Expert parallelism (`ep`, `etp`) is part of the layout for the MoE layers:
Megatron-Core's expert groups (`mg.core.parallel.expert_parallel`), drawn from
the tp × cp × dp ranks of each pipeline stage. An expert tensor-parallel size
that divides tp splits the experts over `etp_mesh`, etp consecutive ranks of
the tensor-parallel group (all of it at etp = tp, none at etp = 1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from mg.core.parallel.expert_parallel import expert_rank_groups
from mg.core.parallel.mesh import ParallelDims
from mg.core.parallel.pipeline import embedding_group_ranks


@dataclass
class ParallelLayout:
    """Sizes, this rank's index along each, and the process groups of one run."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    tp_rank: int = 0
    pp_rank: int = 0
    cp_rank: int = 0
    dp_rank: int = 0
    ep_rank: int = 0
    virtual: int = 1
    """Model chunks per pipeline rank (the interleaved schedule's v)."""
    sequence_parallel: bool = False
    dp_group: dist.ProcessGroup | None = None
    """Data-parallel replicas of this rank's shard (None: the whole world)."""
    dp_cp_group: dist.ProcessGroup | None = None
    """Data × context ranks: gradients are averaged over them."""
    pp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    etp: int = 1
    """Expert tensor-parallel size (`--expert-tensor-parallel-size`; tp unless given)."""
    etp_rank: int = 0
    expert_dp: int = 1
    expert_dp_rank: int = 0
    etp_group: dist.ProcessGroup | None = None
    etp_mesh: DeviceMesh | None = None
    """The mesh the routed experts are split over: tp_mesh at etp = tp, a sub-mesh of it
    for 1 < etp < tp, None at etp = 1 (experts whole)."""
    expert_dp_group: dist.ProcessGroup | None = None
    """Replicas of this rank's experts: their gradients are averaged over it."""
    embedding_group: dist.ProcessGroup | None = None
    """First and last pipeline stage, which hold the tied embedding's two copies."""
    tp_mesh: DeviceMesh | None = None
    stage_group: dist.ProcessGroup | None = None
    """Every tp × cp × dp rank of this pipeline stage, with etp ≠ tp only: the ranks whose
    MoE layers each route a slice of the stage's tokens (expert-bias counts)."""
    tp_cp_group: dist.ProcessGroup | None = None
    """Tensor × context ranks of this data-parallel replica, with etp ≠ tp and cp > 1 only:
    the ranks holding one sequence's slices, over which the routers count its tokens."""

    @property
    def experts_apart(self) -> bool:
        """The routed experts are laid out apart from the dense weights (expert parallelism,
        or an expert tensor-parallel size other than tp): their gradients are reduced over
        the expert data-parallel group, their norm over the expert-parallel group."""
        return self.ep > 1 or self.etp != self.tp

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def writes_checkpoint(self) -> bool:
        """One rank per (tp, pp) shard writes it: data- and context-parallel rank 0; with
        the experts apart one per (tp, pp, ep) shard (Megatron's `mp_rank_TT_PPP_EEE`):
        data- or expert-data-parallel rank 0, as Megatron-LM's legacy save picks them, which
        covers every pair when the two layouts differ (--expert-tensor-parallel-size 1)."""
        writer = self.dp_rank == 0 or (self.experts_apart and self.expert_dp_rank == 0)
        return writer and self.cp_rank == 0

    @property
    def shard_name(self) -> str:
        """This rank's (tensor, pipeline) position, as checkpoints name per-shard state."""
        return f"tp{self.tp_rank}_pp{self.pp_rank}"

    def stage_seed(self, seed: int) -> int:
        """Megatron's seed of this pipeline stage's default generators."""
        return seed + 100 * self.pp_rank

    def tensor_parallel_seed(self, seed: int) -> int:
        """Megatron's model-parallel RNG seed (dropout inside tensor-parallel regions)."""
        return self.stage_seed(seed) + 2718 + self.tp_rank

    def describe(self) -> str:
        """Where this rank is, for messages (empty without pipeline parallelism)."""
        return f"pipeline stage {self.pp_rank} of {self.pp}" if self.pp > 1 else ""

    def sizes_line(self) -> str:
        """Megatron's start-up line (`megatron/training/arguments.py`)."""
        context = f"context-parallel size: {self.cp}, " if self.cp > 1 else ""
        return (
            f"using world size: {self.world_size}, data-parallel size: {self.dp}, {context}"
            f"tensor-model-parallel size: {self.tp}, pipeline-model-parallel size: {self.pp}"
        )


def build_parallel_layout(
    world_size: int,
    rank: int,
    *,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    virtual: int = 1,
    sequence_parallel: bool = False,
    tied_embedding: bool = False,
    device_type: str = "cpu",
    ep: int = 1,
    etp: int | None = None,
) -> ParallelLayout:
    """The layout of `world_size` ranks in Megatron's tp-cp-dp-pp order (collective).

    Raises `ParallelLayoutError` when the world does not split. With one rank
    no process group is created. `tied_embedding` creates Megatron's embedding
    groups (first and last stage of each pipeline) when pp > 1."""
    dims = ParallelDims.from_world(world_size, tp=tp, pp=pp, cp=cp)
    if world_size == 1:
        return ParallelLayout(virtual=virtual, sequence_parallel=sequence_parallel)
    mesh = dims.build_mesh(device_type)
    coords = dims.coordinates(rank)
    layout = ParallelLayout(
        tp=tp,
        pp=pp,
        cp=cp,
        dp=dims.dp,
        tp_rank=coords["tp"],
        pp_rank=coords["pp"],
        cp_rank=coords["cp"],
        dp_rank=coords["dp"],
        virtual=virtual,
        sequence_parallel=sequence_parallel,
        dp_group=mesh.group("dp"),
        dp_cp_group=mesh.group("dp_cp"),
        pp_group=mesh.group("pp"),
        cp_group=mesh.group("cp"),
        tp_mesh=mesh["tp"],
        etp=tp,
        etp_mesh=mesh["tp"],
    )
    if pp > 1 and tied_embedding:
        # new_group is collective over the world: create every pipeline's pair, keep ours
        per_stage = world_size // pp
        pairs = [
            embedding_group_ranks([offset + s * per_stage for s in range(pp)])
            for offset in range(per_stage)
        ]
        layout.embedding_group, _ = new_groups(pairs, rank)
    if ep > 1 or (etp is not None and etp != tp):
        _add_expert_groups(layout, world_size, rank, ep, tp if etp is None else etp, device_type)
    return layout


def _add_expert_groups(
    layout: ParallelLayout, world_size: int, rank: int, ep: int, etp: int, device_type: str
) -> None:
    """Megatron's expert groups (collective: every rank creates every group, keeps its own)."""
    groups = expert_rank_groups(world_size, tp=layout.tp, pp=layout.pp, ep=ep, etp=etp)
    layout.ep, layout.etp = ep, etp
    layout.expert_dp = world_size // (layout.pp * ep * etp)
    if etp != layout.tp:  # each rank routes its own tokens: expert-bias counts over the stage
        per_stage = world_size // layout.pp
        stages = [list(range(k * per_stage, (k + 1) * per_stage)) for k in range(layout.pp)]
        layout.stage_group, _ = new_groups(stages, rank)
        if layout.cp > 1:  # one sequence's slices: the tensor x context ranks of a replica
            size = layout.tp * layout.cp
            blocks = [list(range(k, k + size)) for k in range(0, world_size, size)]
            layout.tp_cp_group, _ = new_groups(blocks, rank)
    for kind, attr, index in (
        ("ep", "ep_group", "ep_rank"),
        ("etp", "etp_group", "etp_rank"),
        ("edp", "expert_dp_group", "expert_dp_rank"),
    ):
        group, ranks = new_groups(groups[kind], rank)
        if group is not None:
            setattr(layout, attr, group)
            setattr(layout, index, ranks.index(rank))
    if etp == 1:
        layout.etp_mesh = None
    elif etp != layout.tp:  # etp consecutive ranks of the tensor-parallel group
        layout.etp_mesh = DeviceMesh.from_group(
            layout.etp_group, device_type, mesh_dim_names=("etp",)
        )


def new_groups(
    rank_lists: list[list[int]], rank: int
) -> tuple[dist.ProcessGroup | None, list[int] | None]:
    """Every group of `rank_lists`, created in order on every rank (`new_group` is
    collective over the world), and this rank's: (its group, its ranks), or (None, None)
    where it is in none."""
    mine, my_ranks = None, None
    for ranks in rank_lists:
        group = dist.new_group(ranks)
        if rank in ranks:
            mine, my_ranks = group, ranks
    return mine, my_ranks
