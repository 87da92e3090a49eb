"""The index arrays behind GPT and blended datasets, built with vectorised numpy.

Megatron-Core builds these with a compiled C++ extension (`helpers.cpp`) and
a little Python glue. We produce the same arrays, element for element and
dtype for dtype, without a compiler:

- the document index: the split's documents tiled once per epoch, shuffled;
- the sample index: where each sample starts, as (position in the document
  index, token offset), found for all samples at once from a running sum of
  document lengths instead of walking document by document;
- the shuffle index: a permutation of the samples;
- the blending indices: Megatron's greedy "largest error first" choice of
  dataset per sample, simulated for many chunks of samples in lock step.

The random streams are `numpy.random.RandomState(seed)` shuffles, in
Megatron's order; those are shared with Megatron, not reimplemented. The cache
of built indices (md5-named `.npy` files, rank 0 builds while the other ranks
wait) is at the end of this file.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

_INT32_MAX = np.iinfo(np.int32).max

FINAL_EPOCH_THRESHOLD = 0.80
"""A last epoch that yields fewer samples than this fraction of a full epoch is shuffled apart."""


# --- epochs -----------------------------------------------------------------------------------


def num_epochs_needed(
    tokens_per_epoch: int, num_samples: int | None, seq_length: int, extra_tokens: int = 1
) -> int:
    """The smallest E >= 1 with E * tokens_per_epoch >= num_samples * seq_length + extra.

    `num_samples=None` means one epoch. Megatron counts up in a loop; this is
    the same number in closed form.
    """
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("cannot draw samples from a split without tokens")
    requested = num_samples * seq_length + extra_tokens
    return max(1, -(-requested // tokens_per_epoch))


def final_epoch_is_separate(
    tokens_per_epoch: int,
    num_epochs: int,
    num_samples: int | None,
    seq_length: int,
    extra_tokens: int = 1,
) -> bool:
    """Whether the last epoch is shuffled on its own, as Megatron decides it.

    When only a small part of the last epoch is used, shuffling it together
    with the others would let a few documents appear twice in the run while
    others of the last epoch never do; Megatron keeps it apart when it
    contributes fewer than 80% of a full epoch's samples.
    """
    if num_epochs == 1 or num_samples is None:
        return False
    samples_before_final = ((num_epochs - 1) * tokens_per_epoch - extra_tokens) // seq_length
    samples_from_final = num_samples - samples_before_final
    samples_per_epoch = (tokens_per_epoch - extra_tokens) // seq_length
    return samples_from_final < int(FINAL_EPOCH_THRESHOLD * samples_per_epoch)


# --- the three GPT indices --------------------------------------------------------------------


def build_document_index(
    documents: np.ndarray,
    num_epochs: int,
    rng: np.random.RandomState,
    separate_final_epoch: bool,
) -> np.ndarray:
    """The documents tiled `num_epochs` times and shuffled in place, int32.

    With a separate final epoch the first `num_epochs - 1` epochs are shuffled
    together, then the last one on its own, drawing from `rng` in that order
    (a shuffle's draws depend only on the length, so shuffling views of one
    array is Megatron's shuffle-then-concatenate without the copy).
    """
    documents = np.asarray(documents)
    if documents.size and (documents.min() < 0 or documents.max() > _INT32_MAX):
        raise ValueError("document ids must fit in int32")
    index = np.tile(documents.astype(np.int32, copy=False), num_epochs)
    if separate_final_epoch and num_epochs > 1:
        boundary = index.size - documents.size
        rng.shuffle(index[:boundary])
        rng.shuffle(index[boundary:])
    else:
        rng.shuffle(index)
    return index


def num_samples_in_index(
    total_tokens: int, seq_length: int, extra_tokens: int, drop_last_partial_sequence: bool
) -> int:
    """How many samples the sample index holds, with Megatron's exact rounding.

    Keeping the last partial sample rounds up in single precision, because the
    C++ helper computes `ceil(float(...) / seq_length)`; the float32 rounding
    is reproduced so that huge datasets get the same count too.
    """
    if drop_last_partial_sequence:
        return (total_tokens - extra_tokens) // seq_length
    quotient = np.float32(np.float32(total_tokens - extra_tokens) / np.float32(seq_length))
    return int(np.ceil(quotient))


_SEARCH_RATIO = 12
"""Binary-search the boundaries when documents outnumber samples by this much, else count."""


def build_sample_index(
    sequence_lengths: np.ndarray,
    document_index: np.ndarray,
    seq_length: int,
    num_epochs: int,
    tokens_per_epoch: int,
    drop_last_partial_sequence: bool = True,
    add_extra_token: bool = True,
) -> np.ndarray:
    """Sample boundaries `[n + 1, 2]`: (position in `document_index`, token offset).

    Sample k covers the concatenated token stream of the document index from
    `k * seq_length` for `seq_length + 1` tokens (the extra token is the last
    label), so neighbouring samples share one token. Megatron's helper walks
    the documents; here boundary k is placed directly: it lies in the first
    document whose running end reaches `k * seq_length + extra`, at offset
    `k * seq_length` minus that document's start. "First document whose end
    reaches b" is found for all boundaries at once: by binary search when
    samples are few (long sequences), else as a histogram of how many
    boundaries each document end covers followed by a running sum (two linear
    passes). Temporaries are kept to two document-sized arrays, as their page
    faults cost as much as the arithmetic.

    The dtype is Megatron's: int32 unless the document index or a sequence is
    longer than int32 allows.
    """
    extra = int(add_extra_token)
    if seq_length < 1:
        raise ValueError(f"sequence length must be >= 1, got {seq_length}")
    sequence_lengths = np.asarray(sequence_lengths)
    document_index = np.asarray(document_index)
    num_documents = document_index.shape[0]
    total = int(num_epochs) * int(tokens_per_epoch)
    num_samples = num_samples_in_index(total, seq_length, extra, drop_last_partial_sequence)
    largest = max(num_documents, int(sequence_lengths.max()) if sequence_lengths.size else 0)
    out_dtype = np.int32 if largest <= _INT32_MAX else np.int64
    sample_index = np.zeros((max(num_samples, 0) + 1, 2), dtype=out_dtype)

    # starts[j]: where document j of the document index begins in the token stream. In
    # int32 where nothing can overflow, because that halves the memory traffic.
    work = np.int32 if total + 2 * seq_length + extra <= _INT32_MAX else np.int64
    starts = np.empty(num_documents + 1, dtype=work)
    starts[0] = 0
    ends = starts[1:]
    if num_documents and (
        document_index.min() < 0 or document_index.max() >= sequence_lengths.shape[0]
    ):
        raise ValueError("the document index refers to sequences the dataset does not have")
    # mode="clip" (the ids are checked above): with the default mode numpy buffers `out`.
    if sequence_lengths.dtype == work:
        np.take(sequence_lengths, document_index, out=ends, mode="clip")
    else:
        ends[:] = np.take(sequence_lengths, document_index, mode="clip")
    np.cumsum(ends, out=ends)
    if int(starts[-1]) != total:
        raise ValueError(
            f"the document index holds {int(starts[-1])} tokens, but {num_epochs} epochs of "
            f"{tokens_per_epoch} tokens were expected"
        )
    if num_samples <= 0:
        return sample_index

    positions = np.arange(seq_length, (num_samples + 1) * seq_length, seq_length, dtype=work)
    if num_samples * _SEARCH_RATIO < num_documents:
        documents_of = np.searchsorted(ends, positions + extra, side="left")
    else:
        # Document j covers the boundaries k = 1 .. covered[j], those with k*S + extra <= its
        # end; the document of boundary k is the number of documents covering fewer than k.
        # (At most n by the definition of n; below 0 only for leading empty documents.)
        covered = ends - extra
        covered //= seq_length
        if covered[0] < 0:
            np.maximum(covered, 0, out=covered)
        documents_of = np.bincount(covered, minlength=num_samples + 1)[:num_samples]
        np.cumsum(documents_of, out=documents_of)
    sample_index[1:, 0] = documents_of
    np.subtract(positions, np.take(starts, documents_of), out=sample_index[1:, 1], casting="unsafe")
    # Keeping a last partial sample: boundaries past the end of the stream stop at the
    # last document, `extra` tokens before its end, as the helper does.
    past_end = None if drop_last_partial_sequence else documents_of >= num_documents
    if past_end is not None and past_end.any():
        last_length = int(sequence_lengths[document_index[-1]])
        sample_index[1:, 0][past_end] = num_documents - 1
        sample_index[1:, 1][past_end] = last_length - extra
    return sample_index


def build_shuffle_index(
    num_samples: int, total_size: int, rng: np.random.RandomState
) -> np.ndarray:
    """A permutation of `[0, total_size)`: `[0, num_samples)` and the rest shuffled apart.

    uint32 unless the size needs int64, as in Megatron.
    """
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    index = np.arange(total_size, dtype=dtype)
    rng.shuffle(index[:num_samples])
    if num_samples != total_size:
        rng.shuffle(index[num_samples:])
    return index


@dataclass(frozen=True)
class GPTIndices:
    """The three arrays a GPT dataset reads samples through, and how they were planned."""

    document_index: np.ndarray
    sample_index: np.ndarray
    shuffle_index: np.ndarray
    num_epochs: int
    separate_final_epoch: bool

    def __len__(self) -> int:
        return self.sample_index.shape[0] - 1


def build_gpt_indices(
    sequence_lengths: np.ndarray,
    documents: np.ndarray,
    num_samples: int | None,
    seq_length: int,
    seed: int,
    add_extra_token: bool = True,
    drop_last_partial_sequence: bool = True,
) -> GPTIndices:
    """Plan the epochs and build document, sample and shuffle index, as Megatron does.

    `documents` are the sequence ids of one split; `num_samples=None` asks for
    exactly one epoch.
    """
    extra = int(add_extra_token)
    tokens_per_epoch = int(np.take(sequence_lengths, documents).sum(dtype=np.int64))
    if tokens_per_epoch == 0:  # Megatron loops forever here
        raise ValueError(
            f"the split has {len(documents)} documents and no tokens: nothing to draw samples "
            f"from; give this split data (see --split)"
        )
    num_epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length, extra)
    separate = final_epoch_is_separate(tokens_per_epoch, num_epochs, num_samples, seq_length, extra)
    rng = np.random.RandomState(seed)
    document_index = build_document_index(documents, num_epochs, rng, separate)
    sample_index = build_sample_index(
        sequence_lengths,
        document_index,
        seq_length,
        num_epochs,
        tokens_per_epoch,
        drop_last_partial_sequence,
        add_extra_token,
    )
    total = sample_index.shape[0] - 1
    if separate:
        shuffled_together = ((num_epochs - 1) * tokens_per_epoch - extra) // seq_length
    else:
        shuffled_together = total
    shuffle_index = build_shuffle_index(shuffled_together, total, rng)
    return GPTIndices(document_index, sample_index, shuffle_index, num_epochs, separate)


# --- blending ---------------------------------------------------------------------------------

_SEQUENTIAL_WORK = 20_000
"""Below this many (sample, dataset) pairs the plain step-by-step loop is the faster one."""


def build_blending_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Megatron's weighted blend: which dataset, and which of its samples, for each sample.

    Sample i goes to the dataset d with the largest `w[d] * max(i, 1) - count[d]`
    (first one on ties), `count[d]` being how many samples d gave so far. The
    weights are used as given (Megatron normalises them first). Returns
    `dataset_index` int16 and `dataset_sample_index` int64.
    """
    return _greedy_blend(np.asarray(weights, dtype=np.float64), int(size), None)


def build_exhaustive_blending_indices(sizes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Blend every sample of every dataset exactly once, in proportion to their sizes.

    The same greedy choice, with weights `size[d] / sum(sizes)` and a dataset
    leaving the race once all its samples are used (Megatron's blend when no
    sample count is asked for).
    """
    caps = np.asarray(sizes, dtype=np.int64)
    total = int(caps.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int16), np.zeros(0, dtype=np.int64)
    return _greedy_blend(caps / float(total), total, caps)


def _greedy_blend(
    weights: np.ndarray, size: int, caps: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """The greedy blend, simulated for many chunks of samples side by side.

    The choice at step i depends on the counts so far, so the steps are
    sequential; but the greedy keeps every count within about one of `w * i`,
    and forgets a wrong start once every dataset has been drawn again. So the
    steps are cut into K chunks of B, each chunk starts from counts rounded
    from `w * (i - 1)`, and all K run in lock step: B numpy steps over K-long arrays
    instead of K * B Python steps. Chunk k is exact when it started from the
    true counts, which are where chunk k - 1 ended if that one was exact. The
    chunks whose start disagrees with their predecessor's end are run again
    from that end, until none disagrees; chunk 0 starts exact, so this
    terminates, and in practice after two or three rounds. Every choice is
    the same float64 `w * i - count` comparison as Megatron's, so the result
    is the same arrays, not an approximation.
    """
    num_datasets = weights.shape[0]
    if num_datasets >= np.iinfo(np.int16).max:
        raise ValueError(f"cannot blend {num_datasets} datasets; the limit is 32766")
    if size == 0:
        return np.zeros(0, dtype=np.int16), np.zeros(0, dtype=np.int64)
    if num_datasets == 1:
        return np.zeros(size, dtype=np.int16), np.arange(size, dtype=np.int64)
    if size * num_datasets <= _SEQUENTIAL_WORK:
        dataset_index = np.empty(size, dtype=np.int16)
        _greedy_steps(weights, caps, 0, np.zeros(num_datasets), dataset_index)
        return dataset_index, _draw_numbers(np.zeros(num_datasets), dataset_index)

    # A chunk should outlast a few gaps between two draws of the rarest dataset: that is
    # how long a wrong start takes to be forgotten, so how long a chain of chunks redone
    # round after round can get. Beyond that, a chunk needs enough rows (size / chunk) for
    # each numpy step to do real work.
    rarest_gap = 1.0 / float(weights[weights > 0].min())
    chunk = max(4 * rarest_gap, size / 4096)
    chunk = int(min(chunk, max(size / 64, 256), size))
    num_chunks = -(-size // chunk)
    first_step = np.arange(num_chunks, dtype=np.int64) * chunk

    entry = _guess_counts(weights, first_step, caps)  # [chunks, datasets] when each starts
    entry[0] = 0.0
    end = np.empty_like(entry)
    dataset_index = np.empty((num_chunks, chunk), dtype=np.int16)
    sample_index = np.empty((num_chunks, chunk), dtype=np.int64)
    active = np.arange(num_chunks)
    rounds = 0
    while active.size:
        rounds += 1
        chosen, numbers, end[active] = _lockstep(
            weights, caps, first_step[active], entry[active], chunk
        )
        dataset_index[active] = chosen.T
        sample_index[active] = numbers.T
        implied = np.zeros_like(entry)
        implied[1:] = end[:-1]
        active = np.flatnonzero((implied != entry).any(axis=1))
        entry[active] = implied[active]
    logger.debug("blending: %d chunks of %d steps, %d rounds", num_chunks, chunk, rounds)
    return dataset_index.reshape(-1)[:size].copy(), sample_index.reshape(-1)[:size].copy()


_MANUAL_ARGMAX_DATASETS = 8
"""Up to this many datasets a compare-and-keep loop beats `argmax` over the short axis."""


def _lockstep(
    weights: np.ndarray,
    caps: np.ndarray | None,
    first_step: np.ndarray,
    counts: np.ndarray,
    steps: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run the greedy `steps` steps from each row of `counts`, all rows at once.

    Returns the choices and, per choice, the dataset's count before it (both
    `[steps, rows]`), and the counts after the last step. Internally the
    arrays are dataset-major (`[datasets, rows]`) so that every numpy call
    runs over long contiguous rows.
    """
    num_rows, num_datasets = counts.shape
    state = np.ascontiguousarray(counts.T)  # [datasets, rows]
    flat_state = state.reshape(-1)
    columns = np.arange(num_rows, dtype=np.int64)
    step = first_step.astype(np.float64)
    scale = np.empty_like(step)
    errors = np.empty_like(state)
    best = np.empty_like(step)
    choice = np.empty(num_rows, dtype=np.int64)
    better = np.empty(num_rows, dtype=bool)
    cells = np.empty(num_rows, dtype=np.int64)
    spent = None if caps is None else np.empty(state.shape, dtype=bool)
    caps_column = None if caps is None else caps.astype(np.float64)[:, None]
    weights_column = weights[:, None]
    chosen = np.empty((steps, num_rows), dtype=np.int16)
    numbers = np.empty((steps, num_rows), dtype=np.int64)
    manual = num_datasets <= _MANUAL_ARGMAX_DATASETS
    for t in range(steps):
        np.maximum(step, 1.0, out=scale)
        np.multiply(weights_column, scale, out=errors)
        errors -= state
        if spent is not None:
            np.greater_equal(state, caps_column, out=spent)
            errors[spent] = -np.inf
        # First maximum wins, as in the C++ loop: only a strictly greater error moves it.
        if num_datasets == 2:
            np.greater(errors[1], errors[0], out=better)
            choice[:] = better
        elif manual:
            best[:] = errors[0]
            choice.fill(0)
            for d in range(1, num_datasets):
                np.greater(errors[d], best, out=better)
                np.putmask(choice, better, d)  # several times faster than choice[better] = d
                np.maximum(best, errors[d], out=best)
        else:
            choice[:] = errors.argmax(axis=0)
        np.multiply(choice, num_rows, out=cells)
        cells += columns
        chosen[t] = choice
        np.take(flat_state, cells, out=numbers[t], mode="clip")
        np.add.at(flat_state, cells, 1.0)  # faster than flat_state[cells] += 1 in numpy 2
        step += 1.0
    return chosen, numbers, np.ascontiguousarray(state.T)


def _guess_counts(weights: np.ndarray, steps: np.ndarray, caps: np.ndarray | None) -> np.ndarray:
    """A likely greedy state at each step: `w * (step - 1)` rounded to integers summing to step.

    Rounding `w * (step - 1)` rather than `w * step` is exact for two datasets
    (the count of dataset 0 is then `floor(w0 * (step - 1)) + 1`) and right most
    of the time for more; a wrong guess only costs one more round.
    """
    exact = (steps[:, None] - 1).astype(np.float64) * weights[None, :]
    counts = np.floor(exact)
    missing = steps - counts.sum(axis=1).astype(np.int64)
    rank = np.argsort(np.argsort(counts - exact, axis=1, kind="stable"), axis=1)
    counts += rank < missing[:, None]
    np.maximum(counts, 0.0, out=counts)
    if caps is not None:
        np.minimum(counts, caps[None, :], out=counts)
    return counts


def _greedy_steps(
    weights: np.ndarray,
    caps: np.ndarray | None,
    first_step: int,
    counts: np.ndarray,
    out: np.ndarray,
) -> None:
    """The greedy one step at a time, in plain Python floats (IEEE doubles, like the C++)."""
    weight = weights.tolist()
    count = counts.tolist()
    cap = None if caps is None else [float(c) for c in caps.tolist()]
    datasets = range(len(weight))
    for position in range(out.shape[0]):
        scale = float(max(first_step + position, 1))
        best, best_error = -1, -math.inf
        for d in datasets:
            if cap is not None and count[d] >= cap[d]:
                continue
            error = weight[d] * scale - count[d]
            if best < 0 or error > best_error:
                best, best_error = d, error
        best = max(best, 0)
        out[position] = best
        count[best] += 1.0


def _draw_numbers(counts: np.ndarray, choices: np.ndarray) -> np.ndarray:
    """For each choice, how many samples its dataset had given before (starting from counts)."""
    out = np.empty(choices.shape[0], dtype=np.int64)
    for d in np.unique(choices):
        where = np.flatnonzero(choices == d)
        out[where] = int(counts[d]) + np.arange(where.size, dtype=np.int64)
    return out


# --- the cache --------------------------------------------------------------------------------


def _distributed() -> object | None:
    """`torch.distributed` when a process group is up, else None; never imports torch itself."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        return None
    return dist


def _save_atomically(path: str, array: np.ndarray) -> None:
    """Write next to the target, then rename: readers see the old file or the whole new one."""
    temporary = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        with open(temporary, "wb") as stream:
            np.save(stream, array, allow_pickle=False)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _write_text_atomically(path: str, text: str) -> None:
    temporary = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(temporary, "w", encoding="utf-8") as stream:
        stream.write(text)
    os.replace(temporary, path)


def cached_indices(
    cache_dir: str | None,
    base_name: str,
    description: str,
    names: Sequence[str],
    build: Callable[[], dict[str, np.ndarray]],
) -> dict[str, np.ndarray]:
    """Load index arrays from `cache_dir`, or build them there once for all ranks.

    The files are `{base_name}-{name}.npy` plus `{base_name}-description.txt`,
    the description written last so that it marks a complete set. `base_name`
    starts with the md5 of `description`, so a different config never finds
    another's files. When torch.distributed is initialised rank 0 builds while
    the other ranks wait at a barrier, then they load; every rank must call
    this in the same order. A rank that still finds no files after the barrier
    (a cache directory that is not shared between nodes) builds its own copy.
    With no `cache_dir` the arrays are built in memory and not saved.
    """
    if cache_dir is None:
        return _timed_build(build, base_name, None)
    paths = {name: os.path.join(cache_dir, f"{base_name}-{name}.npy") for name in names}
    description_path = os.path.join(cache_dir, f"{base_name}-description.txt")

    def complete() -> bool:
        if not all(os.path.isfile(path) for path in (*paths.values(), description_path)):
            return False
        with open(description_path, encoding="utf-8") as stream:
            return stream.read() == description

    def build_and_save() -> dict[str, np.ndarray]:
        arrays = _timed_build(build, base_name, cache_dir)
        os.makedirs(cache_dir, exist_ok=True)
        for name, path in paths.items():
            _save_atomically(path, arrays[name])
        _write_text_atomically(description_path, description)
        return arrays

    dist = _distributed()
    rank = 0 if dist is None else dist.get_rank()
    arrays: dict[str, np.ndarray] | None = None
    if rank == 0 and not complete():
        try:
            arrays = build_and_save()
        except BaseException:
            if dist is not None:
                dist.barrier()  # let the other ranks go on and fail on their own
            raise
    if dist is not None:
        dist.barrier()
    if arrays is not None:
        return arrays
    if not complete():
        if rank != 0:
            logger.warning(
                "rank %d: %s is not in %s after rank 0 built it; is the cache directory shared "
                "between nodes? Building a local copy.",
                rank,
                base_name,
                cache_dir,
            )
        return build_and_save()
    began = time.perf_counter()
    loaded = {
        name: np.load(path, mmap_mode="r", allow_pickle=False) for name, path in paths.items()
    }
    logger.info("loaded %s from %s in %.3f s", base_name, cache_dir, time.perf_counter() - began)
    return loaded


def _timed_build(
    build: Callable[[], dict[str, np.ndarray]], base_name: str, cache_dir: str | None
) -> dict[str, np.ndarray]:
    began = time.perf_counter()
    arrays = build()
    where = f", saving to {cache_dir}" if cache_dir else " (no cache directory: not saved)"
    logger.info("built %s in %.3f s%s", base_name, time.perf_counter() - began, where)
    return arrays
