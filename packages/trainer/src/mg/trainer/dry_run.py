"""`mg-train gpt --dry-run`: what a run would need per GPU, without allocating the model.

Reads the same flags as a real run (the world size from WORLD_SIZE, as torchrun
sets it, so `WORLD_SIZE=1536 mg-train gpt --dry-run ...` plans a 1536-GPU job
on a laptop), then prints the parameter count, FLOPs per iteration and the
per-GPU memory of `mg.core.models.memory` for the most loaded pipeline stage.
The total parameter count is cross-checked against the model built on the
meta device (no storage is allocated).

mg-train keeps fp32 weights and gradients and runs `--bf16`/`--fp16` as
autocast, so its weights/grads/optimizer bytes are the fp32 row of REFERENCE
§7's table; the activations are 16-bit under autocast. The report also gives
the figure for Megatron's bf16/fp16 weights with fp32 main parameters, for
planning a run with Megatron-LM itself.
"""

from __future__ import annotations

import torch

from mg.core.models import GPTModel, TransformerConfig
from mg.core.models.flops import num_parameters
from mg.core.models.memory import MemoryEstimate, MemoryEstimateError, estimate_memory
from mg.core.parallel.mesh import ParallelDims, ParallelLayoutError
from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.arguments.model import selective_recompute_modules
from mg.trainer.encoder_dry_run import encoder_dry_run_report
from mg.trainer.families import get_family
from mg.trainer.family_mamba import dry_run_report
from mg.trainer.fsdp_dry_run import fsdp_lines
from mg.trainer.padded_vocab import padded_vocab_size
from mg.trainer.vlm_dry_run import vlm_dry_run_report

_GIB = 2**30


def meta_parameter_count(config: TransformerConfig) -> int:
    """numel of the real model, built on the meta device (shapes only, no storage)."""
    with torch.device("meta"):
        model = GPTModel(config)
    return sum(p.numel() for p in model.parameters())


def estimate(args: Args, config: TransformerConfig, param_dtype: str = "fp32") -> MemoryEstimate:
    """The memory estimate of `args`' run (mg-train keeps fp32 weights: param_dtype fp32)."""
    d, m, t = args.distributed, args.model, args.training
    try:
        dims = ParallelDims.from_world(
            d.world_size,
            tp=d.tensor_model_parallel_size,
            pp=d.pipeline_model_parallel_size,
            cp=d.context_parallel_size,
        )
        if dims.cp > 1:
            raise ArgumentError("--dry-run does not model --context-parallel-size > 1 yet")
        return estimate_memory(
            config,
            micro_batch_size=t.micro_batch_size,
            global_batch_size=t.global_batch_size,
            seq_length=m.seq_length,
            tp=dims.tp,
            pp=dims.pp,
            dp=dims.dp,
            sequence_parallel=d.sequence_parallel,
            param_dtype=param_dtype,
            activation_dtype="bf16" if t.bf16 else "fp16" if t.fp16 else "fp32",
            distributed_optimizer=d.use_distributed_optimizer,
            optimizer=args.optimizer.optimizer,
            # the attention core's selective recompute is what the estimate models
            recompute_granularity=(
                m.recompute_granularity
                if m.recompute_granularity == "full"
                or "core_attn" in selective_recompute_modules(m)
                else None
            ),
            recompute_method=m.recompute_method or "uniform",
            recompute_num_layers=m.recompute_num_layers or 1,
            # PyTorch SDPA keeps no score matrix, except on its math path (attention dropout).
            fused_attention=config.attention_dropout == 0.0,
            ep=args.moe.expert_model_parallel_size,
            etp=args.moe.expert_tensor_parallel_size,
        )
    except (ParallelLayoutError, MemoryEstimateError) as error:
        raise ArgumentError(f"--dry-run: {error}") from error


def _moe_lines(args: Args, config: TransformerConfig, est: MemoryEstimate) -> list[str]:
    """The experts' layout and the parameters a token uses (nothing for a dense model)."""
    if config.num_moe_experts is None:
        return []
    d, moe = args.distributed, args.moe
    tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
    ep = moe.expert_model_parallel_size
    etp = tp if moe.expert_tensor_parallel_size is None else moe.expert_tensor_parallel_size
    active = num_parameters(config, active=True)
    return [
        f"experts: {config.num_moe_experts} per MoE layer ({sum(config.moe_layer_pattern)} of "
        f"{config.num_layers} layers), top-{config.moe_router_topk}, expert ffn "
        f"{config.moe_ffn_hidden_size}, {config.moe_token_dispatcher_type} dispatcher; "
        f"EP {ep} x expert TP {etp} x expert DP {d.world_size // (pp * ep * etp)}, "
        f"{config.num_moe_experts // ep} experts per GPU{_routing(tp, etp)}",
        f"number of parameters active per token: {active / 1e9:.4f} B "
        f"(of {est.total_parameters / 1e9:.4f} B)",
    ]


def _mtp_lines(config: TransformerConfig) -> list[str]:
    """The multi-token prediction block's share of the parameters (nothing without one)."""
    if not config.mtp_num_layers:
        return []
    main = num_parameters(config, include_mtp=False)
    mtp = num_parameters(config) - main
    return [
        f"multi-token prediction: {config.mtp_num_layers} depth(s) on the last stage, "
        f"{mtp / 1e9:.4f} B parameters (main model {main / 1e9:.4f} B), loss scaling "
        f"factor {config.mtp_loss_scaling_factor}; its layers, norms, eh_proj and logits "
        "are in the FLOPs"
    ]


def kv_cache_line(config: TransformerConfig, dtype: str) -> str:
    """The KV cache one token costs at inference: a key and a value per query group and
    layer (sliding-window layers included: mg-serve's paged cache keeps every block)."""
    size = {"fp32": 4, "bf16": 2, "fp16": 2}[dtype]
    if config.multi_latent_attention:  # the compressed latent and the shared RoPE key
        latent = config.kv_lora_rank + config.qk_pos_emb_head_dim
        return (
            f"KV cache per token: {latent * config.num_layers * size} bytes in {dtype} "
            f"({config.num_layers} layers x ({config.kv_lora_rank} kv_lora_rank + "
            f"{config.qk_pos_emb_head_dim} qk_pos_emb_head_dim) x {size} bytes, MLA's latent)"
        )
    per_token = 2 * config.num_query_groups * config.kv_channels * config.num_layers * size
    return (
        f"KV cache per token: {per_token} bytes in {dtype} ({config.num_layers} layers x 2 x "
        f"{config.num_query_groups} groups x {config.kv_channels} channels x {size} bytes)"
    )


def _routing(tp: int, etp: int) -> str:
    """Which tokens a rank's router sees, under tensor parallelism."""
    if tp == 1:
        return ""
    if etp == tp:
        return "; each TP rank routes the whole sequence"
    if etp == 1:
        return "; each TP rank routes its own sequence slice"
    return f"; each group of {etp} TP ranks routes its sequence slices together"


def report(args: Args) -> str:
    """The dry-run report as text (Megatron's units: parameters in B, memory in GiB)."""
    if args.family == "mamba":
        return dry_run_report(args)
    if args.family in ("bert", "t5"):
        return encoder_dry_run_report(args, args.family)
    if args.family == "vlm":
        return vlm_dry_run_report(args)
    if args.family != "gpt":
        raise ArgumentError(f"--dry-run supports gpt, bert, t5, mamba and vlm, not {args.family}")
    config = get_family("gpt").build_config(args, padded_vocab_size(args))
    est = estimate(args, config)
    d, m, t = args.distributed, args.model, args.training
    tp, pp, cp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size, 1
    dp = d.world_size // (tp * pp * cp)
    meta = meta_parameter_count(config)
    stage = est.most_loaded
    bpp = est.bytes_per_parameter
    recompute = m.recompute_granularity or "none"
    if m.recompute_granularity == "selective":
        recompute = f"selective: {', '.join(selective_recompute_modules(m)) or 'nothing'}"
    act_dtype = "bf16" if t.bf16 else "fp16" if t.fp16 else "fp32"
    lines = [
        f"mg-train dry run: gpt, {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads ({config.num_query_groups} query groups), "
        f"ffn {config.ffn_hidden_size}, seq {m.seq_length}, padded vocab {config.vocab_size}",
        f"parallel layout: world {d.world_size} = TP {tp} x PP {pp} x DP {dp}, "
        f"sequence parallel {'on' if d.sequence_parallel else 'off'}, "
        f"distributed optimizer {'on' if d.use_distributed_optimizer else 'off'}",
        *_moe_lines(args, config, est),
        *_mtp_lines(config),
        f"batch: micro {t.micro_batch_size}, global {t.global_batch_size}, "
        f"{t.global_batch_size // (t.micro_batch_size * dp)} micro-batches per step, "
        f"{est.in_flight_micro_batches} in flight on the first stage (1F1B)",
        f"number of parameters: {est.total_parameters / 1e9:.4f} B "
        f"(meta-device model: {meta / 1e9:.4f} B{'' if meta == est.total_parameters else ' !'})",
        f"number of parameters on the most loaded GPU (stage {stage.stage}): "
        f"{stage.parameters / 1e9:.4f} B",
        kv_cache_line(config, act_dtype),
        f"FLOPs per iteration: {est.flops_per_iteration:.4E} "
        f"({est.flops_per_iteration / d.world_size:.4E} per GPU)",
        "",
        f"memory per GPU, stage {stage.stage} of {pp} (weights fp32, activations {act_dtype}, "
        f"recompute {recompute}):",
        f"  {'part':<34}{'bytes/param':>12}{'GiB':>12}",
        f"  {'weights':<34}{bpp.params:>12.2f}{stage.weights / _GIB:>12.3f}",
        f"  {'gradients':<34}{bpp.grads:>12.2f}{stage.gradients / _GIB:>12.3f}",
        f"  {'optimizer state':<34}{bpp.optimizer_state:>12.2f}"
        f"{stage.optimizer_state / _GIB:>12.3f}",
        f"  {f'activations (recompute {recompute})':<34}{'':>12}{stage.activations / _GIB:>12.3f}",
        f"  {'activations without recompute':<34}{'':>12}"
        f"{stage.activations_no_recompute / _GIB:>12.3f}",
        f"  {'total':<34}{bpp.total:>12.2f}{stage.total / _GIB:>12.3f}",
    ]
    weights_and_optimizer = stage.weights + stage.gradients + stage.optimizer_state
    lines.append(
        f"theoretical memory footprints: weight and optimizer={weights_and_optimizer / 2**20:.2f} "
        f"MB, activation={stage.activations / 2**20:.2f} MB, total={stage.total / 2**20:.2f} MB"
    )
    lines += fsdp_lines(args, config, stage.parameters)
    if t.bf16 or t.fp16:
        megatron = estimate(args, config, param_dtype=act_dtype).most_loaded
        lines.append(
            f"with Megatron's {act_dtype} weights and fp32 main parameters: "
            f"{megatron.total / _GIB:.3f} GiB per GPU"
        )
    return "\n".join(lines)
