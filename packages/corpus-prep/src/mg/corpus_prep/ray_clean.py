"""`mg-prep clean|dedup --engine ray`: the local engine's output, from Ray tasks.

1. The input is cut into contiguous shards (`reader.split_segments`). One Ray
   task per shard repairs, normalises and filters its documents (everything
   but de-duplication, which needs the whole corpus) and writes, under
   `OUTPUT.ray-shards/`, the records that passed (`shardNNNNN.jsonl`), their
   content digests and MinHash signatures (`.npz`) and, last, a `.done`
   record; a rerun skips the shards whose `.done` matches (same segments,
   inputs unchanged, same settings), as `tokenize --engine ray` does.
2. De-duplication on Ray Data (`ray_dedup`): the documents the local engine
   would drop as exact or near duplicates, by their place in input order.
3. The driver writes the records that are left, shard by shard in input
   order, through the same writer as the local engine: the same bytes.

Inputs and the output folder must be readable and writable under the same
paths on every node (a shared file system). `ray` is imported only by the
functions that run on it, and this module only by `--engine ray`.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from mg.corpus_prep.cleaning import Cleaner, CleanOptions
from mg.corpus_prep.corpus_texts import BadLine, parse_document
from mg.corpus_prep.dedup import NearDeduplicator, content_digest
from mg.corpus_prep.ray_cluster import fingerprint, first_line, load_done, ray_session, save_done
from mg.corpus_prep.ray_dedup import find_duplicates_on_ray
from mg.corpus_prep.reader import Segment, read_lines

SHARD_BITS = 32  # a document's order: shard << SHARD_BITS | its place among the shard's records
TASK_RETRIES = 3
REPORTED_SKIPS = 10


class ShardFailedError(Exception):
    """A shard could not be cleaned; the message is the user's one line."""


@dataclass
class ShardCounts:
    """What one shard read, dropped, changed and skipped (before de-duplication)."""

    read: int = 0
    passed: int = 0  # records written for de-duplication
    nbytes: int = 0  # bytes of input lines read
    characters: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    changed: Counter[str] = field(default_factory=Counter)
    skipped: int = 0
    skip_messages: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class CleanShardJob:
    index: int
    segments: list[Segment]
    keys: tuple[str, ...]
    options: CleanOptions
    on_error: str
    prefix: str  # the shard's files: PREFIX.jsonl, PREFIX.npz, PREFIX.done

    def fingerprint(self) -> str:
        return fingerprint(self.segments, self.index, self.keys, self.options, self.on_error)

    @property
    def files(self) -> list[str]:
        return [self.prefix + ".jsonl", self.prefix + ".npz"]


def clean_shard(job: CleanShardJob) -> tuple[str, object]:
    """Clean one shard into its files; ("done", ShardCounts) or ("error", message)."""
    done = load_done(job.prefix + ".done", job.fingerprint(), job.files)
    if done is not None:
        return "done", done
    options = job.options
    cleaner = Cleaner(replace(options, dedup="none"))  # de-duplication is corpus-wide: later
    near = None
    if options.dedup == "near":
        near = NearDeduplicator(
            options.minhash_threshold, options.num_perm, options.shingle_size, options.seed
        )
    counts, digests, signatures = ShardCounts(), [], []
    keys = list(job.keys)
    with open(job.prefix + ".jsonl", "wb") as out:
        for segment in job.segments:
            for lineno, data in read_lines(segment):
                counts.nbytes += len(data) + 1
                try:
                    document = parse_document(segment.source.name, lineno, data, keys)
                except BadLine as err:
                    if job.on_error != "skip":
                        return "error", str(err)
                    counts.skipped += 1
                    if len(counts.skip_messages) < REPORTED_SKIPS:
                        counts.skip_messages.append(str(err))
                    continue
                if document is None:
                    continue
                counts.read += 1
                counts.characters += sum(map(len, document.texts))
                result = cleaner.clean_fields(document.texts)
                counts.changed.update(result.changed_by)
                if result.texts is None:
                    counts.dropped[result.reason or "unknown"] += 1
                    continue
                record = dict(document.record)
                record.update(zip(keys, result.texts, strict=True))
                out.write(json.dumps(record, ensure_ascii=False).encode("utf-8") + b"\n")
                joined = "\n\x00\n".join(result.texts)  # as Cleaner.clean_fields joins them
                digests.append(np.frombuffer(content_digest(joined), dtype=np.uint8))
                if near is not None:
                    signatures.append(near.signature(joined).hashvalues)
                counts.passed += 1
    orders = (np.int64(job.index) << SHARD_BITS) + np.arange(counts.passed, dtype=np.int64)
    meta = {
        "order": orders,
        "digest": np.stack(digests) if digests else np.zeros((0, 16), np.uint8),
    }
    if near is not None:
        meta["signature"] = (
            np.stack(signatures) if signatures else np.zeros((0, options.num_perm), np.uint64)
        )
    with open(job.prefix + ".npz", "wb") as stream:
        np.savez(stream, **meta)
    save_done(job.prefix + ".done", job.fingerprint(), counts)
    return "done", counts


@dataclass
class RayCleanResult:
    """What the driver needs for the summary, beside the output file."""

    read: int = 0
    kept: int = 0
    characters_read: int = 0
    characters_kept: int = 0
    skipped: int = 0
    skip_messages: list[str] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    changed: Counter[str] = field(default_factory=Counter)


def clean_on_ray(
    groups: list[list[Segment]],
    keys: tuple[str, ...],
    options: CleanOptions,
    on_error: str,
    output: str,
    write: Callable[[dict], None],
    on_progress: Callable[[int, int, int], None],
    address: str | None,
    connect_timeout: float,
) -> RayCleanResult:
    """Clean and de-duplicate `groups` on Ray; `write` gets the kept records in input order."""
    folder = output + ".ray-shards"
    jobs = [
        CleanShardJob(i, segments, keys, options, on_error, os.path.join(folder, f"shard{i:05d}"))
        for i, segments in enumerate(groups)
    ]
    with ray_session(address, connect_timeout) as ray:
        os.makedirs(folder, exist_ok=True)
        task = ray.remote(num_cpus=1, max_retries=TASK_RETRIES)(clean_shard)
        try:
            counts = _run_shards(ray, task, jobs, on_progress)
            reasons: dict[int, str] = {}
            if options.dedup != "none":
                reasons = find_duplicates_on_ray(
                    ray,
                    [job.prefix + ".npz" for job in jobs],
                    options.minhash_threshold,
                    options.num_perm,
                    near=options.dedup == "near",
                )
        except ray.exceptions.RayError as err:
            raise ShardFailedError(f"--engine ray: a task failed ({first_line(err)})") from err
    result = RayCleanResult()
    for job, shard in zip(jobs, counts, strict=True):
        result.read += shard.read
        result.characters_read += shard.characters
        result.skipped += shard.skipped
        result.skip_messages.extend(shard.skip_messages)
        result.dropped.update(shard.dropped)
        result.changed.update(shard.changed)
        with open(job.prefix + ".jsonl", "rb") as lines:
            for place, line in enumerate(lines):
                reason = reasons.get((job.index << SHARD_BITS) + place)
                if reason is not None:
                    result.dropped[reason] += 1
                    continue
                record = json.loads(line)
                write(record)
                result.kept += 1
                result.characters_kept += sum(len(record[key]) for key in keys)
    shutil.rmtree(folder, ignore_errors=True)
    return result


def _run_shards(ray, task, jobs: list[CleanShardJob], on_progress) -> list[ShardCounts]:
    """Every shard's counts, in shard order; the first bad line in input order is the error."""
    pending = {task.remote(job): job.index for job in jobs}
    results: dict[int, tuple[str, object]] = {}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        index = pending.pop(ready[0])
        results[index] = ray.get(ready[0])
        kind, value = results[index]
        if kind == "done":
            assert isinstance(value, ShardCounts)
            on_progress(value.read, value.nbytes, 0)
    errors = [value for _, (kind, value) in sorted(results.items()) if kind == "error"]
    if errors:
        raise BadLine(str(errors[0]))
    return [results[job.index][1] for job in jobs]  # type: ignore[misc]
