"""Megatron's "transformer-engine" flags: layer implementation, attention kernels, FP8, CUDA graphs.

Megatron spreads these over its TransformerConfig-generated group and its
"Transformer-Engine" group; they live together here because they pick kernels
and number formats, not the model's shape.

- `--transformer-impl transformer_engine` names the weights as Megatron's TE spec
  does and runs Transformer Engine's LayerNormLinear / Linear / DotProductAttention
  (`mg.core.models.te_spec`). Megatron's default is transformer_engine; ours is
  local, because TE is an optional GPU extra. Without TE or a GPU it is refused.
- `--attention-backend` / `--use-flash-attn` pick the attention kernel by
  Megatron's names (`mg.core.models.attention_backend`); `--use-flash-attn` is
  `--attention-backend flash`.
- `--fp8-format` (with `--fp8-recipe`, `--fp8-margin`, `--fp8-amax-history-len`,
  `--fp8-amax-compute-algo`, `--no-fp8-wgrad`, `--first-last-layers-bf16`) trains
  through TE's `fp8_autocast` with the recipe megatron.core.fp8_utils builds when
  the layers are TE's; with `--transformer-impl local` (the default where TE is not
  installed) through torchao's float8 linears on PyTorch's `_scaled_mm`
  (`mg.core.models.float8_training`: recipes tensorwise and rowwise; the others
  refused by name). On a machine without FP8 matmuls (a CPU, a GPU before Ada) a run
  is refused; `MG_FP8_EMULATE=1` runs torchao's FP8 rounding with high-precision
  matmuls instead, to test the numerics there.
  `--fp8-param-gather` is checked as Megatron checks it and planned by `--dry-run`;
  with torchao under FSDP it gathers FP8 weights, otherwise a run is refused: FP8
  weights need an optimizer that keeps their fp32 masters.
- With tensor (and sequence) or context parallelism TE's modules are told the
  groups as Megatron's TE spec tells them (`mg.core.models.te_parallel`).
- FP8 amaxes are reduced over Megatron's amax-reduction group, the pipeline stage's
  tensor × context × data ranks; `--tp-only-amax-red` narrows it to the tensor ×
  context ranks (`mg.trainer.model_parallel.amax_reduction_group`).
- Documented no-ops: `--fp8-interval` (TE 2 has no interval; Megatron passes it only
  to TE 1), `--te-rng-tracker` (TE's attention dropout already draws from our
  per-rank stream under TP).
- Refused by name: CUDA graphs (`--enable-cuda-graph`, `--external-cuda-graph`,
  `--cuda-graph-impl local|transformer_engine`), `--fp8-dot-product-attention`,
  `--fp8-multi-head-attention`, `--fp8-recipe custom`,
  `--transformer-impl inference_optimized`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.core.models.te_spec import FP8Options
    from mg.trainer.arguments.args import Args

ATTENTION_BACKENDS = ("flash", "fused", "unfused", "local", "auto")  # Megatron's AttnBackend
FP8_RECIPES = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom", "rowwise")
"""Megatron's Fp8Recipe names, and torchao's rowwise (ours: `--transformer-impl local`)."""
FP8_EMULATE = "MG_FP8_EMULATE"
"""Set to 1: torchao's FP8 with emulated matmuls, on machines without FP8 matmuls."""


@dataclass
class TransformerEngineArgs:
    """Which layer implementation, attention kernels and number formats run the model."""

    transformer_impl: str | None = None  # finalize_transformer_engine fills it
    attention_backend: str = "auto"
    use_flash_attn: bool = False
    fp8: str | None = None
    """--fp8-format (Megatron's args name for it is `fp8`)."""
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_interval: int = 1
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    fp8_param_gather: bool = False
    fp8_dot_product_attention: bool = False
    fp8_multi_head_attention: bool = False
    tp_only_amax_red: bool = False
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    te_rng_tracker: bool = False
    enable_cuda_graph: bool = False
    external_cuda_graph: bool = False
    cuda_graph_impl: str = "none"
    cuda_graph_scope: list[str] | None = None
    cuda_graph_warmup_steps: int = 3


def finalize_transformer_engine(args: Args) -> None:
    """An unset `--transformer-impl` with FP8 asked for: Megatron's default
    (transformer_engine) where TE is installed or for a dry run's plan, else local, whose
    FP8 runs in torchao's float8 linears; said in one line. Without FP8: local."""
    te = args.transformer_engine
    if te.transformer_impl is not None:
        return
    te.transformer_impl = "local"
    if te.fp8 is None:
        return
    from mg.core.models.te_spec import transformer_engine_installed  # lazy: torch

    if args.training.dry_run or transformer_engine_installed():
        te.transformer_impl = "transformer_engine"
        how = "using transformer_engine, Megatron's default (FP8 runs in TE's layers)"
    else:
        how = "Transformer Engine is not installed: local layers, FP8 through torchao"
    print(f"mg-train: --fp8-format without --transformer-impl: {how}", file=sys.stderr)


def add_transformer_engine_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--transformer-impl",
        default=None,
        choices=["local", "transformer_engine", "inference_optimized"],
        help="Layer implementation: local (PyTorch) or transformer_engine (TE's modules under "
        "Megatron's TE-spec weight names; needs the gpu extra and a GPU). Unset: local, or "
        "transformer_engine (Megatron's default) when an FP8 flag asks for TE's layers.",
    )
    p.add_argument(
        "--attention-backend",
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="Attention kernel, Megatron's names: flash, fused (cuDNN/memory-efficient), "
        "unfused and local (math), auto (PyTorch or TE chooses). flash/fused need CUDA.",
    )
    p.add_argument(
        "--use-flash-attn",
        action="store_true",
        help="FlashAttention: the same as --attention-backend flash (flash-attn if installed).",
    )
    p.add_argument(
        "--fp8-format",
        dest="fp8",
        choices=["e4m3", "hybrid"],
        help="Train in FP8: e4m3 everywhere, or hybrid (e4m3 forward, e5m2 gradients). In "
        "Transformer Engine's layers, or with --transformer-impl local through torchao "
        "(recipes tensorwise, rowwise; needs an FP8 GPU and the fp8 extra).",
    )
    p.add_argument(
        "--fp8-recipe",
        default="delayed",
        choices=FP8_RECIPES,
        help="FP8 scaling: Megatron's recipes in TE; tensorwise or rowwise through torchao.",
    )
    p.add_argument("--fp8-margin", type=int, default=0, help="Delayed scaling: scale margin.")
    p.add_argument(
        "--fp8-interval", type=int, default=1, help="Accepted; TE 2 has no interval (no-op)."
    )
    p.add_argument(
        "--fp8-amax-history-len", type=int, default=1, help="Delayed scaling: amax history."
    )
    p.add_argument(
        "--fp8-amax-compute-algo",
        default="most_recent",
        choices=["most_recent", "max"],
        help="Delayed scaling: amax from the history's latest value or its max.",
    )
    p.add_argument(
        "--no-fp8-wgrad",
        "--disable-fp8-wgrad",
        dest="fp8_wgrad",
        action="store_false",
        help="Compute the weight gradients in higher precision (delayed scaling).",
    )
    p.add_argument(
        "--fp8-param-gather",
        action="store_true",
        help="FP8 weights: with torchao under FSDP, FP8 weight all-gather; otherwise checked "
        "and planned by --dry-run, and a run is refused (not supported yet).",
    )
    for flag in ("--fp8-dot-product-attention", "--fp8-multi-head-attention"):
        p.add_argument(flag, action="store_true", help="Refused: not supported yet.")
    p.add_argument(
        "--tp-only-amax-red",
        action="store_true",
        help="Reduce FP8 amaxes over the tensor (and context) parallel ranks only, not "
        "the data-parallel ones too.",
    )
    p.add_argument(
        "--first-last-layers-bf16",
        action="store_true",
        help="Run the first and last layers outside FP8 (counts below).",
    )
    p.add_argument("--num-layers-at-start-in-bf16", type=int, default=1, help="With the above.")
    p.add_argument("--num-layers-at-end-in-bf16", type=int, default=1, help="With the above.")
    p.add_argument(
        "--te-rng-tracker", action="store_true", help="Accepted; dropout streams as is (no-op)."
    )
    p.add_argument("--enable-cuda-graph", action="store_true", help="Refused: no CUDA graphs yet.")
    p.add_argument(
        "--external-cuda-graph", action="store_true", help="Refused: no CUDA graphs yet."
    )
    p.add_argument(
        "--cuda-graph-impl",
        default="none",
        choices=["none", "local", "transformer_engine"],
        help="CUDA graphs: only none for now (others refused).",
    )
    p.add_argument("--cuda-graph-scope", nargs="+", help="With --cuda-graph-impl (refused).")
    p.add_argument("--cuda-graph-warmup-steps", type=int, default=3, help="With CUDA graphs.")


def _refusals(te: TransformerEngineArgs) -> None:
    """Flags recognised but not implemented: one line each, naming the flag."""
    if te.transformer_impl == "inference_optimized":
        fail("--transformer-impl inference_optimized is not supported; use transformer_engine")
    for flag, on in (
        ("--enable-cuda-graph", te.enable_cuda_graph),
        ("--external-cuda-graph", te.external_cuda_graph),
        (f"--cuda-graph-impl {te.cuda_graph_impl}", te.cuda_graph_impl != "none"),
        ("--fp8-dot-product-attention", te.fp8_dot_product_attention),
        ("--fp8-multi-head-attention", te.fp8_multi_head_attention),
        ("--fp8-recipe custom", te.fp8_recipe == "custom"),
    ):
        if on:
            fail(f"{flag} is not supported by mg-train yet")


def check_transformer_engine(args: Args) -> None:
    """Megatron's checks, then what this machine can run (a dry run plans without running)."""
    te = args.transformer_engine
    if te.use_flash_attn:
        if te.attention_backend not in ("auto", "flash"):
            fail(f"--use-flash-attn contradicts --attention-backend {te.attention_backend}")
        te.attention_backend = "flash"

    _refusals(te)
    for flag, value in (
        ("--fp8-amax-history-len", te.fp8_amax_history_len),
        ("--fp8-interval", te.fp8_interval),
    ):
        if value < 1:
            fail(f"{flag} must be >= 1, got {value}")
    if te.transformer_impl == "transformer_engine":
        _check_te_layout(args)
    elif te.fp8 is not None:
        _check_torchao_recipe(args)
    if not args.training.dry_run:
        _check_machine(te)
        t = args.training
        if te.attention_backend == "flash" and not (t.bf16 or t.fp16):
            flag = "--use-flash-attn" if te.use_flash_attn else "--attention-backend flash"
            fail(f"{flag} needs --bf16 or --fp16 (FlashAttention runs in 16-bit only)")
        torchao_gather = te.transformer_impl == "local" and args.fsdp.enabled
        if te.fp8_param_gather and not torchao_gather:  # planned by --dry-run; FP8 weights
            fail(  # need an FP8-aware optimizer (torchao's FSDP all-gather keeps them plain)
                "--fp8-param-gather is not supported by mg-train yet (its distributed optimizer "
                "keeps fp32 copies of plain weights); FP8 compute runs without it"
            )


def _check_torchao_recipe(args: Args) -> None:
    """FP8 in local layers runs through torchao: its recipes only, one line naming the flag."""
    from mg.core.models.float8_training import refusal  # lazy: --help stays instant

    options = fp8_options(args)
    assert options is not None  # called with --fp8-format set
    why = refusal(options)
    if why is not None:
        fail(why)


def fp8_emulated() -> bool:
    """`MG_FP8_EMULATE=1`: torchao's FP8 rounding with high-precision matmuls."""
    return os.environ.get(FP8_EMULATE) == "1"


def _check_te_layout(args: Args) -> None:
    if args.family != "gpt" and not (args.family == "vlm" and args.training.dry_run):
        fail(f"--transformer-impl transformer_engine is for gpt here, not {args.family}")


def _check_machine(te: TransformerEngineArgs) -> None:
    """The packages and device the chosen kernels need, one line naming the flag."""
    # lazy: --help stays instant (mg.core.models imports torch)
    from mg.core.models import attention_backend
    from mg.core.models.te_spec import transformer_engine_installed

    cuda = attention_backend.cuda_available()
    if te.attention_backend in ("flash", "fused") and not cuda:
        flag = f"--attention-backend {te.attention_backend}"
        if te.use_flash_attn:
            flag = "--use-flash-attn"
        fail(
            f"{flag} selects a CUDA kernel and this machine has no CUDA device; "
            "use --attention-backend auto"
        )
    if te.transformer_impl == "transformer_engine":
        if not transformer_engine_installed():
            fail(
                "--transformer-impl transformer_engine needs Transformer Engine, which is not "
                "installed; install the gpu extra: pip install 'mg-core[gpu]'"
            )
        if not cuda:
            fail("--transformer-impl transformer_engine needs a CUDA GPU and none is visible")
        if te.fp8_recipe == "rowwise" and te.fp8 is not None:
            fail("--fp8-recipe rowwise is torchao's: use it with --transformer-impl local")
    elif te.fp8 is not None:
        _check_torchao_machine(cuda)


def _check_torchao_machine(cuda: bool) -> None:
    """torchao installed, and FP8 matmuls here (compute capability 8.9+) or emulation."""
    from mg.core.models.float8_training import torchao_installed  # lazy: torch

    if not torchao_installed():
        fail(
            "--fp8-format with --transformer-impl local trains through torchao, which is not "
            "installed; install the fp8 extra: pip install 'mg-core[fp8]'"
        )
    if fp8_emulated():
        return
    import torch  # lazy: --help stays instant

    if not cuda or torch.cuda.get_device_capability() < (8, 9):
        fail(
            "--fp8-format needs FP8 matmuls (a CUDA GPU of compute capability 8.9+: Ada, "
            f"Hopper or newer) and this machine has none; {FP8_EMULATE}=1 emulates them "
            "(slow; for testing the numerics)"
        )


def fp8_options(args: Args) -> FP8Options | None:
    """The FP8 settings of the run, None without `--fp8-format`."""
    te = args.transformer_engine
    if te.fp8 is None:
        return None
    from mg.core.models.te_spec import FP8Options  # lazy: --help stays instant (torch)

    layers = args.model.num_layers or 0
    bf16_layers: tuple[int, ...] = ()
    if te.first_last_layers_bf16:
        start, end = te.num_layers_at_start_in_bf16, te.num_layers_at_end_in_bf16
        bf16_layers = tuple(i for i in range(layers) if i < start or i >= layers - end)
    return FP8Options(
        format=te.fp8,
        recipe=te.fp8_recipe,
        margin=te.fp8_margin,
        amax_history_len=te.fp8_amax_history_len,
        amax_compute_algo=te.fp8_amax_compute_algo,
        wgrad=te.fp8_wgrad,
        param=te.fp8_param_gather,
        bf16_layers=bf16_layers,
    )
