"""The training loop: data -> micro-batches -> loss -> backward -> optimizer -> schedule.

Loss averaging follows Megatron-Core's default (`calculate_per_token_loss`
off): each micro-batch's loss is sum(loss * mask) / sum(mask), divided by the
number of micro-batches, and gradients are averaged over data-parallel ranks.
So the gradient is that of the mean of the per-micro-batch means across the
whole global batch. The *reported* `lm loss` is, as in Megatron, the token-
weighted mean: loss sums and token counts are added over micro-batches and
ranks and divided once. With equal token counts per micro-batch (no masking)
both are the same number.

With `--calculate-per-token-loss` (Megatron's option) the gradient is instead
that of sum(loss * mask) over the whole global batch divided by its token count
(all micro-batches and data-parallel ranks): each micro-batch backpropagates
its loss sum times world / (tokens counted over the world), which the gradient
average over data-parallel ranks turns into exactly that.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mg.core.checkpoint.dist_format import PendingSave
from mg.core.checkpoint.layout import STAGING_SUFFIX
from mg.core.checkpoint.save_errors import describe_write_error, save_failed
from mg.core.models.flops import num_floating_point_operations
from mg.core.models.te_spec import FP8Options, fp8_autocast
from mg.core.parallel.construct import routed_tokens_group
from mg.core.parallel.pipeline import (
    allreduce_shared_embedding_grad,
    clip_grad_norm_across_stages,
)
from mg.core.parallel.tensor_parallel import sync_tensor_parallel_grads
from mg.indexed_dataset import samples_per_split
from mg.trainer import (
    checkpoint_io,
    distributed,
    model_parallel,
    moe_step,
    stages,
    token_guard,
)
from mg.trainer.arguments import Args
from mg.trainer.checkpointing import TrainState
from mg.trainer.families import collate, get_family
from mg.trainer.heartbeat import HEARTBEAT_SECONDS, Heartbeat
from mg.trainer.logging_utils import (
    perplexity,
    training_log_line,
    validation_log_line,
)
from mg.trainer.loss_scaler import autocast_dtype, unscale_and_check
from mg.trainer.optimizer import clip_grad_norm
from mg.trainer.step_stats import StepStats


@dataclass
class TrainResult:
    """What a run did, for callers and tests (per iteration of this process's run)."""

    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)
    learning_rates: list[float] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)
    extra_losses: dict[str, list[float]] = field(default_factory=dict)
    """Per-iteration extra losses by name (BERT's `sop loss`)."""
    extra_validation: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    """Validation extra losses by name: (iteration, value)."""
    state: TrainState = field(default_factory=TrainState)
    exit_reason: str = "done"


class _ExitSignals:
    """SIGTERM and SIGINT (Ctrl-C) set a flag; the loop saves and exits cleanly at the end
    of the iteration, as Megatron's `--exit-signal-handler` does. A second Ctrl-C stops at
    once (KeyboardInterrupt), for a save that takes too long."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: int = 0  # the signal's number, 0 for none
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _ExitSignals:
        for signum in self.SIGNALS:
            with contextlib.suppress(ValueError):  # not the main thread: no handler
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.received == signal.SIGINT:
            raise KeyboardInterrupt
        if not self.received:  # no print here: the main thread may be inside one
            self.received = signum

    def __exit__(self, *exc: Any) -> None:
        for signum, previous in self._previous.items():
            if previous is not None:
                signal.signal(signum, previous)


def _samples(items: list[Any]) -> list[Any]:
    """The data loader's collate: keep the micro-batch's samples as they are."""
    return items


def _batches(
    dataset: Any,
    consumed: int,
    mbs: int,
    env: distributed.DistEnv,
    layout: model_parallel.ParallelLayout,
    num_workers: int = 0,
    guard: token_guard.Guard | None = None,
) -> Iterator:
    """This data-parallel rank's micro-batches (every pp/cp/tp rank of it reads the same).

    `num_workers` > 0 (--num-workers): worker processes read the samples ahead of the
    step (a torch DataLoader over Megatron's sampler), as Megatron's loader does.
    `guard` checks each micro-batch's samples on the host (`token_guard`)."""
    sampler = distributed.MegatronPretrainingSampler(
        len(dataset), consumed, mbs, layout.dp_rank, layout.dp
    )
    if num_workers > 0:
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=num_workers,
            collate_fn=_samples,
            persistent_workers=True,
        )
        micro_batches: Iterator[list[Any]] = iter(loader)
    else:
        micro_batches = ([dataset[i] for i in indices] for indices in sampler)
    for samples in micro_batches:
        if guard is not None:
            guard(samples)
        yield model_parallel.shard_for_context(collate(samples, env.device), layout)


def nan_loss_message(iteration: int, loss: float) -> str:
    """Why a run with --check-for-nan-in-loss-and-grad (the default) stopped."""
    return (
        f"iteration {iteration}: the loss is {loss} (not finite); training stopped, as "
        "Megatron's --check-for-nan-in-loss-and-grad does, and the last checkpoint in --save "
        "is as it was: lower --lr, check the data, or pass --no-check-for-nan-in-loss-and-grad "
        "to count such iterations and go on"
    )


def per_token_loss_scale(batches: list[dict[str, torch.Tensor]], world_size: int) -> float:
    """world / (loss tokens of the global batch): the factor on each micro-batch's loss sum.

    Every tensor/pipeline rank of a data-parallel replica reads the same batches, so
    the world-wide sum counts each token tp x pp times; world / that sum is dp x cp /
    tokens, and the gradient average over the dp x cp ranks leaves 1 / tokens."""
    local = sum(float(b["loss_mask"].float().sum()) for b in batches)
    total = float(distributed.all_reduce_sum(torch.tensor([local], dtype=torch.float64))[0])
    return world_size / max(total, 1.0)


def _autocast(
    device: torch.device,
    dtype: torch.dtype | None,
    fp8: FP8Options | None = None,
    fp8_group: torch.distributed.ProcessGroup | None = None,
):
    """The forward's number formats: torch autocast in `dtype`, and TE's FP8 inside it,
    its amaxes reduced over `fp8_group` (`model_parallel.amax_reduction_group`)."""
    stack = contextlib.ExitStack()
    if dtype is not None:
        stack.enter_context(torch.autocast(device_type=device.type, dtype=dtype))
    if fp8 is not None:
        stack.enter_context(fp8_autocast(fp8, fp8_group))
    return stack


class Trainer:
    """One training run: built from `Args`, run with `train()`."""

    heartbeat_seconds = HEARTBEAT_SECONDS  # a line when none has appeared for this long

    def __init__(self, args: Args) -> None:
        """The setup stages in order (`mg.trainer.stages`): environment and layout,
        tokenizer, model, optimizer, state, data, logging."""
        self.args = args
        environment = stages.setup_environment(args)
        self.env, self.layout = environment.env, environment.layout
        self.watchdog, self.is_log_rank = environment.watchdog, environment.is_log_rank
        self.family = get_family(args.family)
        tokens = stages.setup_tokenizer(args, self.env)
        self.tokenizer_config, self.tokenizer = tokens.config, tokens.tokenizer
        self.saved_tokenizer_config = tokens.saved_config
        built = stages.build_model(args, environment, self.family, self.tokenizer)
        self.model_config, self.fp8, self.fp8_group = built.config, built.fp8, built.fp8_group
        opt = stages.setup_optimizer(args, self.layout, built.model)
        self.optimizer, self.scheduler, self.scaler = opt.optimizer, opt.scheduler, opt.scaler
        self.batches, self.train_iters = opt.batches, opt.train_iters
        self.distributed_optimizer = opt.distributed
        self.extra_losses: dict[str, float] = {}  # the last step's, e.g. {"sop loss": ...}
        self.moe_layer_losses: dict[str, float] = {}  # --moe-per-layer-logging (tensorboard)
        self._pending_save: PendingSave | None = None  # an --async-save in flight
        self.state = stages.load_state(args, environment, self.family, built, opt)
        self.model = stages.wrap_data_parallel(args, built.model, opt)
        self.params = [p for p in built.model.parameters() if p.requires_grad]
        self.dtype = autocast_dtype(args.training.bf16, args.training.fp16)
        if args.moe.moe_use_upcycling:  # Megatron saves the upcycled model before it
            # trains, without the optimizer's state (none yet; DCP would make one up)
            self.save(save_optim=False)
        self._build_data()
        logs = stages.setup_logging(args, environment, bf16=self.dtype == torch.bfloat16)
        self.housekeeping, self.peak, self.writer = logs.housekeeping, logs.peak, logs.writer
        self.stats = StepStats(args, self.layout, self.model, self.optimizer, self.env.device)
        self.housekeeping = self.stats.timed(self.housekeeping)  # --log-timers-to-tensorboard

    def _build_data(self) -> None:
        t = self.args.training
        num_samples = samples_per_split(
            global_batch_size=t.global_batch_size,
            eval_interval=t.eval_interval,
            eval_iters=t.eval_iters,
            train_iters=self.train_iters,
            train_samples=t.train_samples,
        )
        rows, ids = self.model_config.vocab_size, self.tokenizer.vocab_size
        guard = token_guard.check_at_start(self.args, rows, ids, self.env)
        train, valid, _ = self.family.build_datasets(self.args, self.tokenizer, num_samples)
        workers = self.args.data.num_workers
        self.train_data = _batches(
            train,
            self.state.consumed_train_samples,
            t.micro_batch_size,
            self.env,
            self.layout,
            workers,
            guard,
        )
        self.valid_dataset = valid
        if t.skip_train:  # as Megatron: evaluate from the validation set's first sample
            self.state.consumed_valid_samples = 0
        self.valid_data = (
            _batches(
                valid,
                self.state.consumed_valid_samples,
                t.micro_batch_size,
                self.env,
                self.layout,
                workers,
            )
            if valid is not None and len(valid) > 0 and t.eval_iters > 0
            else None
        )

    # --- one iteration ------------------------------------------------------------------------

    def _forward_backward(self, num_micro: int, backward: bool) -> tuple[float, float]:
        """Run `num_micro` micro-batches; returns (sum of loss * mask, tokens) over all ranks.

        Extra losses (BERT's `sop loss`), averaged over micro-batches and ranks,
        go to `self.extra_losses`."""
        # Accumulated on the device: no host sync per micro-batch on GPU.
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.env.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.env.device)
        extra_sums: dict[str, torch.Tensor] = {}
        extra_micro = num_micro
        data = self.train_data if backward else self.valid_data
        if isinstance(self.model, model_parallel.PipelineModel):
            steps = self.family.pipeline_steps or model_parallel.PipelineSteps()
            batches = [next(data) for _ in range(num_micro)]
            per_token_scale = (
                per_token_loss_scale(batches, self.env.world_size)
                if backward and self.args.training.calculate_per_token_loss
                else None
            )
            loss_sum, tokens, extra_sums = model_parallel.pipeline_forward_backward(
                self.model,
                self.layout,
                batches,
                hidden_size=self.model_config.hidden_size,
                loss_scale=self.scaler.scale,
                autocast=lambda: _autocast(self.env.device, self.dtype, self.fp8, self.fp8_group),
                backward=backward,
                device=self.env.device,
                no_sync=self.optimizer.no_sync if self.distributed_optimizer else None,
                dtype=self.dtype or torch.float32,
                steps=steps,
                extra_names=steps.extra_losses(self.args),
                per_token_scale=per_token_scale,
            )
            extra_micro = num_micro  # the extra losses' sums are over these
            num_micro = 0  # the schedule ran them all
        per_token = backward and self.args.training.calculate_per_token_loss
        prefetched = [next(data) for _ in range(num_micro)] if per_token else None
        scale_per_token = (
            per_token_loss_scale(prefetched, self.env.world_size) if prefetched else None
        )
        for i in range(num_micro):
            batch = prefetched[i] if prefetched else next(data)
            sync = contextlib.nullcontext()
            if backward and i < num_micro - 1:
                if isinstance(self.model, nn.parallel.DistributedDataParallel):
                    sync = self.model.no_sync()
                elif self.distributed_optimizer:
                    sync = self.optimizer.no_sync()
            with sync:
                with _autocast(self.env.device, self.dtype, self.fp8, self.fp8_group):
                    terms = self.family.loss_terms(self.model, batch)
                micro_sum, micro_tokens = terms[0], terms[1]
                extra = terms[2] if len(terms) > 2 else {}
                if backward:
                    if scale_per_token is not None:
                        loss = micro_sum * scale_per_token
                    else:
                        loss = model_parallel.micro_batch_loss(micro_sum, micro_tokens, self.layout)
                        loss = loss / num_micro
                    for value in extra.values():
                        loss = loss + value / num_micro
                    (loss * self.scaler.scale).backward()
            loss_sum += micro_sum.detach().double()
            tokens += micro_tokens.detach().double()
            for name, value in extra.items():
                extra_sums[name] = extra_sums.get(name, 0.0) + value.detach().double()
        names = sorted(extra_sums)
        totals = distributed.all_reduce_sum(
            torch.stack([loss_sum, tokens, *(extra_sums[n] for n in names)]).cpu()
        )
        # every rank that computes the loss adds its means: tensor-parallel ranks equal
        # copies of their replica's, and with pipeline parallelism the last stage only
        ranks = self.env.world_size // self.layout.pp
        self.extra_losses = {
            n: float(totals[2 + i]) / (max(extra_micro, 1) * ranks) for i, n in enumerate(names)
        }
        return float(totals[0]), float(totals[1])

    def train_step(self) -> tuple[float, float | None, bool, int]:
        """One optimizer step on one global batch: (lm loss, grad norm, skipped, GBS)."""
        gbs = self.batches.global_batch_size(self.state.consumed_train_samples)
        num_micro = self.batches.num_micro_batches(self.state.consumed_train_samples)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        moe_step.begin_step(num_micro, self.scaler.scale, self.layout)  # aux-loss grad scale
        loss_sum, tokens = self._forward_backward(num_micro, backward=True)
        self.housekeeping.after_forward_backward()
        # MoE: expert-bias update, balancing losses for the log line (dense: nothing)
        moe_losses, self.moe_layer_losses = moe_step.finish_step(
            self.model,
            self.model_config,
            routed_tokens_group(self.layout),
            per_layer=self.args.moe.moe_per_layer_logging,
        )
        self.extra_losses |= moe_losses
        if self.layout.tp > 1:  # sequence-parallel norms' partial grads, summed over TP
            sync_tensor_parallel_grads(self.model)
        if self.distributed_optimizer:  # reduce-scatter: each rank its shard's average,
            self.optimizer.finish_grad_sync()  # the tied embedding's summed over stages
        else:
            distributed.allreduce_gradients(
                self.model,
                self.layout.dp_cp_group,
                reduce_in_bf16=self.args.distributed.grad_reduce_in_bf16,
            )
            moe_step.allreduce_expert_gradients(self.model, self.layout)  # EP > 1 only
            if isinstance(self.model, model_parallel.PipelineModel):
                allreduce_shared_embedding_grad(self.model.chunks, self.layout.embedding_group)
        found_inf = False
        if self.args.training.fp16:  # Megatron checks for inf/NaN only under loss scaling
            if self.distributed_optimizer:
                found_inf = self.optimizer.unscale_and_check(self.scaler.scale)
            else:
                found_inf = unscale_and_check(self.params, self.scaler.scale)
                found_inf = distributed.all_reduce_max(float(found_inf)) > 0
            self.scaler.update(found_inf)
        grad_norm = None
        if not found_inf:
            grad_norm = self._clip_grad_norm()
            # bf16/fp32: a non-finite gradient shows as a NaN norm (the same on every rank)
            found_inf = not math.isfinite(grad_norm)
            if found_inf:
                grad_norm = None
            else:
                self.optimizer.step()
                self.scheduler.step(gbs)
        self.housekeeping.after_optimizer_step()
        self.state.consumed_train_samples += gbs
        return loss_sum / max(tokens, 1.0), grad_norm, found_inf, gbs

    def _clip_grad_norm(self) -> float:
        """The global gradient norm over every rank that holds gradients, clipped."""
        clip = self.args.optimizer.clip_grad
        if self.distributed_optimizer:  # over data, tensor and pipeline ranks
            return self.optimizer.clip_grad_norm(clip)
        if self.layout.experts_apart:  # other experts on each rank: squares summed over EP
            return moe_step.clip_grad_norm_expert_parallel(self.params, clip, self.layout)
        if isinstance(self.model, model_parallel.PipelineModel):
            return clip_grad_norm_across_stages(self.params, clip, self.layout.pp_group)
        return clip_grad_norm(self.model, clip)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Megatron's validation: `--eval-iters` global batches; `lm loss` token-weighted,
        extra losses (BERT's `sop loss`) averaged over the batches."""
        t = self.args.training
        self.model.eval()
        num_micro = t.global_batch_size // (t.micro_batch_size * self.args.data_parallel_size)
        loss_sum, tokens = 0.0, 0.0
        extra_sums: dict[str, float] = {}
        for _ in range(t.eval_iters):
            s, n = self._forward_backward(num_micro, backward=False)
            loss_sum, tokens = loss_sum + s, tokens + n
            for name, value in self.extra_losses.items():
                extra_sums[name] = extra_sums.get(name, 0.0) + value
            self.state.consumed_valid_samples += t.global_batch_size
        self.model.train()
        extra = {name: value / t.eval_iters for name, value in extra_sums.items()}
        return {"lm loss": loss_sum / max(tokens, 1.0), **extra}

    # --- the loop -----------------------------------------------------------------------------

    def save(self, save_optim: bool = True) -> None:
        """A checkpoint of this iteration in --save (`save_optim=False`: the model, RNG and
        counters only)."""
        c = self.args.checkpoint
        self.finish_saves()
        self._pending_save = checkpoint_io.save(
            c.save,
            self.state,
            ckpt_format=c.ckpt_format,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            loss_scaler=self.scaler,
            model_config=self.model_config,
            tokenizer_config=self.saved_tokenizer_config,
            args_flat=self.args.flat(),
            save_optim=save_optim and not c.no_save_optim,
            save_rng=not c.no_save_rng,
            async_save=c.async_save,
            layout=self.layout,
        )
        if self.env.is_main:
            verb = "started async save of" if self._pending_save and c.async_save else "saved"
            print(f" {verb} checkpoint at iteration {self.state.iteration} to {c.save}", flush=True)

    def finish_saves(self) -> None:
        """Wait for an --async-save in flight (before the next save and before exiting).

        A save that failed on any rank (a full disk) is discarded on all of them: its
        staging folder is removed and every rank raises the one SaveError."""
        if self._pending_save is None:
            return
        pending, self._pending_save = self._pending_save, None
        reason = None
        try:
            pending.wait()
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # DCP's CheckpointException derives from BaseException
            reason = describe_write_error(error)
        if distributed.all_reduce_max(float(reason is not None)) > 0:  # also the barrier
            staging = pending.path.with_name(pending.path.name + STAGING_SUFFIX)
            if self.env.is_main:
                shutil.rmtree(staging, ignore_errors=True)
            raise save_failed(
                pending.path.parent,
                self._iteration_of(pending.path),
                staging,
                reason or "another rank could not write its part; see its error",
            )

    @staticmethod
    def _iteration_of(folder: Path) -> int | str:
        """The iteration an `iter_XXXXXXX` (or `release`) folder holds."""
        name = folder.name
        return int(name.removeprefix("iter_")) if name.startswith("iter_") else name

    def _validate_and_log(self, prefix: str, result: TrainResult, tensorboard: bool = True) -> None:
        first = self.state.consumed_valid_samples
        losses = self.evaluate()
        loss = losses["lm loss"]
        result.validation.append((self.state.iteration, loss))
        for name, value in losses.items():
            if name != "lm loss":
                result.extra_validation.setdefault(name, []).append((self.state.iteration, value))
        if self.env.is_main:
            scored = (first, self.state.consumed_valid_samples, len(self.valid_dataset))
            line = validation_log_line(prefix, losses, scored)
            print("-" * len(line) + "\n" + line + "\n" + "-" * len(line), flush=True)
        if not tensorboard:  # an evaluation-only run leaves the training run's curves alone
            return
        scalars = {f"{name} validation": value for name, value in losses.items()}
        scalars["lm loss validation ppl"] = perplexity(loss)
        self.writer.scalars(scalars, self.state.iteration)

    def train(self, on_iteration: Callable[[Trainer], None] | None = None) -> TrainResult:
        """Train to `train_iters` or until an exit condition; returns the run's numbers."""
        self.housekeeping.start()
        try:
            return self._loop(on_iteration)
        finally:
            self.housekeeping.close()

    def _loop(self, on_iteration: Callable[[Trainer], None] | None) -> TrainResult:
        args, t, c = self.args, self.args.training, self.args.checkpoint
        result = TrainResult(state=self.state)
        if t.skip_train:
            return self._evaluate_only(result)
        start = time.time()
        saved_at = -1
        interval_time, interval_losses, interval_iters, interval_nan = time.time(), [], 0, 0
        interval_extra: dict[str, list[float]] = {}
        heartbeat = Heartbeat(
            args.logging.log_interval,
            self.train_iters,
            emit=(lambda line: print(line, flush=True)) if self.is_log_rank else (lambda _: None),
            interval=self.heartbeat_seconds,
        )
        with _ExitSignals() as exit_signals:
            while self.state.iteration < self.train_iters:
                self.housekeeping.before_iteration()
                loss, grad_norm, skipped, gbs = self.train_step()
                self.state.iteration += 1
                if args.training.check_for_nan_in_loss_and_grad and not math.isfinite(loss):
                    raise ValueError(nan_loss_message(self.state.iteration, loss))
                st = self.state
                flops = num_floating_point_operations(self.model_config, gbs, args.model.seq_length)
                st.num_floating_point_operations_so_far += flops
                lr = self.optimizer.param_groups[0]["lr"]
                result.losses.append(loss)
                result.grad_norms.append(grad_norm if grad_norm is not None else float("nan"))
                result.learning_rates.append(lr)
                if skipped:
                    st.skipped_iterations += 1
                elif math.isfinite(loss):
                    interval_losses.append(loss)
                    for name, value in self.extra_losses.items():
                        interval_extra.setdefault(name, []).append(value)
                for name, value in self.extra_losses.items():
                    result.extra_losses.setdefault(name, []).append(value)
                if not math.isfinite(loss):
                    interval_nan += 1
                interval_iters += 1
                scalars = {
                    "learning-rate": lr,
                    "batch-size": gbs,
                    "lm loss": loss,
                    **self.extra_losses,
                    **self.moe_layer_losses,
                    "loss-scale": self.scaler.scale,
                }
                if grad_norm is not None:
                    scalars["grad-norm"] = grad_norm
                scalars |= self.stats.after_step(st.iteration, stepped=not skipped)
                self.writer.scalars(scalars, st.iteration)
                if st.iteration % args.logging.log_interval == 0:
                    elapsed = (time.time() - interval_time) / interval_iters
                    throughput = flops / (elapsed * 1e12 * self.env.world_size)
                    if self.is_log_rank:
                        print(
                            training_log_line(
                                iteration=st.iteration,
                                train_iters=self.train_iters,
                                consumed_samples=st.consumed_train_samples,
                                elapsed_ms=elapsed * 1000.0,
                                throughput=throughput,
                                mfu=throughput / self.peak if self.peak else None,
                                learning_rate=lr,
                                global_batch_size=gbs,
                                losses={
                                    "lm loss": (sum(interval_losses) / len(interval_losses))
                                    if interval_losses
                                    else float("nan"),
                                    **{n: sum(v) / len(v) for n, v in interval_extra.items()},
                                },
                                loss_scale=self.scaler.scale,
                                grad_norm=grad_norm,
                                skipped=st.skipped_iterations,
                                nan_iterations=interval_nan,
                                **self.stats.line_fields(),
                            ),
                            flush=True,
                        )
                    heartbeat.logged()
                    self.writer.scalars(
                        {"iteration-time": elapsed, "throughput": throughput}, st.iteration
                    )
                    interval_time, interval_losses, interval_iters, interval_nan = (
                        time.time(),
                        [],
                        0,
                        0,
                    )
                    interval_extra = {}
                heartbeat.after_iteration(st.iteration, st.consumed_train_samples)
                if self.valid_data is not None and st.iteration % t.eval_interval == 0:
                    self._validate_and_log(f"iteration {st.iteration}", result)
                    heartbeat.logged()
                self.housekeeping.after_iteration(st.iteration)
                if on_iteration is not None:
                    on_iteration(self)
                if c.save and c.save_interval and st.iteration % c.save_interval == 0:
                    self.save()
                    saved_at = st.iteration
                reason = self._exit_reason(start, exit_signals.received)
                if reason:
                    if c.save and saved_at != st.iteration:
                        if self.env.is_main and reason.startswith("received"):
                            print(
                                f" {reason}: saving a checkpoint at iteration {st.iteration} "
                                "before exiting (Ctrl-C again stops at once, without saving)",
                                flush=True,
                            )
                        self.save()
                        saved_at = st.iteration
                    result.exit_reason = reason
                    if self.env.is_main:
                        print(f" exiting program at iteration {st.iteration}: {reason}", flush=True)
                    self.finish_saves()
                    self.writer.close()
                    return result
            # still under the signal flag: a SIGTERM or SIGINT during the last save, or while
            # an async save finishes, lets it finish instead of killing the process
            if self.valid_data is not None and self.state.iteration % t.eval_interval != 0:
                self._validate_and_log(
                    f"iteration {self.state.iteration} on validation set", result
                )
            if c.save and saved_at != self.state.iteration and result.losses:
                self.save()
            self.finish_saves()
            self.writer.close()
        return result

    def _evaluate_only(self, result: TrainResult) -> TrainResult:
        """`--skip-train`: one validation pass at the loaded iteration, nothing saved."""
        if self.valid_data is None:
            raise ValueError(
                "--skip-train: no validation data (--split gives the validation split no share, "
                "or the dataset has none); give it a share to evaluate on"
            )
        if self.env.is_main:
            print(f" skipping training (--skip-train) at iteration {self.state.iteration}")
        prefix = f"iteration {self.state.iteration} on validation set"
        self._validate_and_log(prefix, result, tensorboard=False)
        result.exit_reason = "--skip-train"
        self.writer.close()
        return result

    def _exit_reason(self, start: float, received: int) -> str | None:
        t = self.args.training
        iteration = self.state.iteration
        # the same on every rank: the highest signal number any rank received
        if signum := int(distributed.all_reduce_max(float(received))):
            return f"received {signal.Signals(signum).name}"
        if t.exit_interval and iteration % t.exit_interval == 0:
            return f"--exit-interval {t.exit_interval}"
        if t.exit_duration_in_mins is not None:
            minutes = distributed.all_reduce_max((time.time() - start) / 60.0)
            if minutes > t.exit_duration_in_mins:
                return f"--exit-duration-in-mins {t.exit_duration_in_mins}"
        return None


def pretrain(args: Args) -> TrainResult:
    """Build everything from `args` and train."""
    return Trainer(args).train()
