"""Speculative decoding: a small draft model proposes tokens, the served model checks them.

Decoding one token costs the served (target) model a pass over all its weights;
checking k + 1 tokens in one packed step costs about the same on a CPU or a
GPU at small batch, since the weights are read once. So a cheap draft model
guesses the next k tokens of each greedy sequence, the target runs the
sequence's last token and the k guesses as one segment of its step, and every
guess up to the first one the target disagrees with is kept, plus the target's
own next token after it. The output is the target's greedy output exactly
(Megatron's and vLLM's semantics); how much faster it comes depends on how
often the draft guesses right.

Only greedy requests speculate; sampled ones decode one token a step, in the
same batch. The draft keeps its keys/values in a pool of its own with the same
number of blocks and positions per block as the target's, addressed by the
target sequence's block table: position p lives in block table[p // size] in
both pools, so the engine's block bookkeeping (growth, prefix sharing,
preemption, release) covers the draft too. A sequence's draft catches up from
position 0 on its first step (prefix-cache hits and recomputation included),
so it only reads positions it wrote itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from mg.core.models.paged_kv_cache import PagedSegment
from mg.generate_server.runner import ModelRunner


class DraftingSequence(Protocol):
    """What the drafter reads and writes of an engine sequence."""

    tokens: list[int]
    blocks: list[int]
    draft: list[int]
    draft_computed: int


class Drafter:
    """Proposes up to `num_tokens` greedy tokens per sequence with a draft `ModelRunner`.

    `catch_up_tokens` bounds the positions one sequence's draft computes in a
    step before proposing (a long prompt is caught up over several steps, and the
    sequence decodes one token a step meanwhile).
    """

    def __init__(
        self, runner: ModelRunner, num_tokens: int, vocab_size: int, catch_up_tokens: int
    ) -> None:
        if num_tokens < 1:
            raise ValueError("speculative decoding needs at least one draft token")
        if runner.recurrent_state:
            raise ValueError("a draft model with Mamba layers cannot roll back rejected tokens")
        self.runner = runner
        self.num_tokens = num_tokens
        self.vocab_size = vocab_size
        self.catch_up_tokens = max(1, catch_up_tokens)

    def propose(self, work: Sequence[tuple[DraftingSequence, int]]) -> None:
        """Fill each sequence's `draft` with up to k tokens (k its planned look-ahead).

        Round 0 runs every sequence's not yet drafted tokens (at most
        `catch_up_tokens`; a sequence still behind after that proposes nothing);
        each later round feeds the previous guess back, one token per sequence.
        """
        for sequence, _ in work:
            sequence.draft = []
        active = [(s, k) for s, k in work if k > 0]
        for round_ in range(max((k for _, k in active), default=0)):
            segments: list[PagedSegment] = []
            ids: list[int] = []
            positions: list[int] = []
            rows: list[int] = []
            stepping = []
            for sequence, k in active:
                if round_ == 0:
                    start = sequence.draft_computed
                    feed = sequence.tokens[start:]
                    if len(feed) > self.catch_up_tokens:
                        feed = feed[: self.catch_up_tokens]
                else:
                    start = len(sequence.tokens) + round_ - 1
                    feed = sequence.draft[-1:]
                segments.append(PagedSegment(len(ids), len(feed), start, list(sequence.blocks)))
                ids += feed
                positions += range(start, start + len(feed))
                rows.append(len(ids) - 1)
                stepping.append((sequence, k, start + len(feed)))
            logits = self.runner.forward(segments, ids, positions, rows)[:, : self.vocab_size]
            guesses = torch.argmax(logits, dim=-1).tolist()
            active = []
            for (sequence, k, computed), guess in zip(stepping, guesses, strict=True):
                sequence.draft_computed = computed
                if computed < len(sequence.tokens) + round_:  # still catching up
                    continue
                sequence.draft.append(guess)
                if len(sequence.draft) < k:
                    active.append((sequence, k))
            if not active:
                break

    @staticmethod
    def rejected(sequence: DraftingSequence, length_before: int, accepted: int) -> None:
        """After verification: the draft's keys/values are valid up to the last accepted
        guess (positions past it held guesses the target rejected)."""
        sequence.draft_computed = min(sequence.draft_computed, length_before + accepted)
        sequence.draft = []
