"""Loss and perplexity on a split of an indexed dataset, as the trainer's validation computes it.

Samples come from ``build_gpt_datasets`` with the same ``--split``/``--seed``/
``--seq-length`` as training and the same formula as the trainer's validation:
the per-token loss times the sample's ``loss_mask``, summed over all samples and
divided by the mask's sum. The same samples give the same loss; but mg-train's
validation scores the next ``--eval-iters x --global-batch-size`` samples each
time, from a split built for all its validations (several passes over a small
split, cut into samples across the passes), while mg-eval scores the first
``--eval-iters x --micro-batch-size`` samples of one pass (default: all of it).
So both lines name the samples they scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from mg.core.tokenizers.base import BaseTokenizer
from mg.evaluate import distributed
from mg.evaluate.errors import EvalInputError
from mg.evaluate.model_parallel import EvalModel
from mg.evaluate.progress import progress
from mg.evaluate.token_check import check_vocabulary
from mg.indexed_dataset import GPTDatasetConfig, IndexedDatasetError, build_gpt_datasets

SPLITS = ("train", "valid", "test")


@dataclass
class PplResult:
    loss: float
    ppl: float
    num_samples: int
    num_tokens: int
    split: str
    split_samples: int
    """Samples in one pass over the split: ``num_samples`` of them were scored."""

    def metrics(self) -> dict[str, float | int | str]:
        return dict(vars(self))


def build_split(
    data_path: list[str],
    split_name: str,
    seq_length: int,
    split: str,
    seed: int,
    num_samples: int | None,
    eod: int,
    cache_path: str | None,
):
    counts: list[int | None] = [0, 0, 0]
    counts[SPLITS.index(split_name)] = num_samples
    config = GPTDatasetConfig(
        seq_length=seq_length, seed=seed, split=split, eod_token_id=eod, path_to_cache=cache_path
    )
    try:
        datasets = build_gpt_datasets(data_path, counts, config)
    except (ValueError, OSError, IndexedDatasetError) as exc:
        raise EvalInputError(f"--data-path {' '.join(data_path)}: {exc}") from None
    dataset = datasets[SPLITS.index(split_name)]
    if dataset is None or len(dataset) == 0:
        raise EvalInputError(
            f"the {split_name} split of --data-path {' '.join(data_path)} is empty with "
            f"--split {split} and --seq-length {seq_length}; give it a larger share"
        )
    return dataset


def evaluate_ppl(
    model: torch.nn.Module | EvalModel,
    tokenizer: BaseTokenizer,
    data_path: list[str],
    seq_length: int,
    micro_batch_size: int,
    split: str = "969,30,1",
    split_name: str = "valid",
    eval_iters: int | None = None,
    seed: int = 1234,
    cache_path: str | None = None,
) -> PplResult:
    """``eval_iters`` batches of ``micro_batch_size`` samples, or the whole split when None."""
    model = EvalModel.whole(model)
    group = model.layout.dp_group
    num_samples = None if eval_iters is None else eval_iters * micro_batch_size
    check_vocabulary(data_path, model, tokenizer)
    dataset = build_split(
        data_path, split_name, seq_length, split, seed, num_samples, tokenizer.eod, cache_path
    )
    count = len(dataset) if num_samples is None else min(num_samples, len(dataset))
    # under torchrun each data-parallel rank takes every dp-th micro-batch; the sums are reduced
    starts = distributed.shard(range(0, count, micro_batch_size), group)

    def collate(start: int) -> dict[str, torch.Tensor]:
        samples = [dataset[i] for i in range(start, min(start + micro_batch_size, count))]
        return {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}

    def sums(losses: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
        mask = batch["loss_mask"].double()
        return float((losses.double() * mask).sum()), float(mask.sum())

    batches = (collate(start) for start in progress(starts, len(starts), f"ppl ({split_name})"))
    per_batch = model.run(batches, sums)
    loss_sum = sum(loss for loss, _ in per_batch)
    mask_sum = sum(tokens for _, tokens in per_batch)
    loss_sum, mask_sum = distributed.all_reduce_sum([loss_sum, mask_sum], group)
    if mask_sum == 0:
        raise EvalInputError("every token of the evaluated samples is masked; nothing to score")
    loss = loss_sum / mask_sum
    ppl = math.exp(min(20.0, loss))
    return PplResult(loss, ppl, count, int(mask_sum), split_name, len(dataset))
