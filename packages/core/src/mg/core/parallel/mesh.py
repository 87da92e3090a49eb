"""The parallel layout: how many ranks per technique, and the device mesh over them.

`ParallelDims` says how the world is split (data × context × tensor ×
pipeline); `ParallelDims.build_mesh()` turns it into a
`torch.distributed.device_mesh.DeviceMesh` with named dims, from which every
technique takes its process group (`mesh.group("tp")`, `mesh.group("dp_cp")`).

Rank order is Megatron's default ("tp-cp-ep-dp-pp"): tensor-parallel ranks are
neighbours (fastest-varying), then context, then data, then pipeline
(slowest), i.e. for a global rank

    rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank

so the mesh is laid out as shape (pp, dp, cp, tp). Every dim exists even at
size 1, so code can always ask for any group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIM_NAMES = ("pp", "dp", "cp", "tp")
"""Mesh dims, slowest- to fastest-varying (Megatron's order reversed)."""

FLATTENED_DIMS = {"dp_cp": ("dp", "cp")}
"""Derived dims: gradients are reduced over data × context ranks."""


class ParallelLayoutError(ValueError):
    """The world size does not split into the requested parallel sizes."""


@dataclass(frozen=True)
class ParallelDims:
    """Sizes of each parallel dimension; `dp` is derived from the world size.

    `ParallelDims.from_world(world_size, tp=2)` computes the data-parallel size
    as Megatron does: world_size / (tp × pp × cp), which must be a whole number.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1) -> ParallelDims:
        for name, size in (("world size", world_size), ("tensor", tp), ("pipeline", pp)):
            if size < 1:
                raise ParallelLayoutError(f"{name} parallel size must be >= 1, got {size}")
        if cp < 1:
            raise ParallelLayoutError(f"context parallel size must be >= 1, got {cp}")
        model_parallel = tp * pp * cp
        if world_size % model_parallel:
            # Megatron's wording (megatron/core/parallel_state.py), plus what to do.
            raise ParallelLayoutError(
                f"world_size ({world_size}) is not divisible by tensor_model_parallel_size "
                f"({tp}) x pipeline_model_parallel_size ({pp}) x context_parallel_size ({cp}); "
                f"launch a multiple of {model_parallel} processes or change "
                "--tensor-model-parallel-size / --pipeline-model-parallel-size / "
                "--context-parallel-size"
            )
        return cls(world_size=world_size, tp=tp, pp=pp, cp=cp, dp=world_size // model_parallel)

    def __post_init__(self) -> None:
        if self.dp * self.cp * self.tp * self.pp != self.world_size:
            raise ParallelLayoutError(
                f"dp ({self.dp}) x cp ({self.cp}) x tp ({self.tp}) x pp ({self.pp}) "
                f"!= world size ({self.world_size}); use ParallelDims.from_world"
            )

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """Mesh shape in MESH_DIM_NAMES order."""
        return (self.pp, self.dp, self.cp, self.tp)

    def coordinates(self, rank: int) -> dict[str, int]:
        """Per-dim rank of a global rank, without any process group (for planning/logs)."""
        coords = {}
        for name, size in zip(reversed(MESH_DIM_NAMES), reversed(self.shape), strict=True):
            coords[name] = rank % size
            rank //= size
        return coords

    def build_mesh(self, device_type: str = "cpu") -> ParallelMesh:
        """The device mesh over all ranks (collective: every rank must call it).

        Needs an initialized default process group whose size equals
        `world_size`; a single process without one gets a private one-rank gloo
        group so the same code runs unchanged.
        """
        if not dist.is_initialized():
            if self.world_size != 1:
                raise RuntimeError(
                    f"ParallelDims.build_mesh: a {self.world_size}-rank mesh needs "
                    "torch.distributed initialized first (launch with torchrun)"
                )
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        actual = dist.get_world_size()
        if actual != self.world_size:
            raise ParallelLayoutError(
                f"ParallelDims is for {self.world_size} ranks but the process group has {actual}"
            )
        mesh = init_device_mesh(device_type, self.shape, mesh_dim_names=MESH_DIM_NAMES)
        for flat_name, parts in FLATTENED_DIMS.items():
            mesh[parts]._flatten(flat_name)
        return ParallelMesh(self, mesh)


@dataclass(frozen=True)
class ParallelMesh:
    """A built mesh: sub-meshes, process groups and this rank's place per dim.

    Names: "pp", "dp", "cp", "tp" and the flattened "dp_cp".
    """

    dims: ParallelDims
    mesh: DeviceMesh

    def __getitem__(self, name: str) -> DeviceMesh:
        """The 1-D sub-mesh of one dim (what DTensor parallel styles take)."""
        self._check(name)
        return self.mesh[name]

    def group(self, name: str) -> ProcessGroup:
        """The process group of this rank along one dim."""
        return self[name].get_group()

    def rank(self, name: str) -> int:
        """This rank's index along one dim."""
        return self[name].get_local_rank()

    def size(self, name: str) -> int:
        self._check(name)
        if name in FLATTENED_DIMS:
            return _product(getattr(self.dims, part) for part in FLATTENED_DIMS[name])
        return getattr(self.dims, name)

    @staticmethod
    def _check(name: str) -> None:
        if name not in MESH_DIM_NAMES and name not in FLATTENED_DIMS:
            known = ", ".join([*MESH_DIM_NAMES, *FLATTENED_DIMS])
            raise KeyError(f"unknown mesh dim {name!r}; known: {known}")


def _product(values) -> int:
    result = 1
    for value in values:
        result *= value
    return result
