"""Megatron's training flags: how long, in what batches, at which precision."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mg.trainer.arguments.errors import fail

if TYPE_CHECKING:
    from mg.trainer.arguments.args import Args


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
    skip_train: bool = False
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
    gradient_accumulation_fusion: bool = True
    attention_softmax_in_fp32: bool = False
    calculate_per_token_loss: bool = False
    check_for_nan_in_loss_and_grad: bool = True
    manual_gc: bool = False
    manual_gc_interval: int = 0
    empty_unused_memory_level: int = 0
    profile: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])


def add_training_flags(p: argparse._ArgumentGroup) -> None:
    p.add_argument("--micro-batch-size", type=int, help="Samples per forward/backward.")
    p.add_argument(
        "--check-for-nan-in-loss-and-grad",
        action="store_true",
        default=True,
        help="Stop at the first iteration whose loss is NaN or inf, naming it (Megatron's "
        "default). A step whose gradients are not finite is skipped either way.",
    )
    p.add_argument(
        "--no-check-for-nan-in-loss-and-grad",
        dest="check_for_nan_in_loss_and_grad",
        action="store_false",
        help="Go on past a NaN or inf loss: such iterations are counted on the log line.",
    )
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
        "--skip-train",
        action="store_true",
        help="Evaluate only: load (--load), run one validation pass at the loaded iteration "
        "and exit without a training step or a save.",
    )
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
        "--attention-softmax-in-fp32",
        action="store_true",
        help="No-op: mg's attention (SDPA and flash kernels) already computes the scores' "
        "softmax in fp32 under --bf16/--fp16.",
    )
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
        "--no-gradient-accumulation-fusion",
        dest="gradient_accumulation_fusion",
        action="store_false",
        help="No-op (Megatron's CUDA kernel choice): mg-train accumulates weight gradients "
        "in fp32 as the unfused path does.",
    )
    p.add_argument(
        "--calculate-per-token-loss",
        action="store_true",
        help="Megatron's per-token loss: the gradient is that of the sum of token losses over "
        "the whole global batch divided by its token count (all micro-batches and "
        "data-parallel ranks), instead of the mean of per-micro-batch means.",
    )
    p.add_argument(
        "--manual-gc",
        action="store_true",
        help="Turn Python's automatic garbage collector off during training and collect every "
        "--manual-gc-interval iterations instead (the same moment on every rank).",
    )
    p.add_argument(
        "--manual-gc-interval",
        type=int,
        default=0,
        help="Iterations between collections with --manual-gc (0: only at the start).",
    )
    p.add_argument(
        "--empty-unused-memory-level",
        type=int,
        default=0,
        choices=[0, 1, 2],
        help="Return cached GPU memory to the driver: 1 after forward/backward, 2 also after "
        "the optimizer step (torch.cuda.empty_cache; nothing to do on CPU).",
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="Profile iterations --profile-step-start to --profile-step-end with the torch "
        "profiler; the trace goes to --tensorboard-dir (Megatron's --use-pytorch-profiler; "
        "mg-train has no nsys mode).",
    )
    p.add_argument(
        "--use-pytorch-profiler",
        action="store_true",
        help="Accepted for Megatron scripts: --profile always uses the torch profiler.",
    )
    p.add_argument("--profile-step-start", type=int, default=10, help="First profiled iteration.")
    p.add_argument(
        "--profile-step-end", type=int, default=12, help="Iteration the profile stops at."
    )
    p.add_argument(
        "--profile-ranks", type=int, nargs="+", default=[0], help="Global ranks that profile."
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="Print parameters, FLOPs per iteration and per-GPU memory for these flags and "
        "exit, without building the model (WORLD_SIZE sets the planned world size).",
    )


REQUIRED = ("micro_batch_size",)


def finalize_training(args: Args) -> None:
    """Megatron's default global batch: one micro-batch per data-parallel rank."""
    t = args.training
    if t.global_batch_size is None and t.micro_batch_size is not None:
        t.global_batch_size = t.micro_batch_size * args.data_parallel_size


def check_training_length(args: Args) -> None:
    t = args.training
    if (t.train_iters is None) == (t.train_samples is None):
        fail("expected exactly one of --train-iters and --train-samples")
    for flag, value in (("--train-iters", t.train_iters), ("--train-samples", t.train_samples)):
        if value is not None and value < 1:
            fail(f"{flag} {value}: nothing to train; give the number of steps (at least 1)")


def check_fusion_and_compile(args: Args) -> None:
    """The fused loss needs full logits; torch.compile needs a working CPU compiler off GPU."""
    if not args.training.torch_compile:
        return
    import torch  # lazy: --help stays instant (no torch before argparse answers)

    # lazy: --help stays instant (mg.core.models imports torch)
    from mg.core.models.compile import CompileUnavailableError, check_cpu_compiler

    if not torch.cuda.is_available():
        try:
            check_cpu_compiler()
        except CompileUnavailableError as err:
            fail(f"--torch-compile: {err}")


def check_training(args: Args) -> None:
    """Batch sizes, rampup, precision and evaluation (Megatron's validate_args)."""
    t = args.training
    dp = args.data_parallel_size
    if t.micro_batch_size <= 0:
        fail(f"--micro-batch-size must be positive, got {t.micro_batch_size}")
    if t.global_batch_size <= 0 or t.global_batch_size % (t.micro_batch_size * dp) != 0:
        fail(
            f"global batch size ({t.global_batch_size}) is not divisible by micro batch size "
            f"({t.micro_batch_size}) times data parallel size ({dp})"
        )
    if t.rampup_batch_size is not None:
        start, incr, samples = t.rampup_batch_size
        if t.train_samples is None:
            fail(
                "--rampup-batch-size needs --train-samples: no batch-size rampup for "
                "iteration-based training (Megatron's rule); give --train-samples instead of "
                "--train-iters"
            )
        if start <= 0 or incr <= 0 or samples < 0:
            fail(f"--rampup-batch-size values must be positive, got {t.rampup_batch_size}")
        if (t.global_batch_size - start) % incr != 0:
            fail(
                f"expected global batch size interval ({t.global_batch_size - start}) to be "
                f"divisible by global batch size increment ({incr})"
            )
        if start % (t.micro_batch_size * dp) != 0 or incr % (t.micro_batch_size * dp) != 0:
            fail(
                f"--rampup-batch-size start ({start}) and increment ({incr}) must be divisible by "
                f"micro batch size ({t.micro_batch_size}) times data parallel size ({dp})"
            )
    if t.eval_interval <= 0 or t.eval_iters < 0:
        fail("--eval-interval must be positive and --eval-iters non-negative")
    if t.skip_train and t.eval_iters == 0:
        fail("--skip-train evaluates on the validation set: give --eval-iters > 0")
    if t.manual_gc_interval < 0:
        fail(f"--manual-gc-interval must be >= 0, got {t.manual_gc_interval}")
    if t.profile:
        if not 0 <= t.profile_step_start < t.profile_step_end:
            fail(
                f"--profile-step-start ({t.profile_step_start}) must be >= 0 and before "
                f"--profile-step-end ({t.profile_step_end})"
            )
        if args.logging.tensorboard_dir is None:
            fail("--profile writes its trace to --tensorboard-dir: give one")
