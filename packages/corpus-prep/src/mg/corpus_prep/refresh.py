"""The incremental data refresh behind `mg-prep refresh`, safe to run from cron.

One run, holding ``OUT/.refresh.lock`` throughout:

1. sweep what a killed run may have left: ``OUT/.staging/`` and temporaries;
2. compare the input folder with ``OUT/manifest.json`` (`refresh_plan`):
   new and changed files are processed, unchanged ones kept, vanished ones
   dropped; a different tokenizer/options fingerprint reprocesses everything;
3. tokenize each file to process into ``OUT/.staging/``, one shard per input
   file and dataset (json key), then move the complete shards into
   ``OUT/shards/`` (.bin first, .idx last: a shard whose .idx exists is whole).
   Shard names carry a hash of (path, content, fingerprint), so they never
   replace a shard the published blend points at, and a shard built by a run
   killed before publishing is found and re-used;
4. publish: fsync the shards, replace the blend file(s), then the manifest
   last, each with an atomic rename (`refresh_files.write_atomic`);
5. with ``prune``, delete shards the new manifest no longer references.

Whatever moment the process dies at, the published blend and manifest are
each a complete file naming only shards that exist: before step 4 both are
the old ones, byte for byte; between the two renames of step 4 the blend is
already new and the manifest still old, which the next run sees as work to
do and finishes (re-using the shards). A reader of ``blend.txt`` therefore
always sees a whole, loadable blend.

For tests, ``MG_REFRESH_PAUSE_AT=<stage>`` makes a run stop and sleep at
`shard-built`, `shards-moved` or `blend-written`, to be killed there.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

from mg.corpus_prep.refresh_files import (
    fsync_path,
    move_durably,
    remove_stale_temporaries,
    remove_tree,
    write_atomic,
)
from mg.corpus_prep.refresh_lock import LockTimeout, refresh_lock
from mg.corpus_prep.refresh_manifest import (
    MANIFEST_NAME,
    InputRecord,
    Manifest,
    Shard,
    blend_names,
    blend_text,
    load_manifest,
    referenced_prefixes,
)
from mg.corpus_prep.refresh_plan import (
    DEFAULT_PATTERNS,
    InputFile,
    Plan,
    describe_inputs,
    make_plan,
    shard_stem,
)
from mg.indexed_dataset.format import IndexedDataset

SHARDS_DIR = "shards"
STAGING_DIR = ".staging"
PAUSE_ENV = "MG_REFRESH_PAUSE_AT"
PAUSE_SECONDS_ENV = "MG_REFRESH_PAUSE_SECONDS"
BUSY_MESSAGE = "another refresh is running"

# Writes the datasets of one input file: (input path, output prefix) ->
# files "{prefix}_{name}.bin/.idx" for every name in RefreshConfig.datasets.
ShardBuilder = Callable[[str, str], None]


class RefreshError(Exception):
    """A refresh that cannot go on; nothing new was published."""


@dataclass(frozen=True)
class RefreshConfig:
    input_dir: str
    output_dir: str
    datasets: list[str]  # e.g. ["text_document"]: the suffixes a ShardBuilder writes
    fingerprint: str  # of everything that changes the tokens (see refresh_tokenize)
    options: dict[str, Any]  # recorded in the manifest for people
    patterns: tuple[str, ...] = DEFAULT_PATTERNS
    lock_timeout: float = 0.0
    dry_run: bool = False
    prune: bool = False
    rehash: bool = False


@dataclass
class RefreshReport:
    plan: Plan
    built: list[str] = field(default_factory=list)  # input paths tokenized by this run
    reused: list[str] = field(default_factory=list)  # found complete from an interrupted run
    pruned: list[str] = field(default_factory=list)
    published: bool = False
    generation: int = 0
    busy: bool = False  # the lock was held by another run for the whole wait


def log(message: str) -> None:
    """One timestamped line on stdout: cron mails or appends it to the log file."""
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] refresh: {message}", flush=True)


def pause_point(stage: str) -> None:
    """Test hook: stop here (sleep) when MG_REFRESH_PAUSE_AT names this stage."""
    if os.environ.get(PAUSE_ENV) == stage:
        print(f"refresh: paused at {stage}", file=sys.stderr, flush=True)
        time.sleep(float(os.environ.get(PAUSE_SECONDS_ENV, "3600")))


def refresh(config: RefreshConfig, build: ShardBuilder) -> RefreshReport:
    """Run one refresh (see the module docstring); `build` tokenizes one input file."""
    if not os.path.isdir(config.input_dir):
        raise RefreshError(f"--input-dir {config.input_dir}: no such folder")
    output_dir = os.path.abspath(config.output_dir)
    if any(char.isspace() for char in output_dir):
        raise RefreshError(
            f"--output-dir {output_dir}: blend files separate entries by whitespace, so the "
            "output path must not contain any; choose another folder"
        )
    os.makedirs(output_dir, exist_ok=True)
    if config.dry_run:
        return _dry_run(config, output_dir)
    try:
        with refresh_lock(output_dir, config.lock_timeout):
            return _locked_refresh(config, output_dir, build)
    except LockTimeout:
        log(f"{BUSY_MESSAGE} on {output_dir}; waited {config.lock_timeout:g}s, exiting")
        return RefreshReport(Plan(), busy=True)


def _dry_run(config: RefreshConfig, output_dir: str) -> RefreshReport:
    previous = load_manifest(output_dir)
    files = describe_inputs(config.input_dir, previous, config.patterns, config.rehash)
    plan = make_plan(files, previous, config.fingerprint)
    describe_plan(plan, prefix="would ")
    return RefreshReport(plan)


def describe_plan(plan: Plan, prefix: str = "") -> None:
    for job in plan.process:
        log(f"{prefix}process {job.file.path} ({job.why})")
    for path in plan.remove:
        log(f"{prefix}drop {path} (removed from the input folder)")
    log(
        f"{prefix}process {len(plan.process)}, keep {len(plan.keep)}, "
        f"drop {len(plan.remove)} input files"
    )


def _locked_refresh(config: RefreshConfig, output_dir: str, build: ShardBuilder) -> RefreshReport:
    shards_dir = os.path.join(output_dir, SHARDS_DIR)
    staging_dir = os.path.join(output_dir, STAGING_DIR)
    _sweep(output_dir, shards_dir, staging_dir)
    os.makedirs(shards_dir, exist_ok=True)

    previous = load_manifest(output_dir)
    files = describe_inputs(config.input_dir, previous, config.patterns, config.rehash)
    plan = make_plan(files, previous, config.fingerprint)
    describe_plan(plan)
    report = RefreshReport(plan, generation=previous.generation if previous else 0)

    records: dict[str, InputRecord] = {}
    for file in plan.keep:
        record = previous.inputs[file.path]  # type: ignore[union-attr]
        # a touched but unchanged file: remember its new mtime, to skip hashing it next time
        records[file.path] = InputRecord(file.sha256, file.size, file.mtime_ns, record.shards)
    for job in plan.process:
        stem = shard_stem(job.file, config.fingerprint)
        if _complete(shards_dir, stem, config.datasets):
            log(f"{job.file.path}: re-using shards built by an interrupted run")
            report.reused.append(job.file.path)
        else:
            _build_shards(config, job.file, stem, staging_dir, shards_dir, build)
            report.built.append(job.file.path)
        records[job.file.path] = _record(job.file, stem, shards_dir, config.datasets)
    fsync_path(shards_dir)
    pause_point("shards-moved")

    manifest = Manifest(
        fingerprint=config.fingerprint,
        options=config.options,
        datasets=list(config.datasets),
        inputs=records,
        generation=report.generation,
        published_at=previous.published_at if previous else "",
    )
    if previous is None or _content(manifest) != _content(previous):
        manifest.generation += 1
        manifest.published_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        _publish(manifest, output_dir)
        report.published = True
        report.generation = manifest.generation
        log(f"published generation {manifest.generation}: {_totals(manifest)}")
    else:
        _publish_blends(manifest, output_dir)  # repairs a blend file deleted by hand
        log(f"nothing new; generation {manifest.generation} stays: {_totals(manifest)}")
    remove_tree(staging_dir)
    if config.prune:
        report.pruned = _prune(shards_dir, manifest)
    return report


def _sweep(output_dir: str, shards_dir: str, staging_dir: str) -> None:
    """Delete what a killed run left behind (safe: we hold the lock)."""
    stale = remove_stale_temporaries(output_dir) + remove_stale_temporaries(shards_dir)
    if remove_tree(staging_dir):
        stale.append(staging_dir)
    for path in stale:
        log(f"removed {path}, left by an interrupted run")


def _dataset_prefix(folder: str, stem: str, dataset: str) -> str:
    return os.path.join(folder, f"{stem}_{dataset}")


def _complete(folder: str, stem: str, datasets: list[str]) -> bool:
    """Every dataset of `stem` has its .idx, hence (renamed last) its whole .bin."""
    return all(
        os.path.isfile(_dataset_prefix(folder, stem, d) + ".idx")
        and os.path.isfile(_dataset_prefix(folder, stem, d) + ".bin")
        for d in datasets
    )


def _build_shards(
    config: RefreshConfig,
    file: InputFile,
    stem: str,
    staging_dir: str,
    shards_dir: str,
    build: ShardBuilder,
) -> None:
    os.makedirs(staging_dir, exist_ok=True)
    started = time.monotonic()
    log(f"{file.path}: tokenizing")
    build(os.path.join(config.input_dir, file.path), os.path.join(staging_dir, stem))
    if not _complete(staging_dir, stem, config.datasets):
        made = sorted(os.listdir(staging_dir))
        raise RefreshError(
            f"{file.path}: the tokenizer did not write the expected datasets "
            f"{', '.join(config.datasets)} (found: {', '.join(made) or 'nothing'})"
        )
    pause_point("shard-built")
    for dataset in config.datasets:
        source = _dataset_prefix(staging_dir, stem, dataset)
        target = _dataset_prefix(shards_dir, stem, dataset)
        move_durably(source + ".bin", target + ".bin")
        move_durably(source + ".idx", target + ".idx")
    log(f"{file.path}: done in {time.monotonic() - started:.1f}s")


def _record(file: InputFile, stem: str, shards_dir: str, datasets: list[str]) -> InputRecord:
    shards = {}
    for dataset in datasets:
        with IndexedDataset(_dataset_prefix(shards_dir, stem, dataset)) as data:
            shards[dataset] = Shard(
                prefix=f"{SHARDS_DIR}/{stem}_{dataset}",
                documents=data.num_documents,
                tokens=data.num_tokens,
            )
    return InputRecord(file.sha256, file.size, file.mtime_ns, shards)


def _content(manifest: Manifest) -> str:
    """The manifest without its generation stamp, to tell whether anything changed."""
    return replace(manifest, generation=0, published_at="").to_json()


def _publish_blends(manifest: Manifest, output_dir: str) -> None:
    for name, dataset in blend_names(manifest.datasets).items():
        path = os.path.join(output_dir, name)
        text = blend_text(manifest, dataset, output_dir).encode()
        try:
            with open(path, "rb") as stream:
                if stream.read() == text:
                    continue
        except FileNotFoundError:
            pass
        write_atomic(path, text)


def _publish(manifest: Manifest, output_dir: str) -> None:
    """Blend files first, the manifest last (see the module docstring)."""
    _publish_blends(manifest, output_dir)
    pause_point("blend-written")
    write_atomic(os.path.join(output_dir, MANIFEST_NAME), manifest.to_json().encode())


def _prune(shards_dir: str, manifest: Manifest) -> list[str]:
    """Delete shard files the manifest does not reference (removed or superseded inputs)."""
    keep = {os.path.basename(prefix) for prefix in referenced_prefixes(manifest)}
    removed = []
    for name in sorted(os.listdir(shards_dir)):
        stem, extension = os.path.splitext(name)
        if extension in (".bin", ".idx") and stem not in keep:
            os.remove(os.path.join(shards_dir, name))
            removed.append(name)
    if removed:
        fsync_path(shards_dir)
        log(f"pruned {len(removed)} unreferenced shard files")
    return removed


def _totals(manifest: Manifest) -> str:
    first = manifest.datasets[0] if manifest.datasets else None
    shards = [r.shards[first] for r in manifest.inputs.values() if first in r.shards]
    return (
        f"{len(manifest.inputs)} input files, {sum(s.documents for s in shards)} documents, "
        f"{sum(s.tokens for s in shards)} tokens in {first or 'no dataset'}"
    )
