"""Megatron-LM's vision-language flags (`pretrain_vlm.py`, `examples/multimodal`), their
group and checks.

`mg-train vlm` trains a LLaVA-style model (`mg.core.models.vision.LLaVAModel`): the
language model takes the usual model flags (`--num-layers`, `--hidden-size`, ...),
the ViT `--vision-model-type` (its shape the type's own, CLIP ViT-L/14 or SigLIP
so400m/14, or mg's `--vision-*` flags for a small one), images `--img-h` × `--img-w`
cut into `--patch-dim` patches. As in Megatron, `--seq-length` is the vision
tower's length (the image tokens) and `--decoder-seq-length` the language model's
(text and image tokens together).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args

VISION_MODEL_TYPES = ("clip", "siglip")
# Megatron's examples/multimodal/config.py shapes: CLIP ViT-L/14, SigLIP so400m/14
VISION_SHAPES = {
    "clip": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, ffn_hidden_size=4096),
    "siglip": dict(num_layers=27, hidden_size=1152, num_attention_heads=16, ffn_hidden_size=4304),
}
PROMPT_FORMATS = ("raw", "chatml", "mistral")
"""Supported --tokenizer-prompt-format values; Megatron's others are refused by name."""
MEGATRON_PROMPT_FORMATS = (
    "mistral",
    "llama3",
    "chatml",
    "nvlm-yi-34b",
    "qwen2p0",
    "qwen2p5",
    "llama3p1",
    "nemotron5",
)


@dataclass
class VLMArgs:
    """The vision tower, the projector, what is frozen and how text is rendered."""

    vision_model_type: str = "clip"
    img_h: int = 336
    img_w: int = 336
    patch_dim: int = 14
    disable_vision_class_token: bool = False
    freeze_LM: bool = False  # noqa: N815 (Megatron's flag name, --freeze-LM)
    freeze_ViT: bool = False  # noqa: N815 (--freeze-ViT)
    language_model_type: str | None = None
    tokenizer_prompt_format: str = "raw"
    projector_type: str = "mlp"
    projector_ffn_hidden_size: int | None = None
    vision_num_layers: int | None = None
    vision_hidden_size: int | None = None
    vision_num_attention_heads: int | None = None
    vision_ffn_hidden_size: int | None = None
    pretrained_checkpoint: str | None = None
    allow_missing_vision_projection_checkpoint: bool = False
    prompt_path: str | None = None
    use_te: bool = False
    dataloader_save: str | None = None
    dataloader_type: str | None = None

    def vision_shape(self) -> dict[str, int]:
        """The ViT's shape: the type's own, each field overridable by a --vision-* flag."""
        shape = dict(VISION_SHAPES.get(self.vision_model_type, VISION_SHAPES["clip"]))
        for name in shape:
            given = getattr(self, f"vision_{name}")
            if given is not None:
                shape[name] = given
        return shape


def add_vlm_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--vision-model-type",
        default="clip",
        choices=VISION_MODEL_TYPES,
        help="clip: class token, pre-LayerNorm, QuickGELU; siglip: no class token, GELU-tanh.",
    )
    p.add_argument("--img-h", type=int, default=336, help="Image height (pixels).")
    p.add_argument("--img-w", type=int, default=336, help="Image width (pixels).")
    p.add_argument("--patch-dim", type=int, default=14, help="ViT patch side (pixels).")
    p.add_argument(
        "--disable-vision-class-token",
        action="store_true",
        help="Drop the class token's feature before the projector (LLaVA's 'default').",
    )
    p.add_argument(
        "--freeze-LM",
        dest="freeze_LM",
        action="store_true",
        help="Freeze the language model: no gradients, no optimizer state.",
    )
    p.add_argument(
        "--freeze-ViT",
        dest="freeze_ViT",
        action="store_true",
        help="Freeze the vision tower: no gradients, no optimizer state.",
    )
    p.add_argument(
        "--language-model-type",
        help="Megatron's name of the language model (e.g. mistral_7b); recorded in the "
        "checkpoint; its shape comes from the model flags.",
    )
    p.add_argument(
        "--tokenizer-prompt-format",
        default="raw",
        help="How conversations become text: raw (turns joined, mg's), chatml or mistral.",
    )
    p.add_argument(
        "--projector-type", default="mlp", help="Vision projection: mlp (2 layers, GELU)."
    )
    p.add_argument(
        "--projector-ffn-hidden-size",
        type=int,
        help="Projector's inner width; default the language model's hidden size (LLaVA's).",
    )
    for name, what in (
        ("num-layers", "layers"),
        ("hidden-size", "hidden size"),
        ("num-attention-heads", "attention heads"),
        ("ffn-hidden-size", "MLP width"),
    ):
        p.add_argument(
            f"--vision-{name}",
            type=int,
            help=f"ViT {what}; default the --vision-model-type's own (mg's flag).",
        )
    p.add_argument(
        "--pretrained-checkpoint",
        help="Checkpoint to start from (Megatron's combined language + vision checkpoint).",
    )
    p.add_argument(
        "--allow-missing-vision-projection-checkpoint",
        action="store_true",
        help="Start the projector from its init when --pretrained-checkpoint has none.",
    )
    add_vlm_data_flags(p)


DATALOADER_TYPES = ("single", "cyclic", "external")


def add_vlm_data_flags(p: argparse._ArgumentGroup) -> None:
    """examples/multimodal's data-loading flags (multimodal_args.py, `--dataloader-type`)."""
    p.add_argument(
        "--prompt-path",
        help="Megatron's manual prompts (JSON) for its task encoder; mg-prep's samples carry "
        "their prompts, so mg records the path only.",
    )
    p.add_argument(
        "--use-te",
        action="store_true",
        help="Megatron's multimodal flag for Transformer Engine layers; mg follows "
        "--transformer-impl.",
    )
    p.add_argument(
        "--dataloader-save",
        help="Energon's loader state path; mg resumes its loader from the checkpoint's "
        "consumed-sample count instead.",
    )
    p.add_argument(
        "--dataloader-type",
        choices=DATALOADER_TYPES,
        help="single: one pass per epoch over Megatron's sampler (mg's); external: the "
        "dataset's own loader (examples/multimodal's energon one; mg's WebDataset reader).",
    )


def check_vlm_flags(args: Args) -> str | None:
    """The message for a vision-language flag that cannot apply, or None."""
    v = args.vlm
    if args.family != "vlm":
        defaults = VLMArgs()
        for f in fields(VLMArgs):
            if getattr(v, f.name) != getattr(defaults, f.name):
                flag = "--" + f.name.replace("_", "-")
                return f"{flag} is a vision-language flag: use `mg-train vlm`, not {args.family}"
        return None
    if v.tokenizer_prompt_format not in PROMPT_FORMATS:
        known = v.tokenizer_prompt_format in MEGATRON_PROMPT_FORMATS
        return (
            f"--tokenizer-prompt-format {v.tokenizer_prompt_format}: "
            + ("Megatron's format is not implemented in mg yet" if known else "unknown format")
            + f"; use one of {', '.join(PROMPT_FORMATS)}"
        )
    if v.projector_type != "mlp":
        return f"--projector-type {v.projector_type}: only mlp (Megatron's default) is supported"
    for name, size in (("--img-h", v.img_h), ("--img-w", v.img_w)):
        if size <= 0 or v.patch_dim <= 0 or size % v.patch_dim:
            return f"{name} {size}: must be a positive multiple of --patch-dim ({v.patch_dim})"
    if v.vision_model_type == "siglip" and v.disable_vision_class_token:
        return "--disable-vision-class-token: a SigLIP tower has no class token to drop"
    shape = v.vision_shape()
    if shape["hidden_size"] % shape["num_attention_heads"]:
        return (
            f"--vision-hidden-size {shape['hidden_size']} is not a multiple of "
            f"--vision-num-attention-heads {shape['num_attention_heads']}"
        )
    if v.dataloader_type == "cyclic":
        return "--dataloader-type cyclic: not implemented for mg-train vlm; use single or external"
    if v.allow_missing_vision_projection_checkpoint and v.pretrained_checkpoint is None:
        return "--allow-missing-vision-projection-checkpoint: only with --pretrained-checkpoint"
    m = args.model
    if m.decoder_seq_length is None:
        return "mg-train vlm needs --decoder-seq-length (the language model's sequence length)"
    image_tokens = image_tokens_of(v)
    if m.seq_length != image_tokens:
        return (
            f"--seq-length {m.seq_length}: for mg-train vlm it is the vision tower's length, "
            f"and a {v.img_h}x{v.img_w} image in {v.patch_dim}-pixel patches gives "
            f"{image_tokens} tokens"
            + ("" if v.disable_vision_class_token else " (with the class token)")
        )
    if m.decoder_seq_length <= image_tokens:
        return (
            f"--decoder-seq-length {m.decoder_seq_length} leaves no room for text after the "
            f"{image_tokens} image tokens"
        )
    if m.max_position_embeddings is not None and m.max_position_embeddings < m.decoder_seq_length:
        return (
            f"--decoder-seq-length {m.decoder_seq_length} is longer than "
            f"--max-position-embeddings {m.max_position_embeddings}"
        )
    d = args.distributed
    if d.context_parallel_size > 1:
        return "mg-train vlm: context parallelism is not implemented for vision-language models"
    tp = d.tensor_model_parallel_size
    if d.sequence_parallel and m.decoder_seq_length % tp:
        return (
            f"--sequence-parallel: --decoder-seq-length {m.decoder_seq_length} must be a "
            f"multiple of --tensor-model-parallel-size {tp} (each rank takes a slice)"
        )
    if d.pipeline_model_parallel_size > 1 and d.use_distributed_optimizer and v.freeze_LM:
        return (
            "--use-distributed-optimizer with --pipeline-model-parallel-size > 1 and "
            "--freeze-LM: the later stages train nothing, which the distributed optimizer does "
            "not support yet; drop --use-distributed-optimizer or pipeline parallelism"
        )
    return None


def image_tokens_of(v: VLMArgs) -> int:
    """Rows an image takes in the language model's sequence."""
    patches = (v.img_h // v.patch_dim) * (v.img_w // v.patch_dim)
    keeps_class = v.vision_model_type != "siglip" and not v.disable_vision_class_token
    return patches + (1 if keeps_class else 0)


TRACKER_FILENAME = "latest_checkpointed_iteration.txt"  # Megatron's, in a --load folder


def start_from_pretrained(args: Args) -> None:
    """Megatron's `--pretrained-checkpoint` rule: while --load holds no checkpoint (a
    first run), the weights come from the pretrained (combined) checkpoint, as with
    --finetune; later runs resume from --load. With
    --allow-missing-vision-projection-checkpoint a `torch_dist` load leaves the tensors
    the checkpoint lacks (the projector) at their init, saying which
    (`--dist-ckpt-strictness log_unexpected`)."""
    v, c = args.vlm, args.checkpoint
    if v.pretrained_checkpoint is None or args.training.dry_run:
        return
    if c.load is not None and (Path(c.load) / TRACKER_FILENAME).is_file():
        return
    print(
        f"no checkpoint in --load {c.load}: starting from --pretrained-checkpoint "
        f"{v.pretrained_checkpoint} (weights only)",
        file=sys.stderr,
    )
    c.load, c.finetune = v.pretrained_checkpoint, True
    if v.allow_missing_vision_projection_checkpoint:
        if c.ckpt_format != "torch_dist":
            fail(
                "--allow-missing-vision-projection-checkpoint: a checkpoint without the "
                f"projector loads with --ckpt-format torch_dist only, not {c.ckpt_format}"
            )
        if c.dist_ckpt_strictness == "assume_ok_unexpected":
            c.dist_ckpt_strictness = "log_unexpected"


def check_vlm(args: Args) -> None:
    error = check_vlm_flags(args)
    if error:
        fail(error)
    if args.family == "vlm":
        start_from_pretrained(args)
