"""Counts of one `mg-prep tokenize` run: what was read, written and skipped, and why."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from mg.corpus_prep.encoder import EncodedChunk, Rejected

EXAMPLES_PER_REASON = 3


@dataclass
class RunStats:
    """Totals over the chunks written; `merge` adds the stats of another partition."""

    documents: int = 0
    tokens: int = 0
    nbytes: int = 0
    blank_lines: int = 0
    sequences: int = 0
    empty: Counter[str] = field(default_factory=Counter)  # documents without tokens, by key
    skipped: Counter[str] = field(default_factory=Counter)  # rejected lines, by reason
    examples: dict[str, list[str]] = field(default_factory=dict)  # first few, by reason

    def add(self, chunk: EncodedChunk) -> None:
        self.documents += chunk.documents
        self.tokens += chunk.tokens
        self.nbytes += chunk.nbytes
        self.blank_lines += chunk.blank_lines
        self.sequences += sum(int(k.sequence_lengths.size) for k in chunk.keys.values())
        self.empty.update({k: n for k, n in chunk.empty.items() if n})

    def reject(self, rejected: Rejected) -> None:
        self.skipped[rejected.reason] += 1
        shown = self.examples.setdefault(rejected.reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(rejected.message())

    def merge(self, other: RunStats) -> None:
        self.documents += other.documents
        self.tokens += other.tokens
        self.nbytes += other.nbytes
        self.blank_lines += other.blank_lines
        self.sequences += other.sequences
        self.empty.update(other.empty)
        self.skipped.update(other.skipped)
        for reason, messages in other.examples.items():
            shown = self.examples.setdefault(reason, [])
            shown.extend(messages[: EXAMPLES_PER_REASON - len(shown)])

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())
