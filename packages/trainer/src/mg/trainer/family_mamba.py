"""`mg-train mamba`: Megatron's pretrain_mamba.py, a Mamba-2 or hybrid language model.

Its own family (as Megatron has its own entry point) rather than `gpt` with a
pattern: the checkpoint then records a `MambaConfig`, and a GPT run can never
pick up a hybrid flag by accident (`arguments.mamba.check_mamba_flags` refuses
Mamba flags for other families). Data, loss, logging, checkpoints, data
parallelism, the distributed optimizer and tensor and pipeline parallelism are
GPT's (a Mamba mixer split by heads and groups over TP ranks as Megatron's
MambaMixer, `mg.core.parallel.tensor_parallel_mamba`; the layer pattern cut into
pipeline stages as GPT's layers are). Context parallelism is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from mg.core.models import ConfigError
from mg.core.models.mamba import MambaConfig, MambaModel
from mg.core.models.mamba.kernels import use_mamba_ssm_kernels
from mg.core.parallel.pipeline import layer_ranges
from mg.core.parallel.tensor_parallel import TensorParallelError, check_tensor_parallel_sizes
from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.family_gpt import gpt_config
from mg.trainer.padded_vocab import padded_vocab_size


def mamba_config(args: Args, vocab_size: int):
    """Megatron's model flags plus the Mamba group onto `MambaConfig`."""
    try:
        if args.checkpoint_model_config is not None:
            return MambaConfig.from_dict(dict(args.checkpoint_model_config))
        mb = args.mamba
        return MambaConfig(
            **gpt_config(args, vocab_size).to_dict(),
            mamba_state_dim=mb.mamba_state_dim,
            mamba_head_dim=mb.mamba_head_dim,
            mamba_num_groups=mb.mamba_num_groups,
            mamba_num_heads=mb.mamba_num_heads,
            mamba_chunk_size=mb.mamba_chunk_size,
            hybrid_attention_ratio=mb.hybrid_attention_ratio,
            hybrid_mlp_ratio=mb.hybrid_mlp_ratio,
            hybrid_override_pattern=mb.hybrid_override_pattern,
        )
    except ConfigError as error:
        raise ArgumentError(str(error)) from None


def mamba_model(config, args: Args | None = None) -> nn.Module:
    model = MambaModel(config)
    if args is not None and args.mamba.mamba_ssm_kernels:
        use_mamba_ssm_kernels(model)  # not in the config: the checkpoint runs anywhere
    return model


def _replicated_over_tp(name: str) -> bool:
    """Parameters every tensor-parallel rank holds whole: the layer norms (not the mixer's
    gated norm, split with its channels) and the row-parallel linears' biases."""
    if name.endswith(("linear_proj.bias", "linear_fc2.bias")):
        return True
    return "norm" in name and ".mixer.norm." not in name


def parallel_plan(config, tp: int, pp: int) -> tuple[list[str], int]:
    """The TP/PP plan's lines (each stage's layers and parameters per GPU, each rank's share
    of a layer), and the largest stage's parameters per GPU (what sizes the memory)."""
    with torch.device("meta"):
        model = MambaModel(config)
    pattern = config.layer_pattern
    lines, largest = [], 0
    for stage, ((start, end),) in enumerate(layer_ranges(config.num_layers, pp)):
        held = [f"decoder.layers.{i}." for i in range(start, end)]
        if stage == 0:
            held.append("embedding.")
        if stage == pp - 1:
            held += ["decoder.final_norm.", "output_layer."]
        count = 0.0
        for name, param in model.named_parameters():
            if name.startswith(tuple(held)):
                count += param.numel() / (1 if _replicated_over_tp(name) else tp)
        tied_copy = stage == pp - 1 and pp > 1 and model.output_layer is None
        if tied_copy:  # the last stage's own copy of the tied embedding (Megatron's)
            count += model.embedding.word_embeddings.weight.numel() / tp
        largest = max(largest, int(count))
        ends = " + embedding" if stage == 0 else ""
        ends += " + final norm, output layer" if stage == pp - 1 else ""
        ends += " (tied: a copy of the embedding)" if tied_copy else ""
        lines.append(
            f"  stage {stage}: layers {start}-{end - 1} {pattern[start:end]!r}{ends}, "
            f"{int(count):,} parameters per GPU"
        )
    heads, groups = config.mamba_num_heads // tp, config.mamba_num_groups // tp
    per_rank = (
        f"per tensor-parallel rank: {heads} of {config.mamba_num_heads} Mamba heads, "
        f"{groups} of {config.mamba_num_groups} groups (in_proj as [z; x; B; C; dt] slices), "
        f"{config.num_attention_heads // tp} attention heads, "
        f"vocabulary rows {config.vocab_size // tp}"
    )
    return [per_rank, "pipeline stages (Megatron's split of the layer pattern):", *lines], largest


def dry_run_report(args: Args) -> str:
    """What a run would hold per GPU: the layer pattern, its split over pipeline stages and
    tensor-parallel ranks, the parameters (counted on a meta-device model) and the bytes
    of weights, gradients and optimizer state of the largest stage. Activations of Mamba
    layers are not modelled (mg.core.models.memory knows transformer layers only), so no
    activation figure is printed."""
    config = mamba_config(args, padded_vocab_size(args))
    d, t = args.distributed, args.training
    tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
    dp = d.world_size // (tp * pp * d.context_parallel_size)
    try:
        check_tensor_parallel_sizes(config, tp)
    except TensorParallelError as error:
        raise ArgumentError(str(error)) from None
    with torch.device("meta"):
        total = sum(p.numel() for p in MambaModel(config).parameters())
    plan, per_gpu = parallel_plan(config, tp, pp)
    optimizer_bytes = 8 / dp if d.use_distributed_optimizer else 8.0  # Adam's two fp32 moments
    pattern = config.layer_pattern
    gib = 2**30
    return "\n".join(
        [
            f"mg-train dry run: mamba, {config.num_layers} layers "
            f"({pattern.count('M')} Mamba, {pattern.count('*')} attention, "
            f"{pattern.count('-')} MLP), hidden {config.hidden_size}, "
            f"{config.mamba_num_heads} Mamba heads x {config.mamba_head_dim}, "
            f"state {config.mamba_state_dim}, {config.mamba_num_groups} groups, "
            f"seq {args.model.seq_length}, padded vocab {config.vocab_size}",
            f"layer pattern: {pattern}",
            f"parallel layout: world {d.world_size} = TP {tp} x PP {pp} x DP {dp}, "
            f"sequence parallel {'on' if d.sequence_parallel else 'off'}, "
            f"distributed optimizer {'on' if d.use_distributed_optimizer else 'off'}",
            *plan,
            f"batch: micro {t.micro_batch_size}, global {t.global_batch_size}",
            f"number of parameters: {total / 1e9:.4f} B (meta-device model)",
            f"number of parameters per GPU (largest stage, its TP shard): {per_gpu / 1e9:.4f} B",
            f"weights + gradients + optimizer state per GPU (fp32, Adam): "
            f"{per_gpu * (8 + optimizer_bytes) / gib:.3f} GiB "
            f"({8 + optimizer_bytes:.2f} bytes/parameter); activations not modelled",
        ]
    )
