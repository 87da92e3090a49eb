"""The streaming pipeline: read lines -> tokenize in a worker pool -> write in input order.

Memory stays bounded whatever the corpus size: the main process reads the
input lazily and cuts it into chunks of at most `CHUNK_LINES` lines or
`CHUNK_BYTES` bytes (one longer line makes a chunk on its own); at most
`in_flight` chunks are submitted and not yet written at any time. Results come
back in submission order, so the output is in input order for any number of
workers. (`multiprocessing.Pool.imap` would do the same but reads its whole
input iterator ahead, which is what runs Megatron out of memory.)

A worker that dies (killed by the OS, say) is reported as an error instead of
hanging the run: `ProcessPoolExecutor` notices broken pools, `Pool` does not.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import zstandard

from mg.corpus_prep.encoder import (
    UNREADABLE,
    Chunk,
    DocumentEncoder,
    EncodedChunk,
    EncoderSpec,
    Rejected,
)
from mg.corpus_prep.interrupts import become_worker
from mg.corpus_prep.reader import Segment, read_lines
from mg.corpus_prep.stats import RunStats
from mg.corpus_prep.writer import DatasetWriter

CHUNK_LINES = 256
CHUNK_BYTES = 1 << 20
IN_FLIGHT_PER_WORKER = 3

_worker_encoder: DocumentEncoder | None = None


class LineRejectedError(Exception):
    """A line could not be used and `--on-error fail` is in effect."""

    def __init__(self, rejected: Rejected) -> None:
        what = "file" if rejected.reason == UNREADABLE else "line"
        super().__init__(f"{rejected.message()}; fix the {what} or pass --on-error skip")
        self.rejected = rejected


class WorkerDiedError(Exception):
    """A worker process died without an answer (killed by the OS, out of memory, ...)."""


def make_chunks(segments: Iterable[Segment]) -> Iterator[Chunk]:
    """Cut the lines of `segments` into chunks; a file that breaks off gives a failure chunk."""
    for segment in segments:
        name = segment.source.name
        lines: list[bytes] = []
        nbytes = 0
        first = last = 0
        try:
            for lineno, data in read_lines(segment):
                if not lines:
                    first = lineno
                lines.append(data)
                nbytes += len(data) + 1
                last = lineno
                if len(lines) >= CHUNK_LINES or nbytes >= CHUNK_BYTES:
                    yield Chunk(name, first, lines, nbytes)
                    lines, nbytes = [], 0
        except (OSError, EOFError, zstandard.ZstdError) as err:
            if lines:
                yield Chunk(name, first, lines, nbytes)
            where = f"after line {last}" if last else "at its start"
            reason = getattr(err, "strerror", None) or str(err) or type(err).__name__
            detail = f"the file cannot be read {where} ({reason})"
            yield Chunk(name, last + 1, [], 0, failure=Rejected(name, last + 1, UNREADABLE, detail))
            continue
        if lines:
            yield Chunk(name, first, lines, nbytes)


def _init_worker(spec: EncoderSpec, parent_pid: int) -> None:
    become_worker(parent_pid)  # Ctrl-C is the parent's; die with it (see interrupts)
    # One worker = one core: keep the Rust tokenizers from starting threads of their own.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    global _worker_encoder
    _worker_encoder = DocumentEncoder(spec)


def _encode_in_worker(chunk: Chunk) -> EncodedChunk:
    assert _worker_encoder is not None
    return _worker_encoder.encode(chunk)


def start_method() -> multiprocessing.context.BaseContext:
    # fork starts workers in milliseconds and shares the loaded modules; spawn elsewhere.
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork" if "fork" in methods else "spawn")


def encode_in_order(
    chunks: Iterable[Chunk],
    spec: EncoderSpec,
    workers: int,
    encoder: DocumentEncoder | None = None,
) -> Iterator[EncodedChunk]:
    """Encode `chunks` with `workers` processes (0: in this process, with `encoder` if given,
    so that a long-lived caller builds its tokenizer once), yielding in input order."""
    if workers == 0:
        encoder = encoder or DocumentEncoder(spec)
        for chunk in chunks:
            yield encoder.encode(chunk)
        return
    in_flight = max(2, IN_FLIGHT_PER_WORKER * workers)
    executor = ProcessPoolExecutor(
        workers, mp_context=start_method(), initializer=_init_worker, initargs=(spec, os.getpid())
    )
    pending: deque[tuple[Future[EncodedChunk], Chunk]] = deque()

    def oldest() -> EncodedChunk:
        future, chunk = pending.popleft()
        try:
            return future.result()
        except BrokenProcessPool as err:
            last = chunk.first_lineno + max(len(chunk.lines) - 1, 0)
            raise WorkerDiedError(
                f"a tokenizer worker process died while encoding {chunk.source} lines "
                f"{chunk.first_lineno}-{last} (killed by the OS, out of memory?); "
                "try fewer --workers"
            ) from err

    try:
        for chunk in chunks:
            if chunk.failure is not None:
                done: Future[EncodedChunk] = Future()
                done.set_result(EncodedChunk(chunk.source, {}, [chunk.failure], 0, 0, 0, 0))
                pending.append((done, chunk))
            else:
                pending.append((executor.submit(_encode_in_worker, chunk), chunk))
            while len(pending) >= in_flight:
                yield oldest()
        while pending:
            yield oldest()
    except BaseException:
        # An interrupt, an error, or the consumer gave up: stop the workers now rather
        # than after the chunk each is on (one huge document takes minutes).
        _stop_now(executor)
        raise
    executor.shutdown(wait=True)


def _stop_now(executor: ProcessPoolExecutor) -> None:
    """Kill the pool's workers and shut it down without hanging.

    A worker killed (or interrupted by a Ctrl-C sent to the process group) while it
    sends a result leaves part of a message in the result pipe: the pool's manager
    thread then waits for the rest, which never comes, and `shutdown` (and the
    interpreter's exit, which joins that thread) waits forever. With every worker gone,
    closing this process's own write end of the result pipe ends that read (EOF: the
    pool counts itself broken and cleans up), and the task queue's feeder thread, which
    may be blocked writing to workers that are gone, is not waited for.
    """
    processes = list((executor._processes or {}).values())
    for process in processes:
        process.terminate()
    for process in processes:
        process.join()
    executor._call_queue.cancel_join_thread()
    executor._result_queue._writer.close()
    executor.shutdown(wait=True, cancel_futures=True)


def tokenize_segments(
    segments: list[Segment],
    spec: EncoderSpec,
    workers: int,
    writer: DatasetWriter,
    on_error: str,
    on_progress: Callable[[EncodedChunk], None] = lambda chunk: None,
    encoder: DocumentEncoder | None = None,
) -> RunStats:
    """Run the pipeline over `segments` into `writer`; the caller finalizes or aborts it.

    With `on_error="fail"` the first rejected line (in input order) raises
    `LineRejectedError`; with "skip" it is counted in the returned stats.
    """
    stats = RunStats()
    for encoded in encode_in_order(make_chunks(segments), spec, workers, encoder):
        for rejected in encoded.rejected:
            if on_error == "fail":
                raise LineRejectedError(rejected)
            stats.reject(rejected)
        writer.write(encoded)
        stats.add(encoded)
        on_progress(encoded)
    return stats
