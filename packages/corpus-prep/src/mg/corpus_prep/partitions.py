"""`--partitions N`: cut the input in N contiguous parts, tokenize them side by side, merge.

This is Megatron's scheme (each partition its own process with
`--workers / N` tokenizer workers, then the partition datasets are merged)
with two differences that keep the output identical to `--partitions 1`:
partitions are contiguous byte ranges of the input (Megatron deals lines out
round robin unless `--keep-sequential-samples`, which reorders documents),
and no partition files are written (each partition reads its byte range of
the original files directly; compressed files go whole to one partition).

What it buys: N writer processes instead of one, which helps when writing,
not tokenizing, is the bottleneck (many cores, fast tokenizer).
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import tempfile
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mg.corpus_prep import interrupts
from mg.corpus_prep.encoder import EncodedChunk, EncoderSpec
from mg.corpus_prep.pipeline import (
    LineRejectedError,
    WorkerDiedError,
    start_method,
    tokenize_segments,
)
from mg.corpus_prep.reader import Segment
from mg.corpus_prep.stats import RunStats
from mg.corpus_prep.writer import DatasetWriter, output_prefixes
from mg.indexed_dataset.format import IndexedDatasetBuilder


class PartitionFailedError(Exception):
    """A partition stopped; the message is the partition's own error."""


@dataclass(frozen=True)
class PartitionJob:
    index: int
    segments: list[Segment]
    spec: EncoderSpec
    workers: int
    prefix: str  # temporary output prefix of this partition
    level: str
    dtype: str
    on_error: str


def _run_partition(job: PartitionJob, messages, parent_pid: int) -> None:  # in a child process
    interrupts.become_worker(parent_pid)

    def report(chunk: EncodedChunk) -> None:
        messages.put(("progress", job.index, chunk.documents, chunk.nbytes, chunk.tokens))

    try:
        keys = job.spec.json_keys
        with DatasetWriter(job.prefix, keys, job.level, np.dtype(job.dtype)) as writer:
            stats = tokenize_segments(
                job.segments, job.spec, job.workers, writer, job.on_error, report
            )
            writer.finalize()
        messages.put(("done", job.index, stats))
    except (LineRejectedError, WorkerDiedError) as err:
        messages.put(("error", job.index, str(err)))
    except OSError as err:  # the output (disk full, ...): the parent words it
        left = getattr(err, "left_behind", [])
        messages.put(("oserror", job.index, err.errno, err.strerror, left))
    except Exception:
        crash = f"partition {job.index} crashed:\n{traceback.format_exc()}"
        messages.put(("error", job.index, crash))


def run_partitioned(
    groups: list[list[Segment]],
    spec: EncoderSpec,
    workers_per_partition: int,
    output_prefix: str,
    level: str,
    dtype: np.dtype,
    on_error: str,
    on_progress: Callable[[int, int, int], None],
) -> tuple[RunStats, dict[str, str]]:
    """Tokenize each group in its own process, then merge the parts into the final datasets."""
    context = start_method()
    messages = context.Queue()
    folder = tempfile.mkdtemp(
        prefix=os.path.basename(output_prefix) + ".partitions-",
        dir=os.path.dirname(os.path.abspath(output_prefix)),
    )
    jobs = [
        PartitionJob(
            i,
            segments,
            spec,
            workers_per_partition,
            os.path.join(folder, f"part{i:04d}"),
            level,
            dtype.name,
            on_error,
        )
        for i, segments in enumerate(groups)
    ]
    parent = os.getpid()
    processes = [
        context.Process(target=_run_partition, args=(job, messages, parent)) for job in jobs
    ]
    try:
        for process in processes:
            process.start()
        results = _collect(processes, messages, on_progress)
        stats = RunStats()
        for job in jobs:
            stats.merge(results[job.index])
        outputs = output_prefixes(output_prefix, spec.json_keys, level)
        interrupts.check()  # an interrupt during the partitions publishes nothing
        with contextlib.ExitStack() as stack:  # every key merged before any is published
            builders = {}
            for key, final in outputs.items():
                builders[key] = stack.enter_context(IndexedDatasetBuilder(final + ".bin", dtype))
                for job in jobs:
                    builders[key].add_index(output_prefixes(job.prefix, (key,), level)[key])
            with interrupts.publishing():
                for key, final in outputs.items():
                    builders[key].finalize(final + ".idx")
        return stats, outputs
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
            if process.pid is not None:
                process.join()
        shutil.rmtree(folder, ignore_errors=True)


def _collect(processes, messages, on_progress: Callable[[int, int, int], None]) -> list[RunStats]:
    results: dict[int, RunStats] = {}
    while len(results) < len(processes):
        try:
            message = messages.get(timeout=0.5)
        except queue.Empty:
            for index, process in enumerate(processes):
                if index not in results and not process.is_alive():
                    # it may have put its last message just before exiting
                    try:
                        message = messages.get(timeout=2.0)
                        break
                    except queue.Empty:
                        raise PartitionFailedError(
                            f"partition {index} stopped without a result "
                            f"(exit code {process.exitcode})"
                        ) from None
            else:
                continue
        kind, index, *payload = message
        if kind == "progress":
            on_progress(*payload)
        elif kind == "done":
            results[index] = payload[0]
        elif kind == "oserror":
            number, reason, left = payload
            failure = OSError(number, reason)
            failure.left_behind = left  # type: ignore[attr-defined]
            raise failure
        else:
            raise PartitionFailedError(payload[0])
    return [results[i] for i in range(len(processes))]
