"""Index building, ours (vectorised numpy) against Megatron-Core's (C++ helpers + Python glue).

For a synthetic dataset (only the sequence lengths matter) both sides build the
document, sample and shuffle index of a GPT split, and the blending indices of
a weighted blend, in the same process; the script checks that the arrays are
identical and prints the best-of-N time of each stage and the ratio
ours/theirs (below 1: ours is faster). Megatron's side is skipped, with a
message, when megatron.core is not importable.

    uv run --frozen python bench/bench_index_build.py            # 10M and 100M tokens
    uv run --frozen python bench/bench_index_build.py --quick    # 10M tokens only
"""

from __future__ import annotations

import argparse
import platform
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from mg.indexed_dataset.indices import (
    build_blending_indices,
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    final_epoch_is_separate,
    num_epochs_needed,
)


def load_megatron() -> dict[str, Any] | None:
    """Megatron-Core's index builders, or None (with the reason printed)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Transformer Engine / Apex missing
            from megatron.core.datasets import helpers
            from megatron.core.datasets.gpt_dataset import (
                _build_document_index,
                _build_shuffle_index,
            )
    except Exception as error:  # ImportError, or a broken torch underneath
        print(f"megatron.core not importable ({error}); timing ours only")
        return None
    return {
        "helpers": helpers,
        "document_index": _build_document_index,
        "shuffle_index": _build_shuffle_index,
    }


@dataclass
class Case:
    name: str
    num_documents: int
    max_length: int
    seq_length: int
    epochs: float  # requested samples, in epochs


def best_of(repeats: int, function: Callable[[], Any]) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        began = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - began)
    return best, result


Stages = tuple[dict[str, float], tuple[np.ndarray, np.ndarray, np.ndarray]]


def gpt_indices_ours(
    lengths: np.ndarray,
    documents: np.ndarray,
    seq_length: int,
    tokens: int,
    epochs: int,
    separate: bool,
) -> Stages:
    """Our three builders, in GPTDataset's order, each timed."""
    rng = np.random.RandomState(1234)
    times: dict[str, float] = {}
    t = time.perf_counter()
    document_index = build_document_index(documents, epochs, rng, separate)
    times["document"] = time.perf_counter() - t
    t = time.perf_counter()
    sample_index = build_sample_index(lengths, document_index, seq_length, epochs, tokens)
    times["sample"] = time.perf_counter() - t
    t = time.perf_counter()
    total = sample_index.shape[0] - 1
    first = ((epochs - 1) * tokens - 1) // seq_length if separate else total
    shuffle_index = build_shuffle_index(first, total, rng)
    times["shuffle"] = time.perf_counter() - t
    return times, (document_index, sample_index, shuffle_index)


def gpt_indices_megatron(
    megatron: dict[str, Any],
    lengths: np.ndarray,
    documents: np.ndarray,
    seq_length: int,
    tokens: int,
    epochs: int,
    separate: bool,
) -> Stages:
    """GPTDataset._build_document_sample_shuffle_indices, minus the caching and logging."""
    rng = np.random.RandomState(1234)
    times: dict[str, float] = {}
    t = time.perf_counter()
    document_index = megatron["document_index"](documents, epochs, rng, separate)
    times["document"] = time.perf_counter() - t
    t = time.perf_counter()
    sample_index = megatron["helpers"].build_sample_idx(
        lengths, document_index, seq_length, epochs, tokens, True, True
    )
    times["sample"] = time.perf_counter() - t
    t = time.perf_counter()
    total = sample_index.shape[0] - 1
    first = ((epochs - 1) * tokens - 1) // seq_length if separate else total
    shuffle_index = megatron["shuffle_index"](first, total, rng)
    times["shuffle"] = time.perf_counter() - t
    return times, (document_index, sample_index, shuffle_index)


def best_stages(repeats: int, run: Callable[[], Stages]) -> tuple[dict[str, float], Any]:
    best: dict[str, float] = {}
    arrays: Any = None
    for _ in range(repeats):
        times, arrays = run()
        times["total"] = sum(times.values())
        for key, value in times.items():
            best[key] = min(best.get(key, float("inf")), value)
    return best, arrays


def bench_gpt(case: Case, megatron: dict[str, Any] | None, repeats: int) -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, case.max_length, size=case.num_documents).astype(np.int32)
    documents = np.arange(case.num_documents, dtype=np.int32)
    tokens = int(lengths.sum(dtype=np.int64))
    num_samples = int(case.epochs * (tokens - 1) // case.seq_length)
    epochs = num_epochs_needed(tokens, num_samples, case.seq_length)
    separate = final_epoch_is_separate(tokens, epochs, num_samples, case.seq_length)
    print(
        f"\n{case.name}: {case.num_documents:,} documents, {tokens / 1e6:.1f}M tokens, "
        f"seq {case.seq_length}, {num_samples:,} samples asked, {epochs} epoch(s)"
        f"{' (last one separate)' if separate else ''}"
    )
    ours, our_arrays = best_stages(
        repeats,
        lambda: gpt_indices_ours(lengths, documents, case.seq_length, tokens, epochs, separate),
    )
    theirs = None
    if megatron is not None:
        theirs, their_arrays = best_stages(
            repeats,
            lambda: gpt_indices_megatron(
                megatron, lengths, documents, case.seq_length, tokens, epochs, separate
            ),
        )
        names = ("document", "sample", "shuffle")
        for name, a, b in zip(names, our_arrays, their_arrays, strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b), f"{name} index differs"
    print_table(ours, theirs, ("document", "sample", "shuffle", "total"))


def bench_blend(
    size: int, num_datasets: int, megatron: dict[str, Any] | None, repeats: int
) -> None:
    rng = np.random.default_rng(num_datasets)
    weights = rng.random(num_datasets) + 0.05
    weights = (weights / weights.sum()).tolist()
    print(f"\nblend: {num_datasets} datasets, {size:,} samples, weights {min(weights):.3f}..")
    ours_time, (ours_index, ours_sample) = best_of(
        repeats, lambda: build_blending_indices(weights, size)
    )
    theirs = None
    if megatron is not None:

        def megatron_blend() -> tuple[np.ndarray, np.ndarray]:
            dataset_index = np.zeros(size, dtype=np.int16)
            sample_index = np.zeros(size, dtype=np.int64)
            megatron["helpers"].build_blending_indices(
                dataset_index, sample_index, weights, num_datasets, size, False
            )
            return dataset_index, sample_index

        their_time, (their_index, their_sample) = best_of(repeats, megatron_blend)
        assert np.array_equal(ours_index, their_index), "dataset index differs"
        assert np.array_equal(ours_sample, their_sample), "dataset sample index differs"
        theirs = {"blend": their_time}
    print_table({"blend": ours_time}, theirs, ("blend",))


def print_table(
    ours: dict[str, float], theirs: dict[str, float] | None, stages: tuple[str, ...]
) -> None:
    print(f"  {'stage':<10}{'ours':>12}{'megatron':>12}{'ours/theirs':>13}")
    for stage in stages:
        line = f"  {stage:<10}{ours[stage] * 1e3:>10.1f}ms"
        if theirs is not None:
            ratio = ours[stage] / theirs[stage] if theirs[stage] > 0 else float("nan")
            line += f"{theirs[stage] * 1e3:>10.1f}ms{ratio:>12.2f}x"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="only the 10M-token cases")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs")
    args = parser.parse_args()
    print(f"numpy {np.__version__}, python {platform.python_version()}, {platform.machine()}")
    megatron = load_megatron()
    cases = [
        Case("10M tokens, 1 epoch", 100_000, 200, 2048, 1.0),
        Case("10M tokens, 2.3 epochs", 100_000, 200, 128, 2.3),
    ]
    if not args.quick:
        cases += [
            Case("100M tokens, 1 epoch", 1_000_000, 200, 2048, 1.0),
            Case("100M tokens, 2.3 epochs", 1_000_000, 200, 128, 2.3),
        ]
    for case in cases:
        bench_gpt(case, megatron, args.repeats)
    bench_blend(1_000_000, 2, megatron, args.repeats)
    bench_blend(1_000_000, 10, megatron, args.repeats)
    if not args.quick:
        bench_blend(10_000_000, 3, megatron, args.repeats)


if __name__ == "__main__":
    main()
