"""`mg-train mamba`: Megatron's pretrain_mamba.py, a Mamba-2 or hybrid language model.

Its own family (as Megatron has its own entry point) rather than `gpt` with a
pattern: the checkpoint then records a `MambaConfig`, and a GPT run can never
pick up a hybrid flag by accident (`arguments.mamba.check_mamba_flags` refuses
Mamba flags for other families). Data, loss, logging, checkpoints, data
parallelism and the distributed optimizer are GPT's; tensor, pipeline and
context parallelism are refused for now with a message naming the flag
(Megatron splits Mamba heads and groups across TP ranks; mg does not yet).
"""

from __future__ import annotations

from torch import nn

from mg.trainer.arguments import Args, ArgumentError
from mg.trainer.families import gpt_config


def mamba_config(args: Args, vocab_size: int):
    """Megatron's model flags plus the Mamba group onto `MambaConfig`."""
    from mg.core.models import ConfigError
    from mg.core.models.mamba import MambaConfig

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
    from mg.core.models.mamba import MambaModel

    model = MambaModel(config)
    if args is not None and args.mamba.mamba_ssm_kernels:
        from mg.core.models.mamba.kernels import use_mamba_ssm_kernels

        use_mamba_ssm_kernels(model)  # not in the config: the checkpoint runs anywhere
    return model


def dry_run_report(args: Args) -> str:
    """What a run would hold per GPU: the layer pattern, the parameters (counted on a
    meta-device model) and the bytes of weights, gradients and optimizer state.
    Activations of Mamba layers are not modelled (mg.core.models.memory knows
    transformer layers only), so no activation figure is printed."""
    import torch

    from mg.core.models.mamba import MambaModel
    from mg.trainer.dry_run import _vocab_size

    config = mamba_config(args, _vocab_size(args))
    d, t = args.distributed, args.training
    tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
    dp = d.world_size // (tp * pp * d.context_parallel_size)
    with torch.device("meta"):
        total = sum(p.numel() for p in MambaModel(config).parameters())
    per_gpu = total / (tp * pp)
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
            f"distributed optimizer {'on' if d.use_distributed_optimizer else 'off'}",
            f"batch: micro {t.micro_batch_size}, global {t.global_batch_size}",
            f"number of parameters: {total / 1e9:.4f} B (meta-device model)",
            f"number of parameters per GPU (even split over TP x PP): {per_gpu / 1e9:.4f} B",
            f"weights + gradients + optimizer state per GPU (fp32, Adam): "
            f"{per_gpu * (8 + optimizer_bytes) / gib:.3f} GiB "
            f"({8 + optimizer_bytes:.2f} bytes/parameter); activations not modelled",
        ]
    )
