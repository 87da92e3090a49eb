"""Megatron-LM's Mixture-of-Experts flags (`_add_moe_args`), their group and checks.

The flags map one to one onto core's `TransformerConfig` MoE fields (`--num-experts`
is `num_moe_experts`, every `--moe-*` flag the field of its name), so
`moe_config_fields` is the whole translation; core validates the values again.
`--moe-layer-freq` takes an int or Megatron's list expression ("[0]+[1]*23").
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


@dataclass
class MoEArgs:
    """Routed experts, their router and balancing, and expert parallelism."""

    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int | list[int] = 1
    moe_router_topk: int = 2
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_dtype: str | None = None
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_force_load_balancing: bool = False
    moe_expert_capacity_factor: float | None = None
    moe_token_drop_policy: str = "probs"
    moe_pad_expert_input_to_capacity: bool = False
    moe_grouped_gemm: bool = False
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_gate: bool = False
    moe_token_dispatcher_type: str = "allgather"
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    moe_layer_recompute: bool = False
    moe_per_layer_logging: bool = False
    moe_use_upcycling: bool = False
    moe_upcycling_granularity: int = 1
    moe_flex_dispatcher_backend: str | None = None


TRAINING_ONLY = (
    "moe_flex_dispatcher_backend",
    "moe_layer_recompute",
    "moe_per_layer_logging",
    "moe_use_upcycling",
    "moe_upcycling_granularity",
)
"""`--moe-*` flags of the run, not of the model (no `TransformerConfig` field)."""


def parse_moe_layer_freq(text: str) -> int | list[int]:
    """ "2" → 2; "[0]+[1]*3" → [0, 1, 1, 1]: list literals, + and * only (Megatron's form)."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.List):
            return [value(e) for e in node.elts]
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult)):
            left, right = value(node.left), value(node.right)
            return left + right if isinstance(node.op, ast.Add) else left * right
        raise ValueError

    try:
        parsed = value(ast.parse(text.strip(), mode="eval").body)
    except (SyntaxError, ValueError, TypeError):
        parsed = None
    if isinstance(parsed, int) or (
        isinstance(parsed, list) and all(isinstance(x, int) for x in parsed)
    ):
        return parsed
    raise argparse.ArgumentTypeError(
        f"{text!r}: give an int (every N-th layer is MoE) or a 0/1 list such as '[0]+[1]*23'"
    )


def add_moe_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--num-experts", type=int, help="Routed experts per MoE layer (MoE on).")
    p.add_argument(
        "--moe-ffn-hidden-size", type=int, help="Expert MLP width; default --ffn-hidden-size."
    )
    p.add_argument(
        "--moe-layer-freq",
        type=parse_moe_layer_freq,
        default=1,
        help="MoE every N-th layer, or a 0/1 list per layer, e.g. '[0]+[1]*23' (first dense).",
    )
    p.add_argument("--moe-router-topk", type=int, default=2, help="Experts per token.")
    p.add_argument("--moe-router-score-function", choices=("softmax", "sigmoid"), default="softmax")
    p.add_argument(
        "--moe-router-pre-softmax",
        action="store_true",
        help="Softmax over all experts before the top-k (needed for top-1 softmax).",
    )
    p.add_argument(
        "--moe-router-topk-scaling-factor", type=float, help="Multiplies the top-k weights."
    )
    p.add_argument(
        "--moe-router-num-groups", type=int, help="Expert groups (group-limited routing)."
    )
    p.add_argument("--moe-router-group-topk", type=int, help="Groups a token may use.")
    p.add_argument("--moe-router-dtype", choices=("fp32", "fp64"), help="Router computation dtype.")
    p.add_argument(
        "--moe-router-load-balancing-type",
        choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"),
        default="aux_loss",
    )
    p.add_argument(
        "--moe-aux-loss-coeff", type=float, default=0.0, help="Load-balancing loss weight."
    )
    p.add_argument("--moe-z-loss-coeff", type=float, help="Router z-loss weight (ST-MoE).")
    p.add_argument(
        "--moe-router-enable-expert-bias",
        action="store_true",
        help="Aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the choice.",
    )
    p.add_argument("--moe-router-bias-update-rate", type=float, default=1e-3)
    p.add_argument(
        "--moe-router-force-load-balancing",
        action="store_true",
        help="For benchmarks, as Megatron's: random router logits (gradients passed straight "
        "through), so the experts get balanced loads whatever the router has learned.",
    )
    p.add_argument(
        "--moe-expert-capacity-factor",
        type=float,
        help="Tokens an expert takes, as a multiple of the even share; default dropless.",
    )
    p.add_argument("--moe-token-drop-policy", choices=("probs", "position"), default="probs")
    p.add_argument("--moe-pad-expert-input-to-capacity", action="store_true")
    p.add_argument(
        "--moe-grouped-gemm",
        action="store_true",
        help="All experts in grouped GEMMs (torch._grouped_mm where it runs).",
    )
    p.add_argument("--moe-shared-expert-intermediate-size", type=int, help="Shared experts' width.")
    p.add_argument(
        "--moe-shared-expert-gate", action="store_true", help="Sigmoid gate on the shared experts."
    )
    p.add_argument(
        "--moe-token-dispatcher-type",
        choices=("allgather", "alltoall", "flex"),
        default="allgather",
        help="How tokens reach their experts' ranks; flex (Megatron's DeepEP/HybridEP "
        "dispatcher) runs as alltoall here, said in one line.",
    )
    p.add_argument(
        "--moe-flex-dispatcher-backend",
        choices=("deepep", "hybridep"),
        help="With --moe-token-dispatcher-type flex: Megatron's fused kernel library.",
    )
    p.add_argument(
        "--expert-model-parallel-size", type=int, default=1, help="Expert parallelism (EP)."
    )
    p.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        help="Tensor parallelism inside experts: the TP size (default), or a divisor of it "
        "(each group of that many TP ranks routes its sequence slices and splits the "
        "experts; 1: experts whole, each TP rank routing its slice); below TP it needs "
        "--sequence-parallel.",
    )
    p.add_argument(
        "--moe-layer-recompute",
        action="store_true",
        help="Recompute each MoE layer's forward in the backward pass (stores its input only).",
    )
    p.add_argument(
        "--moe-per-layer-logging",
        action="store_true",
        help="Tensorboard: each MoE layer's balancing losses (moe/load_balancing_loss_layer_N).",
    )
    p.add_argument(
        "--moe-use-upcycling",
        action="store_true",
        help="First run of an MoE from the dense checkpoint in --load: experts start as copies "
        "of its MLPs; the upcycled checkpoint is saved to --save, then training goes on.",
    )
    p.add_argument(
        "--moe-upcycling-granularity",
        type=int,
        default=1,
        help="Dense FFN width / expert width (granular upcycling); mg-train takes 1 only.",
    )


def moe_config_fields(moe: MoEArgs) -> dict[str, Any]:
    """The `TransformerConfig` fields these flags set (none without --num-experts)."""
    if moe.num_experts is None:
        return {}
    out = {"num_moe_experts": moe.num_experts}
    out |= {
        f.name: getattr(moe, f.name)
        for f in fields(MoEArgs)
        if f.name.startswith("moe_") and f.name not in TRAINING_ONLY
    }
    return out


def check_moe_flags(
    family: str,
    moe: MoEArgs,
    *,
    world_size: int,
    tp: int,
    pp: int,
    cp: int,
    dry_run: bool,
    sequence_parallel: bool = False,
    upcycling: UpcyclingFlags | None = None,
) -> str | None:
    """The one-line message for MoE flags that cannot apply, or None."""
    defaults = MoEArgs()
    given = [
        "--" + f.name.replace("_", "-")
        for f in fields(MoEArgs)
        if getattr(moe, f.name) != getattr(defaults, f.name)
    ]
    if moe.num_experts is None:
        others = [g for g in given if g != "--num-experts"]
        return f"{others[0]} needs --num-experts (MoE is off without it)" if others else None
    if family != "gpt":
        return f"--num-experts: mg-train trains MoE for the gpt family only, not {family}"
    ep = moe.expert_model_parallel_size
    etp = tp if moe.expert_tensor_parallel_size is None else moe.expert_tensor_parallel_size
    if moe.num_experts <= 0:
        return f"--num-experts must be positive, got {moe.num_experts}"
    if ep <= 0 or etp <= 0:
        return "--expert-model-parallel-size and --expert-tensor-parallel-size must be positive"
    if moe.num_experts % ep:
        return (
            f"--num-experts ({moe.num_experts}) is not divisible by "
            f"--expert-model-parallel-size ({ep})"
        )
    if not 0 < moe.moe_router_topk <= moe.num_experts:
        return (
            f"--moe-router-topk ({moe.moe_router_topk}) must be between 1 and "
            f"--num-experts ({moe.num_experts})"
        )
    per_stage = world_size // pp
    if per_stage % (ep * etp):
        return (
            f"--expert-model-parallel-size ({ep}) × --expert-tensor-parallel-size ({etp}) must "
            f"divide the {per_stage} ranks of a pipeline stage (world {world_size} / pipeline {pp})"
        )
    if (
        moe.moe_expert_capacity_factor is not None
        and moe.moe_router_load_balancing_type == "sinkhorn"
    ):
        return (
            "--moe-expert-capacity-factor works with aux_loss, seq_aux_loss, global_aux_loss "
            "or none load balancing, not sinkhorn"
        )
    if moe.moe_router_enable_expert_bias and moe.moe_router_score_function != "sigmoid":
        return (
            "--moe-router-enable-expert-bias (aux-loss-free balancing) needs "
            "--moe-router-score-function sigmoid, as in Megatron"
        )
    if moe.moe_pad_expert_input_to_capacity and moe.moe_expert_capacity_factor is None:
        return (
            "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor "
            "(dropless routing has no capacity to pad to)"
        )
    if moe.moe_use_upcycling or moe.moe_upcycling_granularity != 1:
        error = check_upcycling_flags(moe, upcycling or UpcyclingFlags())
        if error:
            return error
    if dry_run:
        return None
    if etp > tp or tp % etp:
        return (
            f"--expert-tensor-parallel-size {etp}: mg-train splits experts over a divisor of "
            f"--tensor-model-parallel-size ({tp}); give one, or 1 to keep them whole"
        )
    if etp != tp and not sequence_parallel:
        return (
            f"--expert-tensor-parallel-size {etp} with --tensor-model-parallel-size {tp} needs "
            "--sequence-parallel (as in Megatron: each TP rank routes its sequence slice)"
        )
    return None


@dataclass
class UpcyclingFlags:
    """The non-MoE flags --moe-use-upcycling depends on."""

    load: str | None = None
    save: str | None = None
    ffn_hidden_size: int | None = None
    use_checkpoint_args: bool = False


def check_upcycling_flags(moe: MoEArgs, flags: UpcyclingFlags) -> str | None:
    """Megatron's upcycling rules (a --save to write to) and ours: a --load to read, experts
    as wide as the dense MLP (granularity 1), the model from the flags."""
    if not moe.moe_use_upcycling:
        return "--moe-upcycling-granularity needs --moe-use-upcycling"
    if moe.moe_upcycling_granularity != 1:
        return (
            f"--moe-upcycling-granularity {moe.moe_upcycling_granularity}: mg-train upcycles "
            "with granularity 1 only (each expert a whole copy of the dense MLP); drop the flag"
        )
    if not flags.load:
        return "--moe-use-upcycling needs --load (the dense checkpoint to upcycle)"
    if not flags.save:
        return "--moe-use-upcycling needs --save (where the upcycled checkpoint is written)"
    if flags.use_checkpoint_args:
        return (
            "--moe-use-upcycling with --use-checkpoint-args: the checkpoint's config is the "
            "dense model's; give the model flags instead of --use-checkpoint-args"
        )
    width = moe.moe_ffn_hidden_size
    if width is not None and flags.ffn_hidden_size is not None and width != flags.ffn_hidden_size:
        return (
            f"--moe-use-upcycling: --moe-ffn-hidden-size ({width}) must equal --ffn-hidden-size "
            f"({flags.ffn_hidden_size}), as each expert starts as a copy of the dense MLP; drop "
            "--moe-ffn-hidden-size"
        )
    return None


def resolve_flex_dispatcher(moe: MoEArgs) -> None:
    """Megatron's flex dispatcher (DeepEP / HybridEP kernels) → alltoall, in one line: mg has
    no DeepEP path, and alltoall sends each token to the same experts (the results do not
    depend on the dispatcher)."""
    if moe.moe_flex_dispatcher_backend is not None and moe.moe_token_dispatcher_type != "flex":
        fail("--moe-flex-dispatcher-backend applies to --moe-token-dispatcher-type flex")
    if moe.moe_token_dispatcher_type != "flex":
        return
    backend = moe.moe_flex_dispatcher_backend or "deepep"
    installed = importlib.util.find_spec("deep_ep") is not None
    why = "mg has no DeepEP path" if installed else "DeepEP is not installed"
    print(
        f"mg-train: --moe-token-dispatcher-type flex ({backend}): {why}; using alltoall, "
        "which routes every token to the same experts",
        file=sys.stderr,
    )
    moe.moe_token_dispatcher_type = "alltoall"


def check_moe(args: Args) -> None:
    """`check_moe_flags` on a parsed run."""
    resolve_flex_dispatcher(args.moe)
    d = args.distributed
    error = check_moe_flags(
        args.family,
        args.moe,
        world_size=d.world_size,
        tp=d.tensor_model_parallel_size,
        pp=d.pipeline_model_parallel_size,
        cp=d.context_parallel_size,
        dry_run=args.training.dry_run,
        sequence_parallel=d.sequence_parallel,
        upcycling=UpcyclingFlags(
            load=args.checkpoint.load,
            save=args.checkpoint.save,
            ffn_hidden_size=args.model.ffn_hidden_size,
            use_checkpoint_args=args.checkpoint.use_checkpoint_args,
        ),
    )
    if error:
        fail(error)
