"""Megatron-LM's training flags, parsed once into typed dataclasses.

    args = parse_args(["gpt", "--num-layers", "2", ...])   # or --config run.yaml
    args.model.hidden_size, args.training.global_batch_size, args.optimizer.lr

Every flag keeps Megatron's name, so commands written for `pretrain_gpt.py`
work with `mg-train gpt`. A YAML file given with `--config` holds the same
flags as keys (`hidden_size` or `hidden-size`); flags on the command line win.
`validate` refuses inconsistent settings with Megatron-like messages before
anything heavy (datasets, models, process groups) is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from mg.core.help_format import DefaultsHelpFormatter
from mg.trainer.arguments_mamba import MambaArgs, add_mamba_flags, check_mamba_flags
from mg.trainer.arguments_moe import MoEArgs, add_moe_flags, check_moe_flags

FAMILIES = ("gpt", "bert", "t5", "mamba")


class ArgumentError(ValueError):
    """A flag or a combination of flags that cannot work; the message says which and why."""


@dataclass
class ModelArgs:
    """The network's shape (`--num-layers` ...), mapped one to one onto TransformerConfig."""

    num_layers: int | None = None
    hidden_size: int | None = None
    ffn_hidden_size: int | None = None
    num_attention_heads: int | None = None
    group_query_attention: bool = False
    num_query_groups: int = 1
    kv_channels: int | None = None
    seq_length: int | None = None
    encoder_seq_length: int | None = None
    decoder_seq_length: int | None = None
    bert_binary_head: bool = True
    max_position_embeddings: int | None = None
    position_embedding_type: str = "learned_absolute"
    add_position_embedding: bool = True
    masked_softmax_fusion: bool = True
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    disable_bias_linear: bool = False
    add_qkv_bias: bool = False
    qk_layernorm: bool = False
    untie_embeddings_and_output_weights: bool = False
    init_method_std: float = 0.02
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    make_vocab_size_divisible_by: int = 128
    use_flash_attn: bool = False
    transformer_impl: str = "local"
    recompute_activations: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None


@dataclass
class DataArgs:
    """Where samples come from and which tokenizer made them."""

    data_path: list[str] | None = None
    data_args_path: str | None = None
    split: str | None = None
    mock_data: bool = False
    data_cache_path: str | None = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    tokenizer_type: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    tokenizer_model: str | None = None
    vocab_size: int | None = None
    vocab_extra_ids: int = 0
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1


@dataclass
class TrainingArgs:
    """How long, in what batches, at which precision."""

    micro_batch_size: int | None = None
    global_batch_size: int | None = None
    rampup_batch_size: list[int] | None = None
    train_iters: int | None = None
    train_samples: int | None = None
    seed: int = 1234
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    exit_signal_handler: bool = False
    deterministic_mode: bool = False
    bf16: bool = False
    fp16: bool = False
    torch_compile: bool = False
    cross_entropy_loss_fusion: bool = False
    dry_run: bool = False
    use_cpu_initialization: bool = False
    init_model_with_meta_device: bool = False


@dataclass
class OptimizerArgs:
    """Optimizer, learning-rate schedule, clipping and fp16 loss scaling."""

    optimizer: str = "adam"
    lr: float | None = None
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None
    lr_decay_samples: int | None = None
    lr_warmup_fraction: float | None = None
    lr_warmup_iters: int = 0
    lr_warmup_samples: int = 0
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_samples: int | None = None
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2


@dataclass
class CheckpointArgs:
    """Saving and resuming (`torch_dist` by default, as in Megatron; `torch` on request)."""

    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    finetune: bool = False
    use_checkpoint_args: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    ckpt_format: str = "torch_dist"
    async_save: bool = False
    perform_initialization: bool = True
    overwrite_checkpoints: bool = False


@dataclass
class LoggingArgs:
    """What is printed and where metrics go."""

    log_interval: int = 100
    tensorboard_dir: str | None = None
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None


@dataclass
class DistributedArgs:
    """Parallel layout; this release does data parallelism only."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    context_parallel_size: int = 1
    distributed_timeout_minutes: float = 10.0
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    distributed_backend: str | None = None
    ddp_bucket_size: int | None = None
    # Filled from the torchrun environment, not from flags.
    world_size: int = 1


@dataclass
class Args:
    """Everything `mg-train` was asked to do, grouped by concern."""

    family: str
    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    training: TrainingArgs = field(default_factory=TrainingArgs)
    optimizer: OptimizerArgs = field(default_factory=OptimizerArgs)
    checkpoint: CheckpointArgs = field(default_factory=CheckpointArgs)
    logging: LoggingArgs = field(default_factory=LoggingArgs)
    distributed: DistributedArgs = field(default_factory=DistributedArgs)
    mamba: MambaArgs = field(default_factory=MambaArgs)
    moe: MoEArgs = field(default_factory=MoEArgs)
    # Set by --use-checkpoint-args (mg.trainer.checkpoint_args), not by flags.
    checkpoint_model_config: dict[str, Any] | None = None
    checkpoint_tokenizer_config: Any = None

    @property
    def data_parallel_size(self) -> int:
        d = self.distributed
        model_parallel = (
            d.tensor_model_parallel_size * d.pipeline_model_parallel_size * d.context_parallel_size
        )
        return max(d.world_size // model_parallel, 1)

    def flat(self) -> dict[str, Any]:
        """All fields as one flat dict with Megatron's names (what a checkpoint's `args` holds)."""
        out: dict[str, Any] = {"model_family": self.family}
        for group in _GROUPS:
            out.update(dataclasses.asdict(getattr(self, group)))
        out["data_parallel_size"] = self.data_parallel_size
        return out


_GROUPS = {
    "model": ModelArgs,
    "data": DataArgs,
    "training": TrainingArgs,
    "optimizer": OptimizerArgs,
    "checkpoint": CheckpointArgs,
    "logging": LoggingArgs,
    "distributed": DistributedArgs,
    "mamba": MambaArgs,
    "moe": MoEArgs,
}
_NOT_FLAGS = {"world_size"}


def _add_model_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--num-layers", type=int, help="Number of transformer layers.")
    p.add_argument("--hidden-size", type=int, help="Transformer hidden size.")
    p.add_argument(
        "--ffn-hidden-size", type=int, help="MLP width; default 4*hidden (SwiGLU: Megatron's 8/3)."
    )
    p.add_argument("--num-attention-heads", type=int, help="Number of attention heads.")
    p.add_argument(
        "--group-query-attention", action="store_true", help="Use --num-query-groups K/V heads."
    )
    p.add_argument(
        "--num-query-groups", type=int, default=1, help="K/V heads with --group-query-attention."
    )
    p.add_argument("--kv-channels", type=int, help="Channels per head; default hidden/heads.")
    p.add_argument("--seq-length", type=int, help="Tokens per sample.")
    p.add_argument(
        "--encoder-seq-length", type=int, help="T5/BERT encoder tokens; sets --seq-length."
    )
    p.add_argument("--decoder-seq-length", type=int, help="T5 decoder tokens per sample.")
    p.add_argument(
        "--bert-no-binary-head",
        dest="bert_binary_head",
        action="store_false",
        help="BERT without the sentence-order (binary) head and its loss.",
    )
    p.add_argument(
        "--max-position-embeddings", type=int, help="Longest supported sequence; default seq."
    )
    p.add_argument(
        "--position-embedding-type",
        default="learned_absolute",
        choices=["learned_absolute", "rope", "none"],
        help="Learned absolute positions (GPT-2) or rotary (Llama).",
    )
    p.add_argument(
        "--no-position-embedding",
        dest="add_position_embedding",
        action="store_false",
        help="Megatron's: no learned absolute positions (position type none unless rope).",
    )
    p.add_argument(
        "--no-masked-softmax-fusion",
        dest="masked_softmax_fusion",
        action="store_false",
        help="Accepted for Megatron scripts; mg's attention (SDPA) has no masked-softmax kernel.",
    )
    p.add_argument("--rotary-base", type=float, default=10000.0, help="RoPE base (theta).")
    p.add_argument(
        "--rotary-percent", type=float, default=1.0, help="Fraction of head channels rotated."
    )
    p.add_argument(
        "--normalization", default="LayerNorm", choices=["LayerNorm", "RMSNorm"], help="Norm."
    )
    p.add_argument("--norm-epsilon", type=float, default=1e-5, help="Epsilon of the norms.")
    p.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (Llama) instead of GeLU.")
    p.add_argument("--disable-bias-linear", action="store_true", help="No biases in linear layers.")
    p.add_argument("--add-qkv-bias", action="store_true", help="Bias on QKV only (Qwen).")
    p.add_argument(
        "--qk-layernorm",
        action="store_true",
        help="Norm each head's queries and keys before RoPE (Qwen3, OLMo 2).",
    )
    p.add_argument(
        "--untie-embeddings-and-output-weights",
        action="store_true",
        help="Separate output layer instead of reusing the word embeddings.",
    )
    p.add_argument("--init-method-std", type=float, default=0.02, help="Init std (Megatron).")
    p.add_argument("--attention-dropout", type=float, default=0.1, help="Attention dropout.")
    p.add_argument("--hidden-dropout", type=float, default=0.1, help="Hidden dropout.")
    p.add_argument(
        "--make-vocab-size-divisible-by",
        type=int,
        default=128,
        help="Pad the embedding table to a multiple of this (times TP).",
    )
    p.add_argument(
        "--use-flash-attn", action="store_true", help="flash-attn kernels (GPU, if installed)."
    )
    p.add_argument(
        "--transformer-impl",
        default="local",
        choices=["local", "transformer_engine"],
        help="Layer implementation: plain PyTorch or Transformer Engine (GPU, if installed).",
    )
    p.add_argument(
        "--recompute-activations",
        action="store_true",
        help="Selective recompute of the attention core (saves its activations).",
    )
    p.add_argument(
        "--recompute-granularity",
        choices=["full", "selective"],
        help="Recompute whole layers (full) or only the attention core (selective).",
    )
    p.add_argument(
        "--recompute-method",
        choices=["uniform", "block"],
        help="With full recompute: checkpoint chunks of N layers (uniform) or the first N (block).",
    )
    p.add_argument("--recompute-num-layers", type=int, help="N for --recompute-method.")


def _add_data_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--data-path",
        nargs="+",
        help="Dataset prefixes: 'P', 'w1 P1 w2 P2 ...' or 'P1 P2 ...' (mg-prep output).",
    )
    p.add_argument(
        "--data-args-path",
        help="A blend file ('weight prefix' per line) as written by mg-prep refresh.",
    )
    p.add_argument("--split", help="Train/valid/test weights, e.g. 969,30,1 (the default).")
    p.add_argument("--mock-data", action="store_true", help="Synthetic data; no files needed.")
    p.add_argument("--data-cache-path", help="Where to put the sample-index cache files.")
    p.add_argument(
        "--reset-position-ids", action="store_true", help="Restart positions after each EOD."
    )
    p.add_argument(
        "--reset-attention-mask", action="store_true", help="No attention across EOD tokens."
    )
    p.add_argument("--eod-mask-loss", action="store_true", help="No loss on EOD tokens.")
    p.add_argument("--tokenizer-type", help="Megatron tokenizer type, e.g. GPT2BPETokenizer.")
    p.add_argument("--vocab-file", help="Vocabulary file of the tokenizer.")
    p.add_argument("--merge-file", help="BPE merges file (GPT2BPETokenizer).")
    p.add_argument("--tokenizer-model", help="SentencePiece/tiktoken model or HF folder.")
    p.add_argument("--vocab-size", type=int, help="Vocab size for NullTokenizer/TikTokenizer.")
    p.add_argument("--vocab-extra-ids", type=int, default=0, help="T5 sentinel tokens.")
    p.add_argument("--mask-prob", type=float, default=0.15, help="BERT/T5: share of masked words.")
    p.add_argument(
        "--short-seq-prob", type=float, default=0.1, help="BERT/T5: share of short samples."
    )


def _add_training_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--micro-batch-size", type=int, help="Samples per forward/backward.")
    p.add_argument(
        "--global-batch-size",
        type=int,
        help="Samples per optimizer step; micro-batches accumulate GBS/(MBS*DP). Default MBS*DP.",
    )
    p.add_argument(
        "--rampup-batch-size",
        nargs=3,
        type=int,
        metavar=("START", "INCR", "SAMPLES"),
        help="Grow the global batch from START by INCR evenly over SAMPLES samples.",
    )
    p.add_argument("--train-iters", type=int, help="Optimizer steps to train for.")
    p.add_argument(
        "--train-samples", type=int, help="Samples to train on (instead of --train-iters)."
    )
    p.add_argument("--seed", type=int, default=1234, help="Seed of init, dropout and data.")
    p.add_argument("--eval-interval", type=int, default=1000, help="Validate every N iterations.")
    p.add_argument(
        "--eval-iters", type=int, default=100, help="Global batches per validation (0: none)."
    )
    p.add_argument("--exit-interval", type=int, help="Save and exit at iterations divisible by N.")
    p.add_argument(
        "--exit-duration-in-mins", type=float, help="Save and exit after this many minutes."
    )
    p.add_argument(
        "--exit-signal-handler",
        action="store_true",
        help="On SIGTERM, save at the end of the current iteration and exit "
        "(mg-train always does this when --save is set; the flag is accepted for Megatron).",
    )
    p.add_argument(
        "--deterministic-mode",
        action="store_true",
        help="Deterministic algorithms only: the same run twice gives identical losses.",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 autocast with fp32 weights/grads.")
    p.add_argument("--fp16", action="store_true", help="fp16 autocast with dynamic loss scaling.")
    p.add_argument(
        "--cross-entropy-loss-fusion",
        action="store_true",
        help="Fuse the output layer and the cross-entropy, a few tokens at a time: no fp32 "
        "logits of the whole batch in memory, and faster (gpt, without tensor parallelism).",
    )
    p.add_argument(
        "--torch-compile",
        action="store_true",
        help="Compile each transformer layer with torch.compile (inductor fuses the "
        "elementwise work between matmuls; the first step pays the compilation).",
    )
    p.add_argument(
        "--use-cpu-initialization",
        action="store_true",
        help="Draw the initial weights on the CPU (always so without a GPU): the same values "
        "on any accelerator and at any parallel layout. Without it a GPU run draws them on "
        "its GPU (faster; equal at every layout of GPU runs).",
    )
    p.add_argument(
        "--init-model-with-meta-device",
        action="store_true",
        help="Accepted for Megatron: mg-train always builds GPT models on the meta device and "
        "gives each rank storage for its own shards only.",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Print parameters, FLOPs per iteration and per-GPU memory for these flags and "
        "exit, without building the model (WORLD_SIZE sets the planned world size).",
    )


def _add_optimizer_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--optimizer", default="adam", choices=["adam", "sgd"], help="adam is AdamW.")
    p.add_argument("--lr", type=float, help="Peak learning rate.")
    p.add_argument("--min-lr", type=float, default=0.0, help="Learning rate floor after decay.")
    p.add_argument(
        "--lr-decay-style",
        default="linear",
        choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
        help="Shape of the learning rate after warmup.",
    )
    p.add_argument("--lr-decay-iters", type=int, help="Decay over N iterations (default all).")
    p.add_argument("--lr-decay-samples", type=int, help="Decay over N samples.")
    p.add_argument("--lr-warmup-fraction", type=float, help="Warmup as a fraction of decay (wins).")
    p.add_argument("--lr-warmup-iters", type=int, default=0, help="Warmup iterations.")
    p.add_argument("--lr-warmup-samples", type=int, default=0, help="Warmup samples.")
    p.add_argument("--lr-warmup-init", type=float, default=0.0, help="Learning rate at step 0.")
    p.add_argument(
        "--lr-wsd-decay-style",
        default="exponential",
        choices=["exponential", "linear", "cosine", "minus_sqrt"],
        help="Shape of WSD's final decay.",
    )
    p.add_argument("--lr-wsd-decay-iters", type=int, help="Length of WSD's decay, iterations.")
    p.add_argument("--lr-wsd-decay-samples", type=int, help="Length of WSD's decay, samples.")
    p.add_argument("--weight-decay", type=float, default=0.01, help="Decoupled weight decay.")
    p.add_argument(
        "--clip-grad", type=float, default=1.0, help="Clip the global grad norm (0: no clip)."
    )
    p.add_argument("--adam-beta1", type=float, default=0.9, help="Adam beta1.")
    p.add_argument("--adam-beta2", type=float, default=0.999, help="Adam beta2.")
    p.add_argument("--adam-eps", type=float, default=1e-8, help="Adam epsilon.")
    p.add_argument("--sgd-momentum", type=float, default=0.9, help="SGD momentum.")
    p.add_argument("--loss-scale", type=float, help="Static fp16 loss scale (else dynamic).")
    p.add_argument("--initial-loss-scale", type=float, default=2.0**32, help="Dynamic scale start.")
    p.add_argument("--min-loss-scale", type=float, default=1.0, help="Dynamic scale floor.")
    p.add_argument(
        "--loss-scale-window", type=int, default=1000, help="Clean steps before doubling."
    )
    p.add_argument("--hysteresis", type=int, default=2, help="Overflows tolerated before halving.")


def _add_checkpoint_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--save", help="Checkpoint folder to write.")
    p.add_argument("--load", help="Checkpoint folder to resume from (latest iteration).")
    p.add_argument("--save-interval", type=int, help="Save every N iterations.")
    p.add_argument(
        "--overwrite-checkpoints",
        action="store_true",
        help="Let this run's saves overwrite newer checkpoints already in --save (refused "
        "otherwise, e.g. when --load finds nothing but --save holds checkpoints).",
    )
    p.add_argument(
        "--finetune", action="store_true", help="Load the model only; restart at iteration 0."
    )
    p.add_argument(
        "--use-checkpoint-args",
        action="store_true",
        help="Take the model config (and the tokenizer, unless tokenizer flags are given) from "
        "the checkpoint in --load; model-shape flags become optional and must agree with it.",
    )
    p.add_argument("--no-load-optim", action="store_true", help="Do not load optimizer state.")
    p.add_argument("--no-load-rng", action="store_true", help="Do not load RNG states.")
    p.add_argument("--no-save-optim", action="store_true", help="Do not save optimizer state.")
    p.add_argument("--no-save-rng", action="store_true", help="Do not save RNG states.")
    p.add_argument(
        "--ckpt-format",
        default="torch_dist",
        choices=["torch", "torch_dist"],
        help="Checkpoint format: torch_dist (the default, as in Megatron: "
        "torch.distributed.checkpoint, saved in parallel and loadable into any TP/PP/DP "
        "layout) or torch (one mp_rank_TT[_PPP]/model_optim_rng.pt file per model-parallel "
        "rank). --load reads either, whatever --ckpt-format says.",
    )
    p.add_argument(
        "--no-initialization",
        action="store_false",
        dest="perform_initialization",
        help="Allocate the model without drawing initial weights (faster start-up when "
        "--load certainly holds a checkpoint; gpt).",
    )
    p.add_argument(
        "--async-save",
        action="store_true",
        help="torch_dist: write the checkpoint in the background while training goes on.",
    )


def _add_logging_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--log-interval", type=int, default=100, help="Print every N iterations.")
    p.add_argument("--tensorboard-dir", help="Write tensorboard scalars here.")
    p.add_argument("--wandb-project", help="Log to Weights & Biases (needs wandb installed).")
    p.add_argument("--wandb-exp-name", help="wandb run name.")
    p.add_argument("--wandb-save-dir", help="wandb local folder.")


def _add_distributed_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        help="Split attention heads, MLP and vocabulary over this many ranks.",
    )
    p.add_argument(
        "--pipeline-model-parallel-size",
        type=int,
        default=1,
        help="Pipeline stages (Megatron's 1F1B schedule); layers are split evenly.",
    )
    p.add_argument(
        "--num-layers-per-virtual-pipeline-stage",
        type=int,
        help="Layers per model chunk: interleaved 1F1B with several chunks per pipeline rank.",
    )
    p.add_argument(
        "--context-parallel-size",
        type=int,
        default=1,
        help="Split each sequence over this many ranks (causal ring attention).",
    )
    p.add_argument(
        "--distributed-timeout-minutes",
        type=float,
        default=10.0,
        help="A distributed operation that does not complete in this time ends the job.",
    )
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="Shard norm and dropout activations along the sequence over the TP ranks.",
    )
    p.add_argument(
        "--use-distributed-optimizer",
        action="store_true",
        help="Shard optimizer state over data-parallel ranks (reduce-scatter grads, "
        "all-gather params).",
    )
    p.add_argument(
        "--overlap-param-gather",
        action="store_true",
        help="With --use-distributed-optimizer: all-gather updated parameters in buckets, "
        "overlapped with the next forward.",
    )
    p.add_argument(
        "--overlap-grad-reduce",
        action="store_true",
        help="All-reduce gradients in buckets during backward (torch DDP) "
        "instead of once after it.",
    )
    p.add_argument(
        "--distributed-backend",
        choices=["nccl", "gloo"],
        help="Default: nccl on GPU, gloo on CPU.",
    )
    p.add_argument("--ddp-bucket-size", type=int, help="Elements per DDP bucket (with overlap).")


def build_parser() -> argparse.ArgumentParser:
    """The `mg-train` parser: a model family, then Megatron's flags."""
    parser = argparse.ArgumentParser(
        prog="mg-train",
        description="Pretrain a GPT, BERT, T5 or Mamba/hybrid model with Megatron-LM's flags. "
        "Run under torchrun for data parallelism.",
        formatter_class=DefaultsHelpFormatter,
    )
    parser.add_argument("family", choices=FAMILIES, help="Model family to train.")
    parser.add_argument(
        "--config",
        help="YAML file whose keys are flag names (hidden_size or hidden-size); flags override it.",
    )
    for title, adder in (
        ("model", _add_model_flags),
        ("data and tokenizer", _add_data_flags),
        ("training", _add_training_flags),
        ("optimizer and learning rate", _add_optimizer_flags),
        ("checkpointing", _add_checkpoint_flags),
        ("logging", _add_logging_flags),
        ("distributed", _add_distributed_flags),
        ("mamba and hybrid models (mg-train mamba)", add_mamba_flags),
        ("mixture of experts", add_moe_flags),
    ):
        adder(parser.add_argument_group(title))
    return parser


def _load_yaml_defaults(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ArgumentError(f"--config {path}: file not found")
    with open(path, encoding="utf-8") as stream:
        try:
            content = yaml.safe_load(stream) or {}
        except yaml.YAMLError as error:
            raise ArgumentError(f"--config {path}: not valid YAML: {error}") from error
    if not isinstance(content, dict):
        raise ArgumentError(f"--config {path}: expected a mapping of flag names to values")
    known = {action.dest for action in parser._actions}
    out: dict[str, Any] = {}
    for key, value in content.items():
        dest = str(key).lstrip("-").replace("-", "_")
        if dest not in known or dest in ("help", "config", "family"):
            raise ArgumentError(
                f"--config {path}: unknown key {key!r}; keys are mg-train flag names "
                "(see mg-train gpt --help)"
            )
        out[dest] = value
    return out


def parse_args(argv: list[str] | None = None, world_size: int = 1) -> Args:
    """Parse (YAML config, then the command line) into `Args`, validated."""
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        parser.set_defaults(**_load_yaml_defaults(known.config, parser))
    namespace = parser.parse_args(argv)
    values = vars(namespace)
    given = _given_flags(argv, known.config, parser)
    args = Args(family=values["family"])
    for group, cls in _GROUPS.items():
        kwargs = {f.name: values[f.name] for f in fields(cls) if f.name not in _NOT_FLAGS}
        setattr(args, group, cls(**kwargs))
    args.distributed.world_size = world_size
    if args.checkpoint.use_checkpoint_args:
        from mg.trainer.checkpoint_args import apply_checkpoint_args

        apply_checkpoint_args(args, given)
    finalize(args)
    validate(args)
    return args


def _given_flags(
    argv: list[str] | None, config: str | None, parser: argparse.ArgumentParser
) -> set[str]:
    """Destinations set explicitly, on the command line or in the YAML config."""
    bare = build_parser()
    for action in bare._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    given = set(vars(bare.parse_args(argv)))
    if config:
        given |= set(_load_yaml_defaults(config, parser))
    return given


def finalize(args: Args) -> None:
    """Fill the values Megatron derives from others (GBS default, recompute shortcut)."""
    m, t = args.model, args.training
    if m.seq_length is None:
        m.seq_length = m.encoder_seq_length
    if t.global_batch_size is None and t.micro_batch_size is not None:
        t.global_batch_size = t.micro_batch_size * args.data_parallel_size
    if m.recompute_activations:
        m.recompute_granularity = "selective"
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    if not m.add_position_embedding and m.position_embedding_type == "learned_absolute":
        m.position_embedding_type = "none"  # Megatron: --no-position-embedding without rope
    if args.data.tokenizer_type is None and args.data.mock_data:
        args.data.tokenizer_type = "NullTokenizer"
        if args.data.vocab_size is None:
            args.data.vocab_size = 50257
    if args.data.split is None and not args.data.mock_data:
        args.data.split = "969, 30, 1"


def _fail(message: str) -> None:
    raise ArgumentError(message)


def _require(args: Args) -> None:
    missing = [
        f"--{name.replace('_', '-')}"
        for group, name in (
            ("model", "num_layers"),
            ("model", "hidden_size"),
            ("model", "num_attention_heads"),
            ("model", "seq_length"),
            ("training", "micro_batch_size"),
            ("optimizer", "lr"),
        )
        if getattr(getattr(args, group), name) is None
    ]
    if missing:
        hint = ""
        if args.checkpoint.load and not args.checkpoint.use_checkpoint_args:
            hint = (
                f"; to take the model shape from the checkpoint in {args.checkpoint.load}, "
                "add --use-checkpoint-args"
            )
        _fail(f"missing required arguments: {', '.join(missing)}{hint}")
    t = args.training
    if (t.train_iters is None) == (t.train_samples is None):
        _fail("expected exactly one of --train-iters and --train-samples")
    for flag, value in (("--train-iters", t.train_iters), ("--train-samples", t.train_samples)):
        if value is not None and value < 1:
            _fail(f"{flag} {value}: nothing to train; give the number of steps (at least 1)")


def _unsupported(args: Args) -> None:
    m = args.model
    _check_tensor_parallel(args)
    _check_pipeline_and_context(args)
    _check_fusion_and_compile(args)
    c = args.checkpoint
    if c.async_save and c.ckpt_format != "torch_dist":
        _fail("--async-save needs --ckpt-format torch_dist")
    if m.use_flash_attn or m.transformer_impl != "local":
        _fail(
            "--use-flash-attn and --transformer-impl transformer_engine are not supported by "
            "mg-train yet; use the default PyTorch SDPA attention"
        )


def _check_tensor_parallel(args: Args) -> None:
    """TP/SP rules, checked before any process group exists."""
    d, m = args.distributed, args.model
    tp = d.tensor_model_parallel_size
    if tp < 1:
        _fail(f"--tensor-model-parallel-size must be >= 1, got {tp}")
    if d.sequence_parallel and tp == 1:
        _fail("--sequence-parallel needs --tensor-model-parallel-size > 1")
    if tp == 1:
        return
    if args.family != "gpt":
        _fail(f"--tensor-model-parallel-size > 1 is supported for gpt, not {args.family}")
    if d.overlap_grad_reduce and not d.use_distributed_optimizer:
        _fail(
            "--overlap-grad-reduce with --tensor-model-parallel-size > 1 needs "
            "--use-distributed-optimizer (the plain data-parallel path reduces after backward)"
        )
    heads = m.num_attention_heads
    groups = m.num_query_groups if m.group_query_attention else heads
    for flag, value in (("--num-attention-heads", heads), ("--num-query-groups", groups)):
        if value and value % tp:
            _fail(f"{flag} ({value}) is not divisible by --tensor-model-parallel-size ({tp})")
    if m.ffn_hidden_size and m.ffn_hidden_size % tp:
        _fail(
            f"--ffn-hidden-size ({m.ffn_hidden_size}) is not divisible by "
            f"--tensor-model-parallel-size ({tp})"
        )
    if args.training.fp16:
        _fail("--fp16 with --tensor-model-parallel-size > 1 is not supported yet; use --bf16")


def _check_fusion_and_compile(args: Args) -> None:
    if args.training.cross_entropy_loss_fusion and (
        args.family != "gpt" or args.distributed.tensor_model_parallel_size > 1
    ):
        _fail(
            "--cross-entropy-loss-fusion is supported for gpt without tensor parallelism "
            "(with --tensor-model-parallel-size > 1 the loss is already vocab-parallel, "
            "without full logits); drop the flag"
        )
    if not args.training.torch_compile:
        return
    import torch

    from mg.core.models.compile import CompileUnavailableError, check_cpu_compiler

    if not torch.cuda.is_available():
        try:
            check_cpu_compiler()
        except CompileUnavailableError as err:
            _fail(f"--torch-compile: {err}")


def _check_pipeline_and_context(args: Args) -> None:
    """PP/CP layout rules (Megatron's), checked before any process group exists."""
    d, m, t = args.distributed, args.model, args.training
    pp, cp = d.pipeline_model_parallel_size, d.context_parallel_size
    for flag, value in (("--pipeline-model-parallel-size", pp), ("--context-parallel-size", cp)):
        if value < 1:
            _fail(f"{flag} must be >= 1, got {value}")
    if d.distributed_timeout_minutes <= 0:
        _fail(f"--distributed-timeout-minutes must be > 0, got {d.distributed_timeout_minutes}")
    model_parallel = pp * cp * d.tensor_model_parallel_size
    if d.world_size % model_parallel:
        _fail(
            f"world size ({d.world_size}) is not divisible by tensor "
            f"({d.tensor_model_parallel_size}) x pipeline ({pp}) x context ({cp}) parallel "
            f"sizes; launch a multiple of {model_parallel} processes"
        )
    if (pp > 1 or cp > 1) and args.family != "gpt":
        _fail(
            f"--pipeline-model-parallel-size and --context-parallel-size are supported for gpt, "
            f"not {args.family}"
        )
    if pp > 1 or d.num_layers_per_virtual_pipeline_stage is not None:
        from mg.core.parallel.pipeline import PipelineConfigError, virtual_size_from_layers

        try:
            virtual = virtual_size_from_layers(
                m.num_layers, pp, d.num_layers_per_virtual_pipeline_stage
            )
        except PipelineConfigError as err:
            _fail(str(err))
        if m.num_layers % pp:
            _fail(
                f"number of layers ({m.num_layers}) should be divisible by the pipeline parallel "
                f"size ({pp}); change --num-layers or --pipeline-model-parallel-size"
            )
        micro = t.global_batch_size // (t.micro_batch_size * args.data_parallel_size)
        if virtual > 1 and micro % pp:
            _fail(
                f"number of microbatches ({micro}) is not divisible by pipeline-model-parallel-"
                f"size ({pp}) when using interleaved schedule; change --global-batch-size"
            )
        if virtual > 1 and t.rampup_batch_size is not None:
            _fail("--rampup-batch-size with the interleaved schedule is not supported")
        if d.overlap_grad_reduce and not d.use_distributed_optimizer:
            _fail(
                "--overlap-grad-reduce with pipeline parallelism needs "
                "--use-distributed-optimizer (the plain data-parallel path reduces after the "
                "schedule)"
            )
    if cp > 1:
        if m.seq_length % (2 * cp):
            _fail(
                f"--seq-length ({m.seq_length}) must be divisible by 2 x --context-parallel-size "
                f"({2 * cp}): each rank holds two of 2·CP chunks"
            )
        if args.data.reset_attention_mask:
            _fail("--context-parallel-size > 1 does not support --reset-attention-mask")
        if m.attention_dropout > 0:
            _fail("--context-parallel-size > 1 needs --attention-dropout 0")


def _check_dry_run(args: Args) -> None:
    """A dry run plans layouts mg-train may not run yet; only the shape must split."""
    d = args.distributed
    if args.family not in ("gpt", "mamba"):
        _fail(f"--dry-run supports gpt and mamba only, not {args.family}")
    model_parallel = (
        d.tensor_model_parallel_size * d.pipeline_model_parallel_size * d.context_parallel_size
    )
    if model_parallel < 1 or d.world_size % model_parallel:
        _fail(
            f"world size ({d.world_size}, from WORLD_SIZE) is not divisible by tensor x pipeline "
            f"x context parallel sizes ({model_parallel}); set WORLD_SIZE to the planned GPU count"
        )


def _check_distributed_optimizer(args: Args) -> None:
    d = args.distributed
    if d.overlap_param_gather and not d.use_distributed_optimizer:
        _fail("--overlap-param-gather only works with --use-distributed-optimizer")


def validate(args: Args) -> None:
    """Refuse inconsistent flags before anything heavy starts (Megatron's validate_args)."""
    _require(args)
    mamba_error = check_mamba_flags(args.family, args.mamba)
    if mamba_error:
        _fail(mamba_error)
    d = args.distributed
    moe_error = check_moe_flags(
        args.family,
        args.moe,
        world_size=d.world_size,
        tp=d.tensor_model_parallel_size,
        pp=d.pipeline_model_parallel_size,
        cp=d.context_parallel_size,
        dry_run=args.training.dry_run,
        sharded_state=tuple(
            flag
            for flag, given in (
                ("--save", args.checkpoint.save),
                ("--load", args.checkpoint.load),
                ("--use-distributed-optimizer", d.use_distributed_optimizer),
                ("--overlap-grad-reduce", d.overlap_grad_reduce),
            )
            if given
        ),
    )
    if moe_error:
        _fail(moe_error)
    if args.training.dry_run:
        _check_dry_run(args)
    else:
        _unsupported(args)
    _check_distributed_optimizer(args)
    m, t, o, c = args.model, args.training, args.optimizer, args.checkpoint
    if not c.perform_initialization and (args.family != "gpt" or not c.load):
        _fail(
            "--no-initialization leaves the weights unset until a checkpoint fills them: it "
            "needs --load (and the gpt family); drop the flag to initialise them"
        )
    if m.kv_channels is None and m.hidden_size % m.num_attention_heads != 0:
        _fail(
            f"hidden size ({m.hidden_size}) is not divisible by the number of attention heads "
            f"({m.num_attention_heads}); change one of them or set --kv-channels"
        )
    if m.group_query_attention and m.num_attention_heads % m.num_query_groups != 0:
        _fail(
            f"number of attention heads ({m.num_attention_heads}) must be a multiple of "
            f"--num-query-groups ({m.num_query_groups})"
        )
    if m.seq_length > m.max_position_embeddings:
        _fail(
            f"sequence length ({m.seq_length}) is longer than --max-position-embeddings "
            f"({m.max_position_embeddings})"
        )
    if m.recompute_granularity == "full" and (
        m.recompute_method is None or m.recompute_num_layers is None
    ):
        _fail("--recompute-granularity full needs --recompute-method and --recompute-num-layers")
    dp = args.data_parallel_size
    if t.micro_batch_size <= 0:
        _fail(f"--micro-batch-size must be positive, got {t.micro_batch_size}")
    if t.global_batch_size <= 0 or t.global_batch_size % (t.micro_batch_size * dp) != 0:
        _fail(
            f"global batch size ({t.global_batch_size}) is not divisible by micro batch size "
            f"({t.micro_batch_size}) times data parallel size ({dp})"
        )
    if t.rampup_batch_size is not None:
        start, incr, samples = t.rampup_batch_size
        if t.train_samples is None:
            _fail("expected no batch-size rampup for iteration-based training; use --train-samples")
        if start <= 0 or incr <= 0 or samples < 0:
            _fail(f"--rampup-batch-size values must be positive, got {t.rampup_batch_size}")
        if (t.global_batch_size - start) % incr != 0:
            _fail(
                f"expected global batch size interval ({t.global_batch_size - start}) to be "
                f"divisible by global batch size increment ({incr})"
            )
        if start % (t.micro_batch_size * dp) != 0 or incr % (t.micro_batch_size * dp) != 0:
            _fail(
                f"--rampup-batch-size start ({start}) and increment ({incr}) must be divisible by "
                f"micro batch size ({t.micro_batch_size}) times data parallel size ({dp})"
            )
    if t.fp16 and t.bf16:
        _fail("--fp16 and --bf16 cannot both be set")
    if t.deterministic_mode and m.use_flash_attn:
        _fail("--deterministic-mode is not compatible with --use-flash-attn")
    if t.eval_interval <= 0 or t.eval_iters < 0:
        _fail("--eval-interval must be positive and --eval-iters non-negative")
    if o.lr < 0 or o.min_lr < 0 or o.min_lr > o.lr:
        _fail(f"need 0 <= --min-lr ({o.min_lr}) <= --lr ({o.lr})")
    if o.lr_decay_style == "WSD" and (
        o.lr_wsd_decay_iters is None and o.lr_wsd_decay_samples is None
    ):
        _fail("--lr-decay-style WSD needs --lr-wsd-decay-iters or --lr-wsd-decay-samples")
    if t.train_iters is not None and (o.lr_decay_samples or o.lr_warmup_samples):
        _fail("with --train-iters, give --lr-decay-iters/--lr-warmup-iters, not *-samples")
    if t.train_samples is not None and (o.lr_decay_iters or o.lr_warmup_iters):
        _fail("with --train-samples, give --lr-decay-samples/--lr-warmup-samples, not *-iters")
    if t.train_iters is not None:
        decay, warmup_explicit, unit = o.lr_decay_iters or t.train_iters, o.lr_warmup_iters, "iters"
    else:
        decay, warmup_explicit, unit = (
            o.lr_decay_samples or t.train_samples,
            o.lr_warmup_samples,
            ("samples"),
        )
    warmup = o.lr_warmup_fraction * decay if o.lr_warmup_fraction is not None else warmup_explicit
    if decay <= 0 or warmup >= decay:
        _fail(
            f"learning rate warmup ({warmup} {unit}) must be shorter than the decay "
            f"({decay} {unit}, --lr-decay-{unit} or the training length)"
        )
    if args.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        _fail("--wandb-project needs the wandb package: pip install wandb (or drop the flag)")
    if c.save_interval is not None and c.save is None:
        _fail("--save-interval needs --save")
    if c.save_interval is not None and c.save_interval <= 0:
        _fail(f"--save-interval {c.save_interval}: must be at least 1 (iterations between saves)")
    _validate_data(args)


def _validate_data(args: Args) -> None:
    d = args.data
    if d.mock_data and (d.data_path or d.data_args_path):
        _fail("--mock-data and --data-path/--data-args-path are exclusive")
    if not d.mock_data and not d.data_path and not d.data_args_path:
        _fail("no data: give --data-path, --data-args-path (a blend file) or --mock-data")
    if d.data_path and d.data_args_path:
        _fail("give --data-path or --data-args-path, not both")
    if d.data_args_path and not os.path.isfile(d.data_args_path):
        _fail(f"--data-args-path {d.data_args_path}: file not found")
    if d.tokenizer_type is None:
        _fail("--tokenizer-type is required (e.g. GPT2BPETokenizer), unless --mock-data")
    for flag, path in (
        ("--vocab-file", d.vocab_file),
        ("--merge-file", d.merge_file),
        ("--tokenizer-model", d.tokenizer_model),
    ):
        if path is not None and not os.path.exists(path):
            _fail(f"{flag} {path}: file not found")
    if d.data_path or d.data_args_path:
        from mg.indexed_dataset import parse_data_path, read_blend_file

        try:
            blend = (
                read_blend_file(d.data_args_path)
                if d.data_args_path
                else (parse_data_path(d.data_path))
            )
        except ValueError as error:
            _fail(str(error))
        source = "--data-args-path" if d.data_args_path else "--data-path"
        for prefix in blend.prefixes:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    _fail(
                        f"{source}: {prefix}{ext} not found (a prefix is the path without "
                        ".bin/.idx, as mg-prep writes it)"
                    )
