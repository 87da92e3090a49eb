"""Flags that do not go together: one table, each row naming both flags.

A row refuses a combination (or a flag without the one it needs) with one
line that names both. Most are Megatron's own refusals (validate_args); the
others are where mg's construction steps cannot honour both flags at once.
Rows marked `run_only` are not checked by `--dry-run`, which plans a layout
without running it. Rules about one flag's value stay with its group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mg.trainer.arguments.args import Args
from mg.trainer.arguments.errors import fail


@dataclass(frozen=True)
class Conflict:
    first: str
    second: str
    applies: Callable[[Args], bool]
    message: str
    run_only: bool = False


def _tp(a: Args) -> int:
    return a.distributed.tensor_model_parallel_size


def _pp(a: Args) -> int:
    return a.distributed.pipeline_model_parallel_size


def _expert_tp(a: Args) -> int:
    """Megatron's expert tensor-parallel size: the TP size unless set."""
    etp = a.moe.expert_tensor_parallel_size
    return _tp(a) if etp is None else etp


def _cp(a: Args) -> int:
    return a.distributed.context_parallel_size


def _full_recompute(a: Args) -> bool:
    return a.model.recompute_granularity == "full"


def _fsdp(a: Args) -> bool:
    return a.fsdp.enabled


def _fsdp_dtypes_set(a: Args) -> bool:
    f = a.fsdp
    return (
        f.fsdp_double_buffer
        or f.use_nccl_ub
        or f.fsdp_manual_registration
        or f.megatron_fsdp_main_params_dtype != "fp32"
        or f.megatron_fsdp_main_grads_dtype != "auto"
        or f.megatron_fsdp_grad_comm_dtype != "auto"
        or f.outer_dp_sharding_strategy != "no_shard"
    )


def _fsdp_not_yet(flag: str, applies: Callable[[Args], bool], with_what: str) -> Conflict:
    """FSDP with what mg-train does not yet run with it (Megatron does)."""
    return Conflict(
        "--use-megatron-fsdp",
        flag,
        lambda a: _fsdp(a) and applies(a),
        f"--use-megatron-fsdp / --use-torch-fsdp2 with {with_what} is not supported yet; "
        "drop one of them",
        run_only=True,
    )


CONFLICTS: tuple[Conflict, ...] = (
    # --- precision ------------------------------------------------------------------------
    Conflict(
        "--fp16",
        "--bf16",
        lambda a: a.training.fp16 and a.training.bf16,
        "--fp16 and --bf16 cannot both be set",
    ),
    Conflict(
        "--fp8-param-gather",
        "--fp8-format",
        lambda a: a.transformer_engine.fp8_param_gather and a.transformer_engine.fp8 is None,
        "--fp8-param-gather needs --fp8-format",
    ),
    Conflict(
        "--fp8-param-gather",
        "--use-distributed-optimizer",
        lambda a: (
            a.transformer_engine.fp8_param_gather and not a.distributed.use_distributed_optimizer
        ),
        "--fp8-param-gather needs --use-distributed-optimizer (as in Megatron)",
    ),
    Conflict(
        "--fp8-format",
        "--recompute-granularity full",
        lambda a: (
            a.transformer_engine.fp8 is not None
            and a.transformer_engine.transformer_impl == "transformer_engine"
            and _full_recompute(a)
        ),
        "--fp8-format with --recompute-granularity full is not supported in Transformer "
        "Engine's layers: the recomputed "
        "layers would run outside FP8 (Megatron recomputes through Transformer Engine's own "
        "checkpoint); use --recompute-activations (selective) or drop one of them",
    ),
    Conflict(
        "--deterministic-mode",
        "--use-flash-attn",
        lambda a: (
            a.training.deterministic_mode
            and (
                a.transformer_engine.use_flash_attn
                or a.transformer_engine.attention_backend == "flash"
            )
        ),
        "--deterministic-mode is not compatible with --use-flash-attn",
    ),
    Conflict(
        "--reset-attention-mask",
        "--transformer-impl transformer_engine",
        lambda a: (
            a.data.reset_attention_mask
            and a.transformer_engine.transformer_impl == "transformer_engine"
        ),
        "--reset-attention-mask needs --transformer-impl local (TE attention here is causal)",
    ),
    # --- parallelism ------------------------------------------------------------------------
    Conflict(
        "--overlap-grad-reduce",
        "--tensor-model-parallel-size",
        lambda a: (
            _tp(a) > 1
            and a.distributed.overlap_grad_reduce
            and not (a.distributed.use_distributed_optimizer or _fsdp(a))
        ),
        "--overlap-grad-reduce with --tensor-model-parallel-size > 1 needs "
        "--use-distributed-optimizer (the plain data-parallel path reduces after backward)",
        run_only=True,
    ),
    Conflict(
        "--overlap-grad-reduce",
        "--pipeline-model-parallel-size",
        lambda a: (
            (_pp(a) > 1 or a.distributed.num_layers_per_virtual_pipeline_stage is not None)
            and a.distributed.overlap_grad_reduce
            and not (a.distributed.use_distributed_optimizer or _fsdp(a))
        ),
        "--overlap-grad-reduce with --pipeline-model-parallel-size > 1 needs "
        "--use-distributed-optimizer (the plain data-parallel path reduces after the schedule)",
        run_only=True,
    ),
    Conflict(
        "--overlap-param-gather",
        "--use-distributed-optimizer",
        lambda a: (
            a.distributed.overlap_param_gather
            and not (a.distributed.use_distributed_optimizer or _fsdp(a))
        ),
        "--overlap-param-gather only works with --use-distributed-optimizer or "
        "--use-megatron-fsdp (as in Megatron)",
    ),
    Conflict(
        "--pipeline-model-parallel-size",
        "mg-train t5",
        lambda a: _pp(a) > 1 and a.family == "t5",  # Megatron's pretrain_t5.py refuses it too
        "--pipeline-model-parallel-size > 1 is not supported for t5 (as in Megatron)",
        run_only=True,
    ),
    Conflict(
        "--context-parallel-size",
        "--reset-attention-mask",
        lambda a: _cp(a) > 1 and a.data.reset_attention_mask,
        "--context-parallel-size > 1 does not support --reset-attention-mask",
        run_only=True,
    ),
    Conflict(
        "--context-parallel-size",
        "--attention-dropout",
        lambda a: _cp(a) > 1 and a.model.attention_dropout > 0,
        "--context-parallel-size > 1 needs --attention-dropout 0",
        run_only=True,
    ),
    Conflict(
        "--cross-entropy-loss-fusion",
        "--tensor-model-parallel-size",
        lambda a: a.training.cross_entropy_loss_fusion and (a.family != "gpt" or _tp(a) > 1),
        "--cross-entropy-loss-fusion is supported for gpt without tensor parallelism "
        "(with --tensor-model-parallel-size > 1 the loss is already vocab-parallel, "
        "without full logits); drop the flag",
        run_only=True,
    ),
    # --- fully sharded data parallel ----------------------------------------------------------
    Conflict(
        "--use-megatron-fsdp",
        "--use-torch-fsdp2",
        lambda a: a.fsdp.use_megatron_fsdp and a.fsdp.use_torch_fsdp2,
        "--use-megatron-fsdp and --use-torch-fsdp2 cannot both be set (one FSDP); drop one",
    ),
    Conflict(
        "--data-parallel-sharding-strategy",
        "--use-megatron-fsdp",
        lambda a: a.fsdp.data_parallel_sharding_strategy != "no_shard" and not _fsdp(a),
        "--data-parallel-sharding-strategy other than no_shard needs --use-megatron-fsdp or "
        "--use-torch-fsdp2 (use --use-distributed-optimizer for ZeRO-1 without FSDP)",
    ),
    Conflict(
        "--num-distributed-optimizer-instances",
        "--use-megatron-fsdp",
        lambda a: a.fsdp.num_distributed_optimizer_instances > 1 and not _fsdp(a),
        "--num-distributed-optimizer-instances > 1 needs --use-megatron-fsdp or "
        "--use-torch-fsdp2 (mg-train's distributed optimizer is one instance)",
    ),
    Conflict(
        "--megatron-fsdp-main-params-dtype",
        "--use-megatron-fsdp",
        lambda a: _fsdp_dtypes_set(a) and not _fsdp(a),
        "--megatron-fsdp-main-params-dtype, --megatron-fsdp-main-grads-dtype, "
        "--megatron-fsdp-grad-comm-dtype, --outer-dp-sharding-strategy, --fsdp-double-buffer, "
        "--use-nccl-ub and --fsdp-manual-registration need --use-megatron-fsdp or "
        "--use-torch-fsdp2",
    ),
    Conflict(
        "--use-megatron-fsdp",
        "--pipeline-model-parallel-size",
        lambda a: _fsdp(a) and _pp(a) > 1,
        "--use-megatron-fsdp / --use-torch-fsdp2 is not supported with pipeline parallelism "
        "(--pipeline-model-parallel-size > 1), as in Megatron",
    ),
    Conflict(
        "--use-torch-fsdp2",
        "--expert-model-parallel-size",
        lambda a: a.fsdp.use_torch_fsdp2 and a.moe.expert_model_parallel_size > 1,
        "--use-torch-fsdp2 is not supported with expert parallelism "
        "(--expert-model-parallel-size > 1), as in Megatron",
    ),
    Conflict(
        "--use-torch-fsdp2",
        "--use-distributed-optimizer",
        lambda a: a.fsdp.use_torch_fsdp2 and a.distributed.use_distributed_optimizer,
        "--use-torch-fsdp2 is not supported with --use-distributed-optimizer (FSDP shards the "
        "optimizer state itself), as in Megatron",
    ),
    Conflict(
        "--use-torch-fsdp2",
        "--fp16",
        lambda a: a.fsdp.use_torch_fsdp2 and a.training.fp16,
        "--use-torch-fsdp2 is not supported with --fp16, as in Megatron; use --bf16",
    ),
    Conflict(
        "--use-torch-fsdp2",
        "--untie-embeddings-and-output-weights",
        lambda a: a.fsdp.use_torch_fsdp2 and not a.model.untie_embeddings_and_output_weights,
        "--use-torch-fsdp2 needs --untie-embeddings-and-output-weights, as in Megatron",
    ),
    Conflict(
        "--use-torch-fsdp2",
        "--ckpt-format",
        lambda a: a.fsdp.use_torch_fsdp2 and a.checkpoint.ckpt_format == "torch",
        "--use-torch-fsdp2 needs --ckpt-format torch_dist or fsdp_dtensor (a torch "
        "checkpoint is one file per model-parallel rank, without the data-parallel shards)",
    ),
    Conflict(
        "--use-megatron-fsdp",
        "--ckpt-format",
        lambda a: a.fsdp.use_megatron_fsdp and a.checkpoint.ckpt_format != "fsdp_dtensor",
        "--use-megatron-fsdp needs --ckpt-format fsdp_dtensor, as in Megatron",
    ),
    Conflict(
        "--ckpt-format fsdp_dtensor",
        "--use-megatron-fsdp",
        lambda a: a.checkpoint.ckpt_format == "fsdp_dtensor" and a.checkpoint.save and not _fsdp(a),
        "--ckpt-format fsdp_dtensor is saved by fully sharded runs: add --use-megatron-fsdp "
        "(or --use-torch-fsdp2), or save --ckpt-format torch_dist",
    ),
    _fsdp_not_yet(  # the experts' shards would need a mesh of expert-data × tensor ranks
        "--expert-tensor-parallel-size",
        lambda a: a.moe.expert_model_parallel_size > 1 and _expert_tp(a) > 1,
        "expert parallelism (--expert-model-parallel-size > 1) with the experts split over "
        "tensor-parallel ranks (--expert-tensor-parallel-size > 1, by default the TP size; "
        "use --expert-tensor-parallel-size 1)",
    ),
    _fsdp_not_yet(
        "--transformer-impl",
        lambda a: a.transformer_engine.transformer_impl == "transformer_engine",
        "--transformer-impl transformer_engine",
    ),
    _fsdp_not_yet("mg-train bert", lambda a: a.family in ("bert", "t5"), "mg-train bert or t5"),
    # --- model ----------------------------------------------------------------------------
    Conflict(
        "--use-rope-scaling",
        "--position-embedding-type",
        lambda a: a.model.use_rope_scaling and a.model.position_embedding_type != "rope",
        "--use-rope-scaling needs --position-embedding-type rope",
    ),
    Conflict(
        "--num-layers",
        "--encoder-num-layers",
        lambda a: (
            a.model.encoder_num_layers is not None
            and a.model.encoder_num_layers != a.model.num_layers
        ),
        "cannot have both --num-layers and --encoder-num-layers specified",
    ),
    Conflict(
        "--recompute-granularity full",
        "--recompute-method",
        lambda a: (
            _full_recompute(a)
            and (a.model.recompute_method is None or a.model.recompute_num_layers is None)
        ),
        "--recompute-granularity full needs --recompute-method and --recompute-num-layers",
    ),
    Conflict(
        "--moe-layer-recompute",
        "--recompute-granularity full",
        lambda a: a.moe.moe_layer_recompute and _full_recompute(a),
        "--moe-layer-recompute with --recompute-granularity full: the full recompute "
        "already recomputes the MoE layers; drop one of them",
    ),
    # --- learning rate and checkpoints --------------------------------------------------------
    Conflict(
        "--decoupled-min-lr",
        "--decoupled-lr",
        lambda a: a.optimizer.decoupled_min_lr is not None and a.optimizer.decoupled_lr is None,
        "--decoupled-min-lr needs --decoupled-lr",
    ),
    Conflict(
        "--async-save",
        "--ckpt-format",
        lambda a: a.checkpoint.async_save and a.checkpoint.ckpt_format != "torch_dist",
        "--async-save needs --ckpt-format torch_dist",
        run_only=True,
    ),
    Conflict(
        "--ckpt-step",
        "--load",
        lambda a: a.checkpoint.ckpt_step is not None and not a.checkpoint.load,
        "--ckpt-step needs --load (the folder whose iteration it picks)",
    ),
    Conflict(
        "--exit-on-missing-checkpoint",
        "--load",
        lambda a: a.checkpoint.exit_on_missing_checkpoint and not a.checkpoint.load,
        "--exit-on-missing-checkpoint needs --load",
    ),
    Conflict(
        "--save-interval",
        "--save",
        lambda a: a.checkpoint.save_interval is not None and a.checkpoint.save is None,
        "--save-interval needs --save",
    ),
    # --- deterministic mode (Megatron's ARG_VALUES_REQUIRED_FOR_DETERMINISM) ---------------
    Conflict(
        "--deterministic-mode",
        "--cross-entropy-loss-fusion",
        lambda a: a.training.deterministic_mode and a.training.cross_entropy_loss_fusion,
        "--deterministic-mode with --cross-entropy-loss-fusion: the fused cross entropy is "
        "not deterministic (Megatron refuses it too); drop one of them",
    ),
)
"""Every refused pair (see the module docstring)."""


def check_combinations(args: Args) -> None:
    """Refuse the first row of `CONFLICTS` that applies (a dry run skips `run_only` rows)."""
    for conflict in CONFLICTS:
        if conflict.run_only and args.training.dry_run:
            continue
        if conflict.applies(args):
            fail(conflict.message)
