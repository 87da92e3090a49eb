"""The stages that set up a training run, in the order `Trainer` runs them.

environment and layout → tokenizer → model → optimizer → state → data → logging.

Each stage is a function of what the stages before it returned, so a test can
run one alone. The model stage is a family's plain model plus
`mg.core.parallel.construct` (the one ordered list of construction steps);
data parallelism wraps it in the state stage, after a checkpoint is loaded.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from mg.core.checkpoint import CheckpointError
from mg.core.models.te_spec import FP8Options
from mg.core.parallel import watchdog
from mg.core.parallel.construct import ConstructOptions, RecomputeOptions, construct
from mg.core.parallel.expert_optimizer import ExpertParallelDistributedOptimizer
from mg.core.parallel.fully_sharded import DTYPES, FullyShardedOptions
from mg.core.parallel.fully_sharded_optimizer import FullyShardedOptimizer
from mg.core.parallel.layout import ParallelLayout
from mg.core.tokenizers import TokenizerConfig, build_tokenizer
from mg.trainer import checkpoint_io, distributed, model_parallel, upcycling
from mg.trainer.arguments import Args
from mg.trainer.arguments.fsdp import fsdp_dtypes
from mg.trainer.arguments.model import selective_recompute_modules
from mg.trainer.arguments.transformer_engine import fp8_emulated, fp8_options
from mg.trainer.batch_schedule import BatchSchedule, train_iterations
from mg.trainer.checkpointing import TrainState
from mg.trainer.cpu_peak import estimate_cpu_peak
from mg.trainer.deterministic import enable_deterministic_mode, set_seed
from mg.trainer.families import ModelFamily
from mg.trainer.housekeeping import Housekeeping
from mg.trainer.logging_utils import MetricsWriter, device_peak_tflops
from mg.trainer.loss_scaler import build_loss_scaler
from mg.trainer.lr_scheduler import build_scheduler
from mg.trainer.optimizer import DistributedOptimizer, build_optimizer
from mg.trainer.padded_vocab import pad_vocab, tokenizer_config
from mg.trainer.tokenizer_bundle import bundled_config, copy_tokenizer_files

# --- environment and layout ------------------------------------------------------------------


@dataclass
class Environment:
    env: distributed.DistEnv
    layout: ParallelLayout
    watchdog: Any
    is_log_rank: bool
    """Megatron prints the training log from the last rank (the last pipeline stage)."""


def setup_environment(args: Args) -> Environment:
    """torch.distributed, the parallel layout's groups, the hang watchdog, the seed."""
    d = args.distributed
    if args.training.deterministic_mode:  # NCCL reads NCCL_ALGO when the group is made
        enable_deterministic_mode()
    env = distributed.init_distributed(d.distributed_backend, d.distributed_timeout_minutes)
    layout = model_parallel.build_layout(args, env)
    guard = None
    if env.world_size > 1:
        minutes = watchdog.timeout_from_minutes(d.distributed_timeout_minutes)
        guard = watchdog.install(minutes, env.rank, layout.describe())
    set_seed(args.training.seed)
    log_rank = env.rank == env.world_size - 1 if layout.pp > 1 else env.is_main
    return Environment(env, layout, guard, log_rank)


# --- tokenizer ---------------------------------------------------------------------------------


@dataclass
class TokenizerSetup:
    config: TokenizerConfig
    tokenizer: Any
    saved_config: dict
    """What checkpoints record: with --save, the files bundled beside them (portable)."""


def setup_tokenizer(args: Args, env: distributed.DistEnv) -> TokenizerSetup:
    config = tokenizer_config(args)
    tokenizer = build_tokenizer(config)
    saved = config.to_dict()
    if args.checkpoint.save:  # the checkpoint carries its tokenizer files (portable)
        if env.is_main:
            copy_tokenizer_files(args.checkpoint.save, config)
        saved = bundled_config(args.checkpoint.save, config)
    return TokenizerSetup(config, tokenizer, saved)


# --- model -----------------------------------------------------------------------------------


@dataclass
class ModelSetup:
    model: nn.Module
    config: Any
    fp8: FP8Options | None
    fp8_group: dist.ProcessGroup | None
    """Megatron's amax-reduction group, for TE's `fp8_autocast` in the forward."""


def construct_options(
    args: Args, environment: Environment, real_vocab_size: int | None
) -> ConstructOptions:
    """The construction steps this run's flags ask for (`mg.core.parallel.construct`)."""
    m, t = args.model, args.training
    selective = selective_recompute_modules(m)  # --recompute-modules, Megatron's names
    recompute = None
    modules = tuple(name for name in selective if name != "moe")  # moe: the MoE layer's own
    if m.recompute_granularity == "full" or modules:
        recompute = RecomputeOptions(
            m.recompute_granularity,
            m.recompute_method or "uniform",
            m.recompute_num_layers or 1,
            modules,
        )
    device = environment.env.device
    te_layers = args.transformer_engine.transformer_impl == "transformer_engine"
    fp8 = fp8_options(args)  # in TE's layers, else in torchao's float8 linears
    return ConstructOptions(
        layout=environment.layout,
        device=device,
        seed=t.seed,
        init_device=device if device.type != "cpu" and not t.use_cpu_initialization else None,
        perform_initialization=args.checkpoint.perform_initialization,
        real_vocab_size=real_vocab_size if m.mask_padded_vocab else None,
        cross_entropy_fusion=t.cross_entropy_loss_fusion,
        recompute=recompute,
        moe_layer_recompute=args.moe.moe_layer_recompute or "moe" in selective,
        transformer_engine=te_layers,
        fp8=fp8 if te_layers else None,
        float8=None if te_layers else fp8,
        float8_emulate=fp8_emulated(),
        compile=t.torch_compile,
        fully_sharded=fully_sharded_options(args),
    )


def fully_sharded_options(args: Args) -> FullyShardedOptions | None:
    """--use-megatron-fsdp / --use-torch-fsdp2: the strategy, replicas and dtypes."""
    f = args.fsdp
    if not f.enabled:
        return None
    compute, reduce = fsdp_dtypes(args)
    return FullyShardedOptions(
        strategy=f.data_parallel_sharding_strategy,
        replicas=f.num_distributed_optimizer_instances,
        param_dtype=DTYPES[compute] if compute else None,
        reduce_dtype=DTYPES[reduce] if reduce else None,
        prefetch=args.distributed.overlap_param_gather,
    )


def build_model(
    args: Args, environment: Environment, family: ModelFamily, tokenizer: Any
) -> ModelSetup:
    """The family's plain model (on the meta device where it can), then the construction
    steps; afterwards the RNG is Megatron's per-stage seed (seed + 100 × pp rank)."""
    layout = environment.layout
    config = family.build_config(args, pad_vocab(args, tokenizer.vocab_size))
    if args.checkpoint.save:  # a layout that cannot be written is refused now, not at a save
        checkpoint_io.check_savable(args.checkpoint.ckpt_format, config, family=args.family)
    options = construct_options(args, environment, tokenizer.vocab_size)
    fp8_group = (  # collective: every rank builds the amax groups here
        model_parallel.amax_reduction_group(layout, args.transformer_engine.tp_only_amax_red)
        if options.fp8 is not None
        else None
    )
    with torch.device("meta") if family.builds_on_meta else contextlib.nullcontext():
        model = family.build_model(config, args)
    model = construct(model, options)
    set_seed(layout.stage_seed(args.training.seed))  # for everything after init (dropout)
    return ModelSetup(model, config, options.fp8, fp8_group)


# --- optimizer -------------------------------------------------------------------------------


@dataclass
class OptimizerSetup:
    optimizer: Any
    scheduler: Any
    scaler: Any
    batches: BatchSchedule
    train_iters: int

    @property
    def distributed(self) -> bool:
        """Whether the optimizer shards its state and reduces gradients itself."""
        return isinstance(
            self.optimizer,
            DistributedOptimizer | ExpertParallelDistributedOptimizer | FullyShardedOptimizer,
        )


def setup_optimizer(args: Args, layout: ParallelLayout, model: nn.Module) -> OptimizerSetup:
    """The optimizer over this rank's parameters, the learning-rate schedule over the
    run's iterations, and the loss scaler."""
    t, o = args.training, args.optimizer
    batches = BatchSchedule(
        t.global_batch_size, t.micro_batch_size, args.data_parallel_size, t.rampup_batch_size
    )
    train_iters = train_iterations(args, batches)
    if args.fsdp.enabled:  # the torch optimizer over the shards fully_shard left
        experts = layout.ep_group if layout.experts_apart else None
        scale = layout.expert_dp / (layout.dp * layout.cp) if layout.experts_apart else 1.0
        sharded_grads = args.fsdp.data_parallel_sharding_strategy in (
            "optim_grads",
            "optim_grads_params",
        )
        optimizer = FullyShardedOptimizer(
            build_optimizer(model, o), model, experts, scale, reduce_every_micro_batch=sharded_grads
        )
    else:
        optimizer = build_optimizer(
            model,
            o,
            args.distributed,
            layout.dp_cp_group,
            expert_groups=(
                (layout.expert_dp_group, layout.ep_group) if layout.experts_apart else None
            ),
            **model_parallel.pipeline_optimizer_options(model, layout),
        )
    scheduler = build_scheduler(args, optimizer, train_iters)
    scaler = build_loss_scaler(
        t.fp16,
        o.loss_scale,
        o.initial_loss_scale,
        o.min_loss_scale,
        o.loss_scale_window,
        o.hysteresis,
    )
    return OptimizerSetup(optimizer, scheduler, scaler, batches, train_iters)


# --- state -----------------------------------------------------------------------------------


def load_state(
    args: Args,
    environment: Environment,
    family: ModelFamily,
    built: ModelSetup,
    opt: OptimizerSetup,
) -> TrainState:
    """The counters (and the model's and optimizer's state) from --load, the dense
    checkpoint upcycled into the experts, or a fresh start."""
    c = args.checkpoint
    if args.moe.moe_use_upcycling:
        return upcycle(args, environment, family, built, opt.optimizer)
    if not c.load:
        return TrainState()
    resumed = checkpoint_io.resume(  # in whichever format the checkpoint was saved
        c.load,
        model=built.model,
        optimizer=opt.optimizer,
        scheduler=opt.scheduler,
        loss_scaler=opt.scaler,
        finetune=c.finetune,
        load_optim=not c.no_load_optim,
        load_rng=not c.no_load_rng,
        iteration=c.ckpt_step,
        layout=environment.layout,
        strictness=c.dist_ckpt_strictness,
    )
    if resumed is None and c.exit_on_missing_checkpoint:  # Megatron exits instead
        raise CheckpointError(
            f"--exit-on-missing-checkpoint: no checkpoint in {c.load} "
            "(no latest_checkpointed_iteration.txt)"
        )
    if environment.env.is_main:
        print(
            f" loaded checkpoint from {c.load} at iteration {resumed.iteration}"
            if resumed is not None
            else f" WARNING: no checkpoint in {c.load} "
            "(no latest_checkpointed_iteration.txt); training from scratch",
            flush=True,
        )
    return resumed if resumed is not None else TrainState()


def upcycle(
    args: Args,
    environment: Environment,
    family: ModelFamily,
    built: ModelSetup,
    optimizer: Any,
) -> TrainState:
    """--moe-use-upcycling: a dense twin of the model in this run's layout reads --load,
    and the MoE model starts from its weights (`mg.trainer.upcycling`)."""
    c, layout = args.checkpoint, environment.layout
    upcycling.check_sources(c.load, c.save, c.ckpt_step)
    with torch.device("meta"):
        dense = family.build_model(upcycling.dense_config(built.config), args)
    options = ConstructOptions(
        layout=layout,
        device=environment.env.device,
        seed=args.training.seed,
        perform_initialization=False,
    )
    dense = construct(dense, options)
    state = upcycling.upcycle(c.load, built.model, dense, layout, c.ckpt_step)
    refresh = getattr(optimizer, "reload_model_params", None)
    if refresh is not None:  # the distributed optimizer's main copies follow the weights
        refresh()
    if environment.env.is_main:
        print(f" upcycled the dense checkpoint in {c.load} into {c.save}", flush=True)
    return state


def wrap_data_parallel(args: Args, model: nn.Module, opt: OptimizerSetup) -> nn.Module:
    """DDP around the model, unless the distributed optimizer reduces on its own."""
    d = args.distributed
    return distributed.wrap_model(
        model,
        d.overlap_grad_reduce and not opt.distributed,
        d.ddp_bucket_size,
        reduce_in_bf16=d.grad_reduce_in_bf16,
    )


# --- logging ---------------------------------------------------------------------------------


@dataclass
class LoggingSetup:
    housekeeping: Housekeeping
    peak: float | None
    """The device's peak TFLOP/s that MFU is measured against (None: unknown)."""
    writer: MetricsWriter


def setup_logging(args: Args, environment: Environment, bf16: bool) -> LoggingSetup:
    env = environment.env
    peak = device_peak_tflops(env.device, bf16=bf16)
    if env.device.type == "cpu" and environment.is_log_rank and peak:
        print(f" {estimate_cpu_peak(torch.get_num_threads(), bf16=bf16).describe()}", flush=True)
    lg = args.logging
    writer = MetricsWriter(
        lg.tensorboard_dir,
        lg.wandb_project,
        lg.wandb_exp_name,
        lg.wandb_save_dir,
        config=args.flat(),
        enabled=env.is_main,
    )
    return LoggingSetup(Housekeeping(args, env.rank), peak, writer)
