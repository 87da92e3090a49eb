"""Global batch size per iteration (Megatron's num-microbatches calculators) and train length.

Without `--rampup-batch-size` every iteration takes GBS samples in GBS/(MBS*DP)
micro-batches per rank. With `START INCR SAMPLES` the global batch starts at
START and grows by INCR every SAMPLES / ((GBS - START) / INCR) consumed samples
until it reaches GBS (Megatron's RampupBatchsizeNumMicroBatchesCalculator).
"""

from __future__ import annotations

from mg.trainer.arguments import Args


class BatchSchedule:
    """`global_batch_size(consumed)` and `num_micro_batches(consumed)` for one rank."""

    def __init__(
        self,
        global_batch_size: int,
        micro_batch_size: int,
        data_parallel_size: int,
        rampup: list[int] | None = None,
    ) -> None:
        self.gbs = global_batch_size
        self.mbs = micro_batch_size
        self.dp = data_parallel_size
        self.rampup = rampup
        if rampup is not None:
            start, incr, samples = rampup
            increments = (global_batch_size - start) // incr
            self.samples_per_increment = samples / increments if increments > 0 else 0.0

    def global_batch_size(self, consumed_samples: int) -> int:
        if self.rampup is None:
            return self.gbs
        start, incr, samples = self.rampup
        if consumed_samples > samples or self.samples_per_increment == 0:
            return self.gbs
        steps = int(consumed_samples / self.samples_per_increment)
        return min(start + steps * incr, self.gbs)

    def num_micro_batches(self, consumed_samples: int) -> int:
        return self.global_batch_size(consumed_samples) // (self.mbs * self.dp)


def train_iterations(args: Args, schedule: BatchSchedule) -> int:
    """`--train-iters`, or what `--train-samples` takes (Megatron's update_train_iters)."""
    t = args.training
    if t.train_iters is not None:
        return t.train_iters
    iterations, consumed = 0, 0
    if t.rampup_batch_size is not None:
        ramp_samples = t.rampup_batch_size[2]
        while consumed <= ramp_samples and consumed <= t.train_samples:
            consumed += schedule.global_batch_size(consumed)
            iterations += 1
    iterations += (t.train_samples - consumed) // t.global_batch_size
    return iterations
