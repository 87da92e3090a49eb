"""Tensor (and sequence) parallelism for a Mamba layer: megatron-core 0.16.1's MambaMixer.

Megatron splits the mixer by heads and groups (`nheads % tp == 0`,
`ngroups % tp == 0`), so every rank runs the whole SSD scan for its own heads
with their groups' B and C, and only the projections communicate:

    mixer.in_proj       column-parallel: rank r's rows are [z_r; x_r; B_r; C_r; dt_r],
                        the r-th slice of each of the five blocks (`row_blocks`)
    mixer.conv1d        its [x_r; B_r; C_r] channels (weight and bias), likewise
    mixer.dt_bias, A_log, D          this rank's heads
    mixer.norm.weight   this rank's channels: the gated RMSNorm is per group, and
                        whole groups stay on a rank, so each rank's norm is complete
    mixer.out_proj      row-parallel (output all-reduced, or reduce-scattered)

With sequence parallelism the layer norm before the mixer works on this rank's
slice of the sequence; in_proj all-gathers it and out_proj reduce-scatters,
as around attention. The mixer reads its small parameters through `local()`
(their local shards) and its counts are set to the local ones here.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

from mg.core.models.mamba.mixer import MambaMixer
from mg.core.parallel.row_blocks import shard_row_blocks
from mg.core.parallel.row_parallel import RowParallelLinear


class RowBlockColwiseParallel(ColwiseParallel):
    """Column parallelism for a fused linear whose shard is a slice of each row block."""

    def __init__(self, blocks: tuple[int, ...], **kwargs) -> None:
        super().__init__(**kwargs)
        self.blocks = blocks

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        shard_row_blocks(module, "weight", device_mesh, self.blocks)


def in_proj_blocks(mixer: MambaMixer) -> tuple[int, ...]:
    """[z; x; B; C; dt] rows of the whole in_proj."""
    bc = mixer.num_groups * mixer.state_dim
    return (mixer.d_inner, mixer.d_inner, bc, bc, mixer.num_heads)


def conv_blocks(mixer: MambaMixer) -> tuple[int, ...]:
    """[x; B; C] channels of the whole conv1d."""
    bc = mixer.num_groups * mixer.state_dim
    return (mixer.d_inner, bc, bc)


def parallelize_mamba_layer(
    layer: nn.Module, tp_mesh: DeviceMesh, activations: Shard | Replicate, sequence_parallel: bool
) -> None:
    """Megatron's layout for one MambaLayer (norm → mixer), in place."""
    mixer: MambaMixer = layer.mixer
    tp = tp_mesh.size()
    plan: dict[str, object] = {
        "mixer.in_proj": RowBlockColwiseParallel(in_proj_blocks(mixer), input_layouts=activations),
        "mixer.out_proj": RowParallelLinear(output_layouts=activations),
    }
    if sequence_parallel:  # the norm's weight sees a slice: its gradient is a partial sum
        plan["norm"] = SequenceParallel(use_local_output=True)
    blocks = conv_blocks(mixer)
    parallelize_module(layer, tp_mesh, plan, src_data_rank=None)
    for name in ("weight", "bias"):
        if getattr(mixer.conv1d, name, None) is not None:
            shard_row_blocks(mixer.conv1d, name, tp_mesh, blocks)
    for module, name in (
        (mixer, "dt_bias"),
        (mixer, "A_log"),
        (mixer, "D"),
        (mixer.norm, "weight"),
    ):
        param = getattr(module, name)
        dtensor = distribute_tensor(param.detach(), tp_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(dtensor, requires_grad=param.requires_grad))
    mixer.num_heads //= tp
    mixer.num_groups //= tp
    mixer.d_inner //= tp
    mixer.conv_dim //= tp
