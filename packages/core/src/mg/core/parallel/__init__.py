"""Parallelism applied to built models from outside the model code.

`mesh` lays the ranks out (Megatron's tp-cp-dp-pp order) and hands out process
groups; each other module applies one technique to a built model.
"""

from mg.core.parallel.mesh import (
    MESH_DIM_NAMES,
    ParallelDims,
    ParallelLayoutError,
    ParallelMesh,
)

__all__ = ["MESH_DIM_NAMES", "ParallelDims", "ParallelLayoutError", "ParallelMesh"]
