"""mamba_ssm's Triton SSD kernel as an optional scan for a built model (GPU only).

Applied from outside, like compile: `use_mamba_ssm_kernels(model)` swaps each
mixer's chunked scan for `mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined`
(the kernel megatron-core's MambaMixer calls), called with the arguments and
layouts Megatron passes it. Nothing is recorded in the model's config, so a
checkpoint trained with the kernel loads and runs anywhere with the default
PyTorch scan. mamba_ssm is imported only here, and its absence is an error
that says what to install.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from mg.core.models.mamba.mixer import MambaMixer


class KernelUnavailableError(RuntimeError):
    """mamba_ssm (its Triton kernels) is not installed."""


def mamba_ssm_chunk_scan() -> Callable[..., tuple[Tensor, Tensor]]:
    """A scan with `ssd_chunked_scan`'s contract, computed by mamba_ssm's kernel."""
    try:
        # lazy: mamba_ssm (CUDA, Triton) is an optional gpu dependency
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except ImportError as err:
        raise KernelUnavailableError(
            "the mamba_ssm kernels are not installed: `pip install mamba-ssm` (CUDA only), "
            "or keep the default PyTorch scan"
        ) from err

    def scan(
        x: Tensor,
        dt: Tensor,
        A: Tensor,
        B: Tensor,
        C: Tensor,
        chunk_size: int,
        D: Tensor | None = None,
        initial_state: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        # dt is already softplus(dt + dt_bias) (and 0 on padding), so neither is asked for
        y, final = mamba_chunk_scan_combined(
            x.contiguous(),
            dt.contiguous(),
            A,
            B.contiguous(),
            C.contiguous(),
            chunk_size,
            D=D,
            initial_states=initial_state,
            return_final_states=True,
        )
        return y, final

    return scan


def use_mamba_ssm_kernels(model: nn.Module) -> int:
    """Make every MambaMixer of `model` scan with mamba_ssm's kernel; returns how many."""
    scan = mamba_ssm_chunk_scan()
    mixers = [m for m in model.modules() if isinstance(m, MambaMixer)]
    for mixer in mixers:
        mixer.chunk_scan = scan
    return len(mixers)
