"""What `mg-prep tokenize` tells the user while it runs and when it is done.

Three outputs, all on stderr:
- on a terminal, a tqdm bar with MB/s, documents/s and tokens/s; elsewhere (a
  log file, a pipe, a batch job) no bar, whose carriage returns would clutter
  the log, but a plain line every `PLAIN_EVERY` seconds with the same figures
  and the ETA (`--no-progress-bar` turns both off);
- Megatron's `--log-interval` lines, `Processed N documents (X docs/s, Y MB/s).`,
  plus tokens/s, so that scripts that grep Megatron's log keep working;
- a summary: documents, tokens, what was skipped and why, time, throughput.

MB here is MiB (2**20 bytes) of uncompressed input, as in Megatron (which
counts characters of each line, the same for ASCII text).
"""

from __future__ import annotations

import sys
import time
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


class Progress:
    """Tracks documents, bytes and tokens as chunks are written."""

    def __init__(
        self,
        total_bytes: int | None,
        log_interval: int,
        show_bar: bool | None = None,
        stream: TextIO | None = None,
        plain_every: float = PLAIN_EVERY,
    ) -> None:
        self.stream = stream or sys.stderr
        self.log_interval = log_interval
        self.total_bytes = total_bytes
        self.start = time.perf_counter()
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
            desc="tokenize",
        )
        # Plain lines where the bar would be, unless --no-progress-bar said no progress.
        self.plain = show_bar is None and self.bar.disable

    def update(self, documents: int, nbytes: int, tokens: int) -> None:
        self.documents += documents
        self.nbytes += nbytes
        self.tokens += tokens
        elapsed = max(time.perf_counter() - self.start, 1e-9)
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
        rate = self.nbytes / elapsed
        done = f"{self.nbytes / MIB:,.1f} MB"
        eta = ""
        if self.total_bytes:
            done = f"{self.nbytes / MIB:,.1f} of {self.total_bytes / MIB:,.1f} MB"
            done += f" ({100 * self.nbytes / self.total_bytes:.0f}%)"
            if rate > 0:
                left = max(self.total_bytes - self.nbytes, 0) / rate
                eta = f"; ETA {int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}"
        return (
            f"tokenize: {done}, {self.documents:,} documents ({self.documents / elapsed:,.0f} "
            f"docs/s, {rate / MIB:.2f} MB/s, {self.tokens / elapsed:,.0f} tokens/s){eta}"
        )

    def _log_line(self, elapsed: float) -> None:
        tqdm.write(
            f"Processed {self.documents} documents ({self.documents / elapsed:.2f} docs/s, "
            f"{self.nbytes / elapsed / MIB:.2f} MB/s, {self.tokens / elapsed:,.0f} tokens/s).",
            file=self.stream,
        )

    def close(self) -> float:
        """Close the bar; return the elapsed seconds."""
        self.bar.close()
        return time.perf_counter() - self.start


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
