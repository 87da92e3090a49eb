"""What `mg-prep tokenize` tells the user while it runs and when it is done.

Three outputs, all on stderr:
- on a terminal, a tqdm bar with MB/s, documents/s and tokens/s; elsewhere (a
  log file, a pipe, a batch job) no bar, whose carriage returns would clutter
  the log, but a plain line every `PLAIN_EVERY` seconds with the same figures
  and the ETA (`--no-progress-bar` turns both off);
- Megatron's `--log-interval` lines, `Processed N documents (X docs/s, Y MB/s).`,
  plus tokens/s and the ETA, so that scripts that grep Megatron's log keep working;
- a summary: documents, tokens, what was skipped and why, time, throughput.

MB here is MiB (2**20 bytes) of uncompressed input, as in Megatron (which
counts characters of each line, the same for ASCII text). The ETA is the input
bytes left at the rate so far; with compressed inputs (whose uncompressed size
is not known up front) there is none. Every engine reports here: the local
workers and gigatoken's per chunk, Ray's per shard.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from tqdm import tqdm

from mg.corpus_prep.stats import RunStats

MIB = 1 << 20
PLAIN_EVERY = 30.0  # seconds between plain progress lines when stderr is not a terminal

# No tqdm monitor thread: the pipeline forks worker processes after the bar exists.
tqdm.monitor_interval = 0


def warn(message: str, command: str = "tokenize") -> None:
    """A warning in the same voice as the errors."""
    tqdm.write(f"mg-prep {command}: warning: {message}", file=sys.stderr)


def info(message: str) -> None:
    tqdm.write(message, file=sys.stderr)


def eta_seconds(done_bytes: int, total_bytes: int | None, elapsed: float) -> float | None:
    """Seconds left at the rate so far: (total - done) / (done / elapsed); None while there is
    no rate yet or no total (compressed inputs, whose uncompressed size is not known)."""
    if not total_bytes or done_bytes <= 0 or elapsed <= 0:
        return None
    return max(total_bytes - done_bytes, 0) * elapsed / done_bytes


def format_eta(seconds: float | None) -> str:
    """`h:mm:ss`, or `?` when unknown."""
    if seconds is None:
        return "?"
    whole = int(seconds + 0.5)
    return f"{whole // 3600}:{whole % 3600 // 60:02d}:{whole % 60:02d}"


class Progress:
    """Tracks documents, bytes and tokens as chunks are written (by any engine: the local
    workers, gigatoken's, or Ray's shards), and says how fast and how long still."""

    def __init__(
        self,
        total_bytes: int | None,
        log_interval: int,
        show_bar: bool | None = None,
        stream: TextIO | None = None,
        plain_every: float = PLAIN_EVERY,
        clock: Callable[[], float] = time.perf_counter,
        label: str = "tokenize",
        counts_tokens: bool = True,
    ) -> None:
        self.stream = stream or sys.stderr
        self.log_interval = log_interval
        self.total_bytes = total_bytes
        self.clock = clock
        self.label = label
        self.counts_tokens = counts_tokens
        self.start = clock()
        self.documents = 0
        self.nbytes = 0
        self.tokens = 0
        self._next_log = log_interval
        self.plain_every = plain_every
        self._next_plain = self.start + plain_every
        # show_bar None: only on a terminal (tqdm's own rule).
        self.bar = tqdm(
            total=total_bytes,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            disable=None if show_bar is None else not show_bar,
            file=self.stream,
            dynamic_ncols=True,
            smoothing=0.1,
            desc=label,
        )
        # Plain lines where the bar would be, unless --no-progress-bar said no progress.
        self.plain = show_bar is None and self.bar.disable

    def update(self, documents: int, nbytes: int, tokens: int) -> None:
        self.documents += documents
        self.nbytes += nbytes
        self.tokens += tokens
        elapsed = max(self.clock() - self.start, 1e-9)
        self.bar.update(nbytes)
        if not self.bar.disable:
            self.bar.set_postfix_str(
                f"{self.documents / elapsed:,.0f} docs/s, {self.tokens / elapsed:,.0f} tok/s",
                refresh=False,
            )
        if self.log_interval and self.documents >= self._next_log:
            self._log_line(elapsed)
            self._next_log = (self.documents // self.log_interval + 1) * self.log_interval
        now = self.start + elapsed
        if self.plain and now >= self._next_plain:
            self.stream.write(self.plain_line(elapsed) + "\n")
            self.stream.flush()
            self._next_plain = now + self.plain_every

    def plain_line(self, elapsed: float) -> str:
        """`tokenize: 12.0 of 50.0 MB (24%), 3,072 documents (...); ETA 0:01:02`."""
        done = f"{self.nbytes / MIB:,.1f} MB"
        eta = ""
        if self.total_bytes:
            done = f"{self.nbytes / MIB:,.1f} of {self.total_bytes / MIB:,.1f} MB"
            done += f" ({100 * self.nbytes / self.total_bytes:.0f}%)"
            eta = f"; ETA {format_eta(eta_seconds(self.nbytes, self.total_bytes, elapsed))}"
        return f"{self.label}: {done}, {self.documents:,} documents ({self._rates(elapsed)}){eta}"

    def _rates(self, elapsed: float) -> str:
        rates = f"{self.documents / elapsed:,.0f} docs/s, {self.nbytes / elapsed / MIB:.2f} MB/s"
        return rates + (f", {self.tokens / elapsed:,.0f} tokens/s" if self.counts_tokens else "")

    def _log_line(self, elapsed: float) -> None:
        """Megatron's line (`Processed N documents (X docs/s, Y MB/s).`), plus tokens/s and,
        when the input size is known, the ETA."""
        eta = eta_seconds(self.nbytes, self.total_bytes, elapsed)
        tqdm.write(
            f"Processed {self.documents} documents ({self.documents / elapsed:.2f} docs/s, "
            f"{self.nbytes / elapsed / MIB:.2f} MB/s, {self.tokens / elapsed:,.0f} tokens/s"
            + (f", ETA {format_eta(eta)}" if eta is not None else "")
            + ").",
            file=self.stream,
        )

    def close(self) -> float:
        """Close the bar; return the elapsed seconds."""
        self.bar.close()
        return self.clock() - self.start


def format_summary(stats: RunStats, elapsed: float, outputs: dict[str, str], dtype: str) -> str:
    """The end-of-run report: totals, skips by reason (with examples), outputs."""
    seconds = max(elapsed, 1e-9)
    lines = [
        f"mg-prep tokenize: {stats.documents:,} documents, {stats.sequences:,} sequences, "
        f"{stats.tokens:,} tokens from {stats.nbytes / MIB:,.1f} MB in {elapsed:.1f} s "
        f"({stats.documents / seconds:,.0f} docs/s, {stats.nbytes / seconds / MIB:.2f} MB/s, "
        f"{stats.tokens / seconds:,.0f} tokens/s)"
    ]
    for key, count in sorted(stats.empty.items()):
        has = "document has" if count == 1 else "documents have"
        lines.append(f"  {count:,} {has} no tokens in {key!r} (kept as empty documents)")
    if stats.blank_lines:
        lines.append(f"  {stats.blank_lines:,} blank lines ignored")
    if stats.skipped:
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in stats.skipped.most_common())
        lines.append(f"  skipped {stats.skipped_total:,} lines: {reasons}")
        for reason, _ in stats.skipped.most_common():
            for example in stats.examples.get(reason, []):
                lines.append(f"    {example}")
    for key, prefix in outputs.items():
        lines.append(f"  wrote {prefix}.bin/.idx ({dtype}, key {key!r})")
    return "\n".join(lines)
