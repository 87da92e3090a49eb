"""The finetune loop of Megatron's ``tasks/finetune_utils.py``, for RACE/MNLI/QQP.

For ``--epochs`` epochs: a ``DistributedSampler`` (shuffled, ``set_epoch`` each
epoch) deals each rank its share, micro-batches of ``--micro-batch-size`` (the
last incomplete one dropped), cross entropy of the head's logits, AdamW with
Megatron's weight-decay groups (no decay on biases and norms), gradient
clipping, the learning rate warmed up over ``--lr-warmup-fraction`` of the
iterations and decayed (``--lr-decay-style``) to ``--min-lr`` at the end. After
every epoch (and every ``--eval-interval`` iterations) the accuracy on each
``--valid-data`` set is printed in Megatron's words. Under torchrun the
gradients are averaged over the data-parallel ranks and the accuracy counts
summed; with tensor parallelism (``dp_group``) the ranks of one model split
its layers and see the same examples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.utils.data import DistributedSampler

from mg.core.parallel.grad_norm import clip_grad_norm
from mg.core.parallel.tensor_parallel import sync_tensor_parallel_grads
from mg.evaluate import distributed
from mg.evaluate.classification import BertClassifier
from mg.evaluate.errors import EvalInputError
from mg.evaluate.finetune_samples import FinetuneSample
from mg.evaluate.progress import progress


@dataclass
class FinetuneConfig:
    epochs: int
    micro_batch_size: int
    lr: float
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_warmup_fraction: float = 0.0
    weight_decay: float = 0.01
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int | None = None


@dataclass
class Accuracy:
    correct: int
    total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.correct / max(self.total, 1)


@dataclass
class FinetuneResult:
    iterations: int
    final_loss: float
    accuracy: dict[str, Accuracy]
    """Per --valid-data path, after the last epoch."""
    history: list[dict] = field(default_factory=list)
    """Every evaluation: {epoch, iteration, name, correct, total}."""


def learning_rate(config: FinetuneConfig, step: int, total: int) -> float:
    """Megatron's schedule with lr_decay_iters = train_iters (as finetune_utils sets it)."""
    warmup = int(config.lr_warmup_fraction * total)
    if warmup > 0 and step <= warmup:
        return config.lr * step / warmup
    if config.lr_decay_style == "constant" or total <= warmup:
        return config.lr
    ratio = min((step - warmup) / (total - warmup), 1.0)
    if config.lr_decay_style == "linear":
        coeff = 1.0 - ratio
    elif config.lr_decay_style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise EvalInputError(f"--lr-decay-style {config.lr_decay_style!r} is not supported")
    return config.min_lr + coeff * (config.lr - config.min_lr)


def _collate(samples: Sequence[FinetuneSample], device: torch.device, multiple_choice: bool):
    def stack(name: str) -> torch.Tensor:
        rows = [getattr(s, name) if multiple_choice else getattr(s, name)[0] for s in samples]
        return torch.tensor(rows, dtype=torch.long, device=device)

    labels = torch.tensor([s.label for s in samples], dtype=torch.long, device=device)
    return stack("ids"), stack("types"), stack("paddings"), labels


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.dim() > 1 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


@torch.no_grad()
def accuracy(
    model: BertClassifier,
    samples: Sequence[FinetuneSample],
    micro_batch_size: int,
    dp_group: ProcessGroup | None = None,
) -> Accuracy:
    """Greedy accuracy; under torchrun each data-parallel rank scores a strided share, the
    counts summed over them."""
    was_training = model.training
    model.eval()
    device = model.head.weight.device
    local = distributed.shard(samples, dp_group)
    correct = 0
    for start in range(0, len(local), micro_batch_size):
        batch = local[start : start + micro_batch_size]
        ids, types, paddings, labels = _collate(batch, device, model.num_choices > 0)
        correct += int((model(ids, types, paddings).argmax(-1) == labels).sum())
    model.train(was_training)
    total_correct, total = distributed.all_reduce_sum([correct, len(local)], dp_group)
    return Accuracy(int(total_correct), int(total))


def _average_gradients(
    model: torch.nn.Module, params: Sequence[torch.Tensor], dp_group: ProcessGroup | None
) -> None:
    if dp_group is None:
        distributed.average_gradients(params)
        return
    # each gradient to its parameter's layout (a sharded embedding's may come back whole)
    sync_tensor_parallel_grads(model)
    world = distributed.rank_and_world(dp_group)[1]
    if world == 1:
        return
    for p in params:  # a tensor-parallel shard is averaged with its peers of the same shard
        if p.grad is not None:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            torch.distributed.all_reduce(grad, group=dp_group)
            grad.div_(world)


def _clip(params: Sequence[torch.Tensor], clip_grad: float) -> None:
    """Clip to the norm of the whole gradients (over tensor-parallel shards), summed in
    float64: torch's fp32 norm of a 30k x h embedding gradient is off by ~1e-4."""
    clip_grad_norm(params, clip_grad)


def finetune(
    model: BertClassifier,
    train: Sequence[FinetuneSample],
    valid: dict[str, Sequence[FinetuneSample]],
    config: FinetuneConfig,
    log: Callable[[str], None] = print,
    dp_group: ProcessGroup | None = None,
) -> FinetuneResult:
    """`dp_group`: the data-parallel ranks when the model is tensor parallel (None: all)."""
    rank, world = distributed.rank_and_world(dp_group)
    per_epoch = len(train) // (config.micro_batch_size * world)
    if per_epoch == 0:
        raise EvalInputError(
            f"--train-data has {len(train)} examples, fewer than one global batch "
            f"(--micro-batch-size {config.micro_batch_size} x {world} ranks)"
        )
    total = per_epoch * config.epochs
    device = model.head.weight.device
    optimizer = torch.optim.AdamW(
        _param_groups(model, config.weight_decay),
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
    )
    params = [p for p in model.parameters() if p.requires_grad]
    sampler = DistributedSampler(
        range(len(train)), num_replicas=world, rank=rank, shuffle=True, seed=config.seed
    )
    result = FinetuneResult(0, float("nan"), {})
    multiple_choice = model.num_choices > 0
    step, loss_sum, loss_count, started = 0, 0.0, 0, time.time()

    def evaluate(epoch: int) -> None:
        for name, samples in valid.items():
            acc = accuracy(model, samples, config.micro_batch_size, dp_group)
            result.accuracy[name] = acc
            result.history.append(
                dict(epoch=epoch, iteration=step, name=name, correct=acc.correct, total=acc.total)
            )
            log(
                f" > |epoch: {epoch}| metrics for {name}: correct / total = "
                f"{acc.correct} / {acc.total} = {acc.percent:.4f} %"
            )

    model.train()
    for epoch in range(config.epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        batches = [
            order[i : i + config.micro_batch_size]
            for i in range(0, per_epoch * config.micro_batch_size, config.micro_batch_size)
        ]
        for indices in progress(batches, len(batches), f"finetune epoch {epoch}"):
            step += 1
            lr = learning_rate(config, step, total)
            for group in optimizer.param_groups:
                group["lr"] = lr
            ids, types, paddings, labels = _collate(
                [train[i] for i in indices], device, multiple_choice
            )
            loss = F.cross_entropy(model(ids, types, paddings).float(), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            _average_gradients(model, params, dp_group)
            if config.clip_grad > 0:
                _clip(params, config.clip_grad)
            optimizer.step()
            (loss_value,) = distributed.all_reduce_sum([float(loss.detach())], dp_group)
            loss_sum += loss_value / world
            loss_count += 1
            result.final_loss = loss_value / world
            if step % config.log_interval == 0 or step == total:
                elapsed = (time.time() - started) * 1000 / loss_count
                log(
                    f" iteration {step:8d}/{total:8d} | epoch {epoch} | elapsed time per "
                    f"iteration (ms): {elapsed:.1f} | learning rate: {lr:.6E} | "
                    f"loss: {loss_sum / loss_count:.6E} |"
                )
                loss_sum, loss_count, started = 0.0, 0, time.time()
            if config.eval_interval and step % config.eval_interval == 0 and step != total:
                evaluate(epoch)
        evaluate(epoch)
    result.iterations = step
    return result
