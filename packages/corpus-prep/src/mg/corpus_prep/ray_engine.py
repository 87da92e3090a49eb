"""`mg-prep tokenize --engine ray`: the shards of the input tokenized by Ray actors, merged.

The input is cut into contiguous shards (`reader.split_segments`: byte ranges
of plain files, whole compressed or Parquet files). Each shard is tokenized by
one of `--workers` actors (one tokenizer each, built once) into its own
dataset under `PREFIX.ray-shards/`, published there atomically with a `.done`
record; the driver then merges the shards in input order into the final
datasets, so the output is the bytes of the local engine's.

- A killed actor is restarted and its shard done again (Ray's actor restarts
  and task retries); a shard's files appear only once complete, so the retry
  gives the same bytes.
- A rerun after a failure skips the shards whose `.done` record matches the
  same shard of the same run (same segments, tokenizer settings and keys), so
  a cluster job that died late loses only the shards in flight.
- Inputs and the output folder must be readable and writable under the same
  paths on every node (a shared file system), as with Megatron's partitions.

`ray` is imported here only, and this module only by `--engine ray`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from mg.corpus_prep import interrupts
from mg.corpus_prep.encoder import DocumentEncoder, EncoderSpec
from mg.corpus_prep.partitions import PartitionFailedError
from mg.corpus_prep.pipeline import LineRejectedError, WorkerDiedError, tokenize_segments
from mg.corpus_prep.ray_cluster import (
    DEFAULT_CONNECT_TIMEOUT,
    RayConnectError,
    fingerprint,
    first_line,
    load_done,
    ray_session,
    save_done,
)
from mg.corpus_prep.reader import Segment
from mg.corpus_prep.stats import RunStats
from mg.corpus_prep.writer import DatasetWriter, output_prefixes
from mg.indexed_dataset.format import IndexedDatasetBuilder

ACTOR_RESTARTS = 3  # a shard whose actor dies this many times fails the run


@dataclass(frozen=True)
class ShardJob:
    index: int
    segments: list[Segment]
    spec: EncoderSpec
    prefix: str  # the shard's output prefix
    level: str
    dtype: str
    on_error: str

    def fingerprint(self) -> str:
        """What decides the shard's bytes: a rerun reuses a shard only if this matches."""
        settings = (self.index, self.spec, self.level, self.dtype, self.on_error)
        return fingerprint(self.segments, *settings)

    @property
    def done_path(self) -> str:
        return self.prefix + ".done"


def shard_done(job: ShardJob) -> RunStats | None:
    """The stats of a shard a previous run completed with the same settings, else None."""
    files = [
        prefix + suffix
        for prefix in output_prefixes(job.prefix, job.spec.json_keys, job.level).values()
        for suffix in (".bin", ".idx")
    ]
    return load_done(job.done_path, job.fingerprint(), files)


def run_shard(job: ShardJob, encoder: DocumentEncoder | None = None) -> tuple[str, object]:
    """Tokenize one shard into its own datasets; ("done", stats) or ("error", message)."""
    if (stats := shard_done(job)) is not None:
        return "done", stats
    keys = job.spec.json_keys
    try:
        with DatasetWriter(job.prefix, keys, job.level, np.dtype(job.dtype)) as writer:
            stats = tokenize_segments(
                job.segments, job.spec, 0, writer, job.on_error, encoder=encoder
            )
            writer.finalize()
    except (LineRejectedError, WorkerDiedError) as err:
        return "error", str(err)
    except OSError as err:
        return "error", f"shard {job.index}: cannot write {job.prefix} ({err.strerror or err})"
    save_done(job.done_path, job.fingerprint(), stats)
    return "done", stats


class ShardActor:
    """One tokenizer per actor: the encoder is built on the first shard and kept."""

    def __init__(self) -> None:
        self.encoder: DocumentEncoder | None = None

    def run(self, job: ShardJob) -> tuple[str, object]:
        if self.encoder is None or self.encoder.spec != job.spec:
            self.encoder = DocumentEncoder(job.spec)
        return run_shard(job, self.encoder)


def run_on_ray(
    groups: list[list[Segment]],
    spec: EncoderSpec,
    actors: int,
    output_prefix: str,
    level: str,
    dtype: np.dtype,
    on_error: str,
    on_progress: Callable[[int, int, int], None],
    address: str | None,
    connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
) -> tuple[RunStats, dict[str, str]]:
    """Tokenize `groups` as shards on Ray, then merge them in order into the final datasets."""
    import ray  # lazy: an optional dependency, imported only for --engine ray
    from ray.util import ActorPool  # lazy: as above

    folder = output_prefix + ".ray-shards"
    jobs = [
        ShardJob(
            i, segments, spec, os.path.join(folder, f"shard{i:05d}"), level, dtype.name, on_error
        )
        for i, segments in enumerate(groups)
    ]
    try:
        with ray_session(address, connect_timeout):
            os.makedirs(folder, exist_ok=True)
            remote = ray.remote(
                num_cpus=1, max_restarts=ACTOR_RESTARTS, max_task_retries=ACTOR_RESTARTS
            )
            pool = ActorPool([remote(ShardActor).remote() for _ in range(max(1, actors))])
            stats = RunStats()
            for kind, result in pool.map(lambda actor, job: actor.run.remote(job), jobs):
                if kind == "error":
                    raise PartitionFailedError(str(result))
                assert isinstance(result, RunStats)
                stats.merge(result)
                on_progress(result.documents, result.nbytes, result.tokens)
    except RayConnectError as err:
        raise PartitionFailedError(str(err)) from err
    except ray.exceptions.RayError as err:
        raise PartitionFailedError(f"--engine ray: a shard failed ({first_line(err)})") from err
    outputs = _merge(jobs, spec, output_prefix, level, dtype)
    shutil.rmtree(folder, ignore_errors=True)
    return stats, outputs


def _merge(
    jobs: list[ShardJob], spec: EncoderSpec, output_prefix: str, level: str, dtype: np.dtype
) -> dict[str, str]:
    outputs = output_prefixes(output_prefix, spec.json_keys, level)
    interrupts.check()
    with contextlib.ExitStack() as stack:  # every key merged before any is published
        builders = {}
        for key, final in outputs.items():
            builders[key] = stack.enter_context(IndexedDatasetBuilder(final + ".bin", dtype))
            for job in jobs:
                builders[key].add_index(output_prefixes(job.prefix, (key,), level)[key])
        with interrupts.publishing():
            for key, final in outputs.items():
                builders[key].finalize(final + ".idx")
    return outputs
