"""`mg-train vlm --dry-run`: the towers' sizes, what trains, a sample's tokens, memory per GPU.

The model is built on the meta device (no storage), so every count is the model's own:
the vision tower, the projector and the language model, each frozen (`--freeze-ViT`,
`--freeze-LM`) or trained. Memory per GPU is for the first pipeline stage (the towers
live there, as in Megatron's LLaVAModel), mg's way: fp32 weights for every parameter,
fp32 gradients and Adam's two moments for the trained ones only (frozen towers get
neither), the moments split over the data-parallel ranks with
`--use-distributed-optimizer`; tensor parallelism splits the layers' matrices (the few
replicated tensors, norms and the ViT's embeddings, are counted as split: under 1%).
"""

from __future__ import annotations

import torch
from torch import nn

from mg.core.models.vision import LLaVAModel
from mg.trainer.arguments import Args
from mg.trainer.family_vlm import vlm_config, vlm_model
from mg.trainer.padded_vocab import padded_vocab_size

_GIB = 2**30


def _count(module: nn.Module) -> tuple[int, int]:
    """(parameters, trained parameters) of a module."""
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def meta_model(args: Args) -> LLaVAModel:
    with torch.device("meta"):
        return vlm_model(vlm_config(args, padded_vocab_size(args)), args)


def vlm_dry_run_report(args: Args) -> str:
    model = meta_model(args)
    config = model.config
    d, t, v = args.distributed, args.training, args.vlm
    tp, pp = d.tensor_model_parallel_size, d.pipeline_model_parallel_size
    dp = d.world_size // (tp * pp)
    towers = {
        f"vision_model ({v.vision_model_type})": _count(model.vision_model),
        "vision_projection (mlp)": _count(model.vision_projection),
        "language_model": _count(model.language_model),
    }
    total = sum(n for n, _ in towers.values())
    trained = sum(k for _, k in towers.values())
    image = config.image_tokens
    dropped = "; class token dropped" if config.drop_vision_class_token else ""
    length = config.language.seq_length
    lines = [
        f"mg-train dry run: vlm, {v.vision_model_type} {v.img_h}x{v.img_w} in "
        f"{v.patch_dim}-pixel patches, language model {v.language_model_type or 'from the flags'}"
        f" ({config.language.num_layers} layers, hidden {config.language.hidden_size}, "
        f"padded vocab {config.language.vocab_size})",
        f"parallel layout: world {d.world_size} = TP {tp} x PP {pp} x DP {dp}, "
        f"distributed optimizer {'on' if d.use_distributed_optimizer else 'off'}",
        f"tokens per sample: {length} = {image} image tokens + {length - image} text tokens "
        f"(the <image> tag expanded{dropped})",
        f"batch: micro {t.micro_batch_size}, global {t.global_batch_size}, "
        f"{t.global_batch_size // (t.micro_batch_size * dp)} micro-batches per step",
        "",
        f"  {'tower':<34}{'parameters':>16}{'state':>10}",
    ]
    for name, (n, k) in towers.items():
        state = "trained" if k == n else "frozen" if k == 0 else "partly"
        lines.append(f"  {name:<34}{n / 1e9:>14.4f} B{state:>10}")
    lines += [
        f"  {'total':<34}{total / 1e9:>14.4f} B",
        f"number of parameters: {total / 1e9:.4f} B, trained {trained / 1e9:.4f} B, "
        f"frozen {(total - trained) / 1e9:.4f} B",
    ]
    lm_layers = config.language.num_layers
    vision_n, vision_k = towers[f"vision_model ({v.vision_model_type})"]
    proj_n, proj_k = towers["vision_projection (mlp)"]
    lm = model.language_model
    embed_n, embed_k = _count(lm.embedding)
    layers_n, layers_k = _count(lm.decoder.layers)
    per_layer = (layers_n // lm_layers, layers_k // lm_layers)
    stage_layers = lm_layers // pp
    stage = (
        vision_n + proj_n + embed_n + per_layer[0] * stage_layers,
        vision_k + proj_k + embed_k + per_layer[1] * stage_layers,
    )
    if pp == 1:
        stage = (total, trained)
    weights = 4 * stage[0] / tp
    grads = 4 * stage[1] / tp
    optimizer = 8 * stage[1] / tp / (dp if d.use_distributed_optimizer else 1)
    lines += [
        "",
        f"memory per GPU, stage 0 of {pp} (the towers, {stage_layers} language layers):",
        f"  {'weights (fp32, all)':<34}{weights / _GIB:>12.3f} GiB",
        f"  {'gradients (fp32, trained only)':<34}{grads / _GIB:>12.3f} GiB",
        f"  {'optimizer state (Adam, trained)':<34}{optimizer / _GIB:>12.3f} GiB",
        f"  {'total before activations':<34}{(weights + grads + optimizer) / _GIB:>12.3f} GiB",
    ]
    recorded = [
        flag
        for flag, value in (
            ("--prompt-path", v.prompt_path),
            ("--dataloader-save", v.dataloader_save),
            ("--use-te", v.use_te),
        )
        if value
    ]
    if args.transformer_engine.transformer_impl == "transformer_engine":
        lines.append(
            "--transformer-impl transformer_engine: planned; a vlm run takes the local "
            "layers (it refuses the flag outside --dry-run)"
        )
    if recorded:
        lines.append(f"recorded, not used by mg: {', '.join(recorded)}")
    if v.pretrained_checkpoint:
        lines.append(
            f"a first run (no checkpoint in --load) starts from --pretrained-checkpoint "
            f"{v.pretrained_checkpoint}"
            + (
                ", the projector from its init"
                if v.allow_missing_vision_projection_checkpoint
                else ""
            )
        )
    return "\n".join(lines)
