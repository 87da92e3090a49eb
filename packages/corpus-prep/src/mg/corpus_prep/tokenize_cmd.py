"""`mg-prep tokenize`: Megatron's tools/preprocess_data.py, streaming and with clear errors.

The run; the flags and the command's description are in `tokenize_flags`, which
`mg-prep tokenize --help` reads without importing this module's dependencies.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable

import numpy as np

from mg.corpus_prep import interrupts, pipeline
from mg.corpus_prep.commands import UserError, refuse_own_input
from mg.corpus_prep.encoder import EncoderSpec, parse_line
from mg.corpus_prep.engine_flags import check_ray_arguments
from mg.corpus_prep.gigatoken_backend import BackendError, resolve_backend
from mg.corpus_prep.output_faults import (
    cannot_write,
    existing_dataset,
    final_name,
    missing_folders,
    remove_folders,
)
from mg.corpus_prep.output_shards import (
    TooFewDocumentsError,
    remove_dataset,
    split_dataset,
    write_blend,
)
from mg.corpus_prep.partitions import PartitionFailedError, run_partitioned
from mg.corpus_prep.pipeline import LineRejectedError, WorkerDiedError
from mg.corpus_prep.progress import Progress, format_summary, info, warn
from mg.corpus_prep.punkt_rules import DEFAULT_PUNKT_RULES
from mg.corpus_prep.reader import (
    InputError,
    Segment,
    Source,
    find_sources,
    read_lines,
    split_segments,
)
from mg.corpus_prep.splitter import SplitterError, SplitterSpec, resolve_splitter
from mg.corpus_prep.stats import RunStats
from mg.corpus_prep.tokenize_flags import default_workers
from mg.corpus_prep.tokenizer_args import build_tokenizer_from_config, config_from_args
from mg.corpus_prep.writer import DatasetWriter, output_prefixes
from mg.indexed_dataset.format import best_dtype

MAX_WORKERS_PER_CPU = 4


def max_workers(partitions: int = 1) -> int:
    """The most tokenizer processes worth starting: MAX_WORKERS_PER_CPU per usable CPU
    (a multiple of --partitions, at least one per partition). Beyond that each one only
    adds start-up time and a tokenizer's memory."""
    cap = MAX_WORKERS_PER_CPU * default_workers()
    return max(partitions, cap - cap % partitions)


def _check_numbers(args: argparse.Namespace) -> None:
    if args.workers < 0:
        raise UserError(f"--workers {args.workers}: must be 0 or more")
    if args.partitions < 1:
        raise UserError(f"--partitions {args.partitions}: must be 1 or more")
    if getattr(args, "output_shards", 1) < 1:
        raise UserError(f"--output-shards {args.output_shards}: must be 1 or more")
    check_ray_arguments(args)
    if args.engine == "ray":
        _check_ray(args)
        return
    cap = max_workers(args.partitions)
    if args.workers > cap:
        warn(
            f"--workers {args.workers} is more than this machine can use "
            f"({default_workers()} CPUs); using {cap}"
        )
        args.workers = cap
    if args.partitions > 1 and (args.workers < args.partitions or args.workers % args.partitions):
        raise UserError(
            f"--workers {args.workers} is not a multiple of --partitions {args.partitions}: "
            "each partition gets workers/partitions tokenizer processes (Megatron's rule)"
        )
    if args.log_interval < 1:
        raise UserError(f"--log-interval {args.log_interval}: must be 1 or more")
    if len(set(args.json_keys)) != len(args.json_keys):
        raise UserError(f"--json-keys {' '.join(args.json_keys)}: a key is named twice")


def _check_ray(args: argparse.Namespace) -> None:
    if args.workers == 0:
        raise UserError("--workers 0 with --engine ray: give the number of Ray actors (1 or more)")


def ray_shards(args: argparse.Namespace) -> int:
    """Shards under --engine ray: --partitions when given, else 4 per actor."""
    return args.partitions if args.partitions > 1 else 4 * args.workers


def _corpus_sample(segments: list[Segment], key: str) -> Callable[[int], str]:
    """A reader of the first n characters of `key` texts, to train Punkt on if needed."""

    def sample(limit: int) -> str:
        parts, size = [], 0
        for segment in segments:
            for _, raw in read_lines(segment):
                document = parse_line(raw, (key,))
                if isinstance(document, dict):
                    value = document[key]
                    text = value if isinstance(value, str) else " ".join(value)
                    parts.append(text)
                    size += len(text)
                    if size >= limit:
                        return "\n\n".join(parts)[:limit]
        return "\n\n".join(parts)

    return sample


def _splitter_spec(args: argparse.Namespace, segments: list[Segment]) -> SplitterSpec:
    if not args.split_sentences:
        if args.sentence_splitter != "nltk":
            warn("--sentence-splitter has no effect without --split-sentences")
        if args.punkt_rules != DEFAULT_PUNKT_RULES:
            warn("--punkt-rules has no effect without --split-sentences")
        return SplitterSpec("none")
    try:
        return resolve_splitter(
            args.sentence_splitter,
            args.lang,
            args.keep_newlines,
            _corpus_sample(segments, args.json_keys[0]),
            warn,
            args.punkt_rules,
        )
    except SplitterError as err:
        raise UserError(str(err)) from err


def run(args: argparse.Namespace) -> int:
    _check_numbers(args)
    level = "sentence" if args.split_sentences else "document"
    outputs = output_prefixes(args.output_prefix, tuple(args.json_keys), level).values()
    refuse_own_input(
        [("--output-prefix", prefix + suffix) for prefix in outputs for suffix in (".bin", ".idx")],
        [("--input", item) for item in args.input],
    )
    try:
        sources = find_sources(args.input)
    except InputError as err:
        raise UserError(str(err)) from err
    if not sources:
        raise UserError("--input names no files")
    config = config_from_args(args)
    tokenizer = build_tokenizer_from_config(config)
    if args.append_eod and tokenizer.eod is None:
        raise UserError(f"--append-eod: the {args.tokenizer_type} tokenizer has no eod token")
    if args.tokenizer_type.lower().startswith("bert") and not args.split_sentences:
        warn("a BERT tokenizer without --split-sentences: each document is one sequence")
    dtype = best_dtype(tokenizer.vocab_size)
    total = sum(s.size for s in sources) if all(s.compression == "none" for s in sources) else None
    try:
        backend = resolve_backend(args.tokenizer_backend, args.tokenizer_type, total, args.workers)
    except BackendError as err:
        raise UserError(str(err)) from err
    segments = [Segment(source) for source in sources]
    spec = EncoderSpec(
        json_keys=tuple(args.json_keys),
        append_eod=args.append_eod,
        tokenizer_config=config,
        splitter=_splitter_spec(args, segments),
        dtype=dtype.name,
        tokenizer_backend=backend,
    )
    created = missing_folders(os.path.dirname(os.path.abspath(args.output_prefix)))
    _make_output_folder(args.output_prefix)
    info(
        f"mg-prep tokenize: {len(sources)} input file(s), {args.tokenizer_type} "
        f"(vocab {tokenizer.vocab_size:,}, {dtype.name}"
        + (", gigatoken" if backend == "gigatoken" else "")
        + f"), {args.workers} worker(s)"
        + (f" in {args.partitions} partitions" if args.partitions > 1 else "")
        + (f" on Ray, {ray_shards(args)} shards" if args.engine == "ray" else "")
    )
    finals = output_prefixes(args.output_prefix, spec.json_keys, level).values()
    shards = getattr(args, "output_shards", 1)
    replacing = [prefix for prefix in finals if existing_dataset(prefix) and shards == 1]
    progress = Progress(total, args.log_interval, args.progress_bar)
    # With --output-shards, one dataset is written under a working name, then cut.
    whole = args if shards == 1 else argparse.Namespace(**vars(args))
    whole.output_prefix = args.output_prefix + (".unsharded" if shards > 1 else "")
    try:
        stats, outputs = _tokenize(whole, sources, spec, level, dtype, progress)
        sharded = _shard(outputs, args.output_prefix, level, shards) if shards > 1 else {}
    except BaseException:
        remove_folders(created)  # a failed run leaves no folder it made either
        raise
    finally:
        elapsed = progress.close()
    info(format_summary(stats, elapsed, {} if sharded else outputs, dtype.name))
    for key, (pieces, blend) in sharded.items():
        info(f"  wrote {len(pieces)} shards of key {key!r} ({dtype.name}): {pieces[0][0]} ...")
        info(f"  wrote {blend}: --data-path " + " ".join(f"{n} {p}" for p, n in pieces))
    for prefix in replacing:  # as Megatron, an existing dataset of the same name is replaced
        info(f"  replaced the existing {prefix}.bin/.idx")
    if stats.documents == 0:
        warn(
            "the dataset holds 0 documents (every line empty or skipped): mg-train and "
            "mg-eval have nothing to read from it; check --input and --json-keys"
        )
    signum = interrupts.received()
    if signum is not None:  # arrived while the finished files were renamed into place
        name = signal.Signals(signum).name
        warn(f"interrupted ({name}) while publishing; the datasets above were complete first")
        return 128 + signum
    return 0


def _shard(
    outputs: dict[str, str], output_prefix: str, level: str, shards: int
) -> dict[str, tuple[list[tuple[str, int]], str]]:
    """Cut each whole dataset into `shards` and write its blend; remove the whole ones."""
    finals = output_prefixes(output_prefix, tuple(outputs), level)
    written = {}
    try:
        for key, whole in outputs.items():
            try:
                pieces = split_dataset(whole, finals[key], shards)
            except TooFewDocumentsError as err:
                raise UserError(
                    f"--output-shards {shards}: {finals[key]} has {err}; ask for fewer shards"
                ) from None
            written[key] = (pieces, write_blend(finals[key], pieces))
    finally:
        for whole in outputs.values():
            remove_dataset(whole)
    return written


def _make_output_folder(output_prefix: str) -> None:
    folder = os.path.dirname(os.path.abspath(output_prefix))
    try:
        os.makedirs(folder, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise UserError(
            f"--output-prefix {output_prefix}: a part of the path is a file, not a folder"
        ) from None
    except OSError as err:
        raise UserError(
            f"--output-prefix {output_prefix}: cannot create {folder} ({err.strerror})"
        ) from None
    if not os.access(folder, os.W_OK):
        raise UserError(f"--output-prefix {output_prefix}: {folder} is not writable")


def _tokenize(
    args: argparse.Namespace,
    sources: list[Source],
    spec: EncoderSpec,
    level: str,
    dtype: np.dtype,
    progress: Progress,
) -> tuple[RunStats, dict[str, str]]:
    """Run the pipeline (or the partitions) into the final datasets; errors become UserError."""
    try:
        if args.engine == "ray":
            from mg.corpus_prep.ray_engine import run_on_ray  # lazy: imports ray

            return run_on_ray(
                split_segments(sources, ray_shards(args)),
                spec,
                args.workers,
                args.output_prefix,
                level,
                dtype,
                args.on_error,
                progress.update,
                args.ray_address,
                args.ray_connect_timeout,
            )
        if args.partitions == 1:
            with DatasetWriter(args.output_prefix, spec.json_keys, level, dtype) as writer:
                stats = pipeline.tokenize_segments(
                    [Segment(s) for s in sources],
                    spec,
                    args.workers,
                    writer,
                    args.on_error,
                    lambda c: progress.update(c.documents, c.nbytes, c.tokens),
                )
                with interrupts.publishing():
                    return stats, writer.finalize()
        return run_partitioned(
            split_segments(sources, args.partitions),
            spec,
            args.workers // args.partitions,
            args.output_prefix,
            level,
            dtype,
            args.on_error,
            progress.update,
        )
    except (LineRejectedError, PartitionFailedError, WorkerDiedError) as err:
        interrupts.check()  # a worker killed by the same Ctrl-C is the interrupt, not an error
        raise UserError(str(err)) from err
    except OSError as err:  # the output: read-only, disk full, ... (inputs are read elsewhere)
        where = final_name(err.filename) if err.filename else args.output_prefix
        raise UserError(cannot_write(where, err)) from err
