"""`mg-train bert|t5 --dry-run`: the encoder families' layout and memory, from a model on
the meta device (no weights allocated)."""

from __future__ import annotations

import torch
from torch import nn

from mg.core.models import BertModel, T5Model
from mg.trainer.arguments import Args
from mg.trainer.family_bert import bert_config
from mg.trainer.family_t5 import t5_config
from mg.trainer.padded_vocab import padded_vocab_size

_TP_SHARDED = (
    "word_embeddings.weight",
    "linear_qkv.",
    "linear_q.",
    "linear_kv.",
    "linear_fc1.",
    "linear_proj.weight",
    "linear_fc2.weight",
    "output_layer.",
)


def _stages_of(name: str, num_layers: int, pp: int, tied: bool) -> list[int]:
    """The pipeline stages holding parameter `name` (layers by Megatron's even split; the
    embedding on the first stage, heads on the last; a tied output copy there too)."""
    if name.startswith(("encoder.layers.", "decoder.layers.")):
        return [int(name.split(".")[2]) * pp // num_layers]
    if name == "embedding.word_embeddings.weight" and tied and pp > 1:
        return [0, pp - 1]
    return [0] if name.startswith("embedding.") else [pp - 1]


def parameters_per_gpu(model: nn.Module, tp: int, pp: int) -> list[float]:
    """Parameters one GPU of each pipeline stage holds (a BertModel or T5Model, as
    tensor and pipeline parallelism split it)."""
    config = model.config
    tied = not config.untie_embeddings_and_output_weights
    per_stage = [0.0] * pp
    for name, param in model.named_parameters():
        share = param.numel() / tp if any(k in name for k in _TP_SHARDED) else param.numel()
        for stage in _stages_of(name, config.num_layers, pp, tied):
            per_stage[stage] += share
    return per_stage


def encoder_dry_run_report(args: Args, family: str) -> str:
    """`mg-train bert|t5 --dry-run`: the layout, the parameters per GPU (counted on a
    meta-device model, sharded as tensor and pipeline parallelism shard it) and the bytes
    of fp32 weights, gradients and Adam state. Activations are not modelled for these
    families (mg.core.models.memory models the GPT decoder), so no activation figure."""
    if family == "bert":
        config = bert_config(args, padded_vocab_size(args))
        with torch.device("meta"):
            model = BertModel(config, add_binary_head=args.model.bert_binary_head)
    else:
        config = t5_config(args, padded_vocab_size(args))
        with torch.device("meta"):
            model = T5Model(config)
    d, t = args.distributed, args.training
    tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
    dp = d.world_size // (tp * pp)
    total = sum(p.numel() for p in model.parameters())
    per_stage = parameters_per_gpu(model, tp, pp)
    most = max(range(pp), key=lambda s: per_stage[s])
    optimizer_bytes = 8 / dp if d.use_distributed_optimizer else 8.0  # Adam's fp32 moments
    gib = 2**30
    seq = f"seq {args.model.seq_length}"
    if family == "t5":
        seq = f"encoder seq {args.model.seq_length}, decoder seq {config.decoder_seq_length}"
    return "\n".join(
        [
            f"mg-train dry run: {family}, {config.num_layers} layers"
            + (" (encoder and decoder each)" if family == "t5" else "")
            + f", hidden {config.hidden_size}, {config.num_attention_heads} heads, "
            f"ffn {config.ffn_hidden_size}, {seq}, padded vocab {config.vocab_size}",
            f"parallel layout: world {d.world_size} = TP {tp} x PP {pp} x DP {dp}, "
            f"sequence parallel {'on' if d.sequence_parallel else 'off'}, "
            f"distributed optimizer {'on' if d.use_distributed_optimizer else 'off'}",
            f"batch: micro {t.micro_batch_size}, global {t.global_batch_size}, "
            f"{t.global_batch_size // (t.micro_batch_size * dp)} micro-batches per step",
            f"number of parameters: {total / 1e9:.4f} B (meta-device model)",
            f"number of parameters on the most loaded GPU (stage {most}): "
            f"{per_stage[most] / 1e9:.4f} B",
            f"weights + gradients + optimizer state on that GPU (fp32, Adam): "
            f"{per_stage[most] * (8 + optimizer_bytes) / gib:.3f} GiB "
            f"({8 + optimizer_bytes:.2f} bytes/parameter); activations not modelled",
        ]
    )
