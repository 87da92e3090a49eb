"""Multi-latent attention under tensor (and sequence) parallelism: heads split, latents whole.

Megatron's layout for `MLASelfAttention`: each rank holds heads / tp of the heads.

    linear_q_proj, linear_q_up_proj, linear_kv_up_proj   column-parallel by heads
    linear_proj                                          row-parallel
    linear_q_down_proj, linear_kv_down_proj,             replicated: every rank computes
    q_layernorm, kv_layernorm                            the whole (small) latents

With sequence parallelism the layer's input is all-gathered along the sequence on entry,
as Megatron gathers it before its first column-parallel linear (Megatron-Core's local
spec computes the down projections column-parallel and gathers their outputs; the
numbers are the same).

Gradients: everything the heads compute from the latents comes back as a partial sum per
rank (each saw only its heads). For the latents that enter a column-parallel up
projection the DTensor input of ColwiseParallel sums them; the positional key, shared by
all heads, enters the per-head part through `k_pos_emb_to_heads`, which becomes
Megatron's copy-to-tensor-parallel-region here: identity forward, all-reduce backward.
So the replicated projections and norms get whole, equal gradients on every rank and
need no reduction of their own.

Under the TE spec an up projection holding its latent's norm (`LayerNormLinear`) is split
by `LayerNormColwiseParallel` without sequence parallelism (its input is the whole
latent): the norm stays whole and its gradient is whole on every rank, as the separate
norm's is.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

from mg.core.models.mla import MLASelfAttention
from mg.core.models.te_spec import LayerNormLinear
from mg.core.parallel.row_parallel import RowParallelLinear
from mg.core.parallel.tensor_parallel_te import LayerNormColwiseParallel


class CopyToTensorParallelRegion(nn.Module):
    """Identity forward; backward sums the gradient over the tensor-parallel ranks
    (Megatron's `copy_to_tensor_model_parallel_region`)."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        super().__init__()
        self.tp_mesh = tp_mesh

    def forward(self, x: Tensor) -> Tensor:
        replicated = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        return replicated.to_local(grad_placements=[Partial()])


def mla_tensor_parallel_plan(
    attention: MLASelfAttention, prefix: str, activations: Shard | Replicate
) -> dict[str, object]:
    """The parallelize_module plan entries of one layer's MLA at `prefix`."""
    plan: dict[str, object] = {
        # the whole sequence, as a plain tensor: the latents are computed on every rank
        prefix: PrepareModuleInput(
            input_layouts=(activations, None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        f"{prefix}.linear_proj": RowParallelLinear(output_layouts=activations),
    }
    query = "linear_q_proj" if hasattr(attention, "linear_q_proj") else "linear_q_up_proj"
    for name in (query, "linear_kv_up_proj"):
        fused = isinstance(getattr(attention, name), LayerNormLinear)  # the TE spec's norm
        plan[f"{prefix}.{name}"] = (
            LayerNormColwiseParallel(sequence_parallel=False) if fused else ColwiseParallel()
        )
    return plan


def finish_mla_tensor_parallel(attention: MLASelfAttention, tp_mesh: DeviceMesh) -> None:
    """After the plan: the shared positional key's gradient is summed over the ranks."""
    attention.k_pos_emb_to_heads = CopyToTensorParallelRegion(tp_mesh)
