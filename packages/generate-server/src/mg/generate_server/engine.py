"""The generation engine: continuous batching over a paged KV cache, in one thread.

Requests arrive from any thread (`submit`; a client request's sequences together,
all or none, with `submit_many`). The engine thread loops over
steps; each step is one packed forward (`ModelRunner.forward`) planned under a
token budget (`max_num_batched_tokens`):

1. every running sequence that decodes gets its one token first, so a long
   prompt never stalls the others' next tokens;
2. sequences still prefilling get the rest of the budget: a long prompt is
   prefilled in chunks over several steps (chunked prefill);
3. waiting requests are admitted while the budget, the running-sequence limit
   (`runner.num_slots`) and the pool allow. A prompt whose leading full blocks
   are already cached (an earlier prompt with the same start, e.g. a chat
   system prompt) takes those blocks and skips their computation (prefix
   caching).

Cache blocks are taken on demand as sequences grow. When the pool runs out, the
most recently admitted sequence is preempted: its blocks are released and it
goes back to the front of the queue, to be recomputed from its prompt and the
tokens it already produced (preemption by recompute), so its output is what it
would have been. A sequence whose chunk reaches its last token samples its
next token from that row's logits; the step's tokens are chosen in one call
(`sampling.choose_tokens`).

A model with Mamba layers (`runner.recurrent_state`) keeps each running
sequence's recurrent state in a slot of its own, taken at admission and given
back when it finishes or is preempted; prefix caching is off for it, since a
state cannot be restored from cached blocks (a preempted sequence is
recomputed from its first token, as any other).

With a draft model (`speculative.Drafter`), each greedy sequence that decodes
gets up to k draft tokens checked in the same step (speculative decoding): its
segment is its last token and the guesses, every row's logits come back, and
the guesses the target agrees with are kept with the target's next token.

A slow consumer never stalls the loop: callbacks only enqueue. Errors in a
step fail the requests of that step, not the engine.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mg.core.models.paged_kv_cache import PagedSegment
from mg.generate_server.block_manager import BlockManager, block_hash
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import (
    RowState,
    SamplingParams,
    TokenChoice,
    choose_token,
    choose_tokens,
    make_generator,
    next_top_p,
    token_logprobs,
)
from mg.generate_server.speculative import Drafter
from mg.generate_server.vision_prefill import ImageRows

DEFAULT_MAX_NUM_BATCHED_TOKENS = 512


class EngineFullError(RuntimeError):
    """Too many requests are waiting; the caller should answer 503 and the client retry."""


@dataclass
class TokenEvent:
    """One generated token (finish_reason None), or the end of a request."""

    choice: TokenChoice | None = None
    finish_reason: str | None = None
    """"stop" (stop token or string), "length", "cancelled" or "error"."""
    prompt_logprobs: list[float] | None = None
    """With the first event, when asked: log p of prompt tokens 1..n-1."""
    error: str | None = None


@dataclass(eq=False)
class _Sequence:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None]
    generator: torch.Generator
    top_p: float
    tokens: list[int] = field(default_factory=list)
    """The prompt, then every generated token."""
    blocks: list[int] = field(default_factory=list)
    """Its block table."""
    block_names: list[int] = field(default_factory=list)
    """Prefix-cache names of its leading full blocks."""
    computed: int = 0
    """Leading tokens whose keys/values are in the cache."""
    slot: int = -1
    """Its recurrent-state slot while running (models with Mamba layers)."""
    lookahead: int = 0
    """Draft tokens planned for this step (speculative decoding)."""
    draft: list[int] = field(default_factory=list)
    """This step's draft tokens."""
    draft_computed: int = 0
    """Leading tokens whose keys/values are in the draft model's pool."""
    prompt_logprobs: list[float] | None = None
    images: ImageRows | None = None
    """Its prompt's image rows (a vision-language model): their embeddings replace the
    placeholder ids' on prefill; such a prompt takes no part in prefix caching."""
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.monotonic)
    last_token_at: float = 0.0

    def __post_init__(self) -> None:
        self.tokens = list(self.prompt)
        if self.params.prompt_logprobs:
            self.prompt_logprobs = []

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt) :]

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def remaining(self) -> int:
        """Tokens to run before it can sample (1 when decoding)."""
        return len(self.tokens) - self.computed

    @property
    def collects_prompt_logprobs(self) -> bool:
        return self.prompt_logprobs is not None and len(self.tokens) == len(self.prompt)


class RequestHandle:
    """What `submit` returns: cancel() frees the request's cache blocks at the next step."""

    def __init__(self, sequence: _Sequence, engine: GenerationEngine) -> None:
        self._sequence = sequence
        self._engine = engine

    def cancel(self) -> None:
        self._sequence.cancelled = True
        self._engine._wake()


@dataclass
class EngineStats:
    """Counters read by /metrics."""

    prompt_tokens: int = 0
    """Prompt tokens computed (prefix-cache hits and recomputation excluded)."""
    cached_prompt_tokens: int = 0
    """Prompt tokens found in the prefix cache instead of computed."""
    recomputed_tokens: int = 0
    """Tokens computed again after a preemption."""
    generated_tokens: int = 0
    finished: int = 0
    steps: int = 0
    preemptions: int = 0
    draft_tokens: int = 0
    """Draft tokens checked by the target (speculative decoding)."""
    accepted_draft_tokens: int = 0
    """Of those, the ones the target agreed with."""
    recent: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=4096))
    """(time, tokens generated) per step, for the recent tokens/s."""

    def tokens_per_second(self, window: float = 10.0) -> float:
        """Generated tokens per second over the last `window` seconds of steps."""
        now = time.monotonic()
        samples = [(t, n) for t, n in list(self.recent) if now - t <= window]
        if not samples:
            return 0.0
        span = max(now - samples[0][0], 1e-3)
        return sum(n for _, n in samples) / span


class GenerationEngine:
    """Continuous batching with chunked prefill, prefix caching and preemption over a
    `ModelRunner` (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        detokenize: Callable[[Sequence[int]], str],
        vocab_size: int,
        max_waiting: int = 256,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        prefix_caching: bool | None = None,
        drafter: Drafter | None = None,
    ) -> None:
        """`prefix_caching` None: on, unless the model has a recurrent state. `drafter`:
        speculative decoding of greedy requests with its draft model."""
        if max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        recurrent = getattr(runner, "recurrent_state", False)
        if prefix_caching and recurrent:
            raise ValueError(
                "prefix caching: this model's Mamba layers keep a recurrent state that cached "
                "blocks cannot restore; serve it without prefix caching"
            )
        if prefix_caching is None:
            prefix_caching = not recurrent
        if drafter is not None and recurrent:
            raise ValueError(
                "speculative decoding: this model's Mamba layers cannot roll back rejected "
                "draft tokens; serve it without a draft model"
            )
        if drafter is not None and drafter.runner.num_blocks < runner.num_blocks:
            raise ValueError("the draft model's KV-cache pool must have the target's blocks")
        self.drafter = drafter
        self.runner = runner
        self.detokenize = detokenize
        self.vocab_size = vocab_size
        """Tokens at or above this id (vocabulary padding) are never produced."""
        self.max_waiting = max_waiting
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_running = runner.num_slots
        self.max_length = runner.max_length
        self.blocks = BlockManager(runner.num_blocks, runner.block_size, prefix_caching)
        self._free_slots = list(range(runner.num_slots - 1, -1, -1))
        self.stats = EngineStats()
        self.observe_latency: Callable[[str, float], None] | None = None
        """Called with ("ttft", seconds) for a request's first token and ("itl", seconds)
        between its later tokens (the /metrics histograms)."""
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="mg-serve-engine", daemon=True)
        self._thread.start()

    # --- the caller's side -------------------------------------------------

    def submit(
        self, prompt: list[int], params: SamplingParams, emit: Callable[[TokenEvent], None]
    ) -> RequestHandle:
        """Queue a request; `emit` is called from the engine thread for every event."""
        return self.submit_many([(prompt, params, emit)])[0]

    def submit_many(
        self,
        requests: Sequence[tuple[list[int], SamplingParams, Callable[[TokenEvent], None]]],
        images: Sequence[ImageRows | None] | None = None,
    ) -> list[RequestHandle]:
        """Queue the sequences of one client request (its prompts, its choices) together or
        none of them, so a server can refuse the request before it answers: EngineFullError
        when the queue lacks room for them all (a request larger than the whole queue is
        taken when the queue is empty), ValueError for a sequence that can never fit.
        `images`: each sequence's image rows (None: text only)."""
        sequences = [self._sequence(prompt, params, emit) for prompt, params, emit in requests]
        for sequence, rows in zip(sequences, images or [None] * len(sequences), strict=True):
            sequence.images = rows
        with self._lock:
            if self._stopping:
                raise RuntimeError("the generation engine is shut down")
            waiting = len(self._waiting)
            if waiting >= self.max_waiting or (
                waiting and waiting + len(sequences) > self.max_waiting
            ):
                raise EngineFullError(f"{waiting} requests are already waiting; try again shortly")
            self._waiting.extend(sequences)
            self._lock.notify()
        return [RequestHandle(sequence, self) for sequence in sequences]

    def _sequence(
        self, prompt: list[int], params: SamplingParams, emit: Callable[[TokenEvent], None]
    ) -> _Sequence:
        """A new sequence, checked to fit one sequence's positions and the whole pool."""
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_length:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + tokens to generate ({params.max_new_tokens}) "
                f"exceeds the {self.max_length} positions this server holds per sequence"
            )
        if self.blocks.blocks_for(total) > self.blocks.num_blocks:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + tokens to generate ({params.max_new_tokens}) "
                f"exceeds the KV cache ({self.blocks.num_blocks} blocks of "
                f"{self.blocks.block_size} positions; see --kv-cache-memory)"
            )
        return _Sequence(
            request_id=next(self._ids),
            prompt=list(prompt),
            params=params,
            emit=emit,
            generator=make_generator(params.seed),
            top_p=params.top_p,
        )

    def generate(self, prompt: list[int], params: SamplingParams) -> list[TokenEvent]:
        """Blocking convenience for scripts and tests: all events of one request."""
        events: list[TokenEvent] = []
        done = threading.Event()

        def emit(event: TokenEvent) -> None:
            events.append(event)
            if event.finish_reason is not None:
                done.set()

        self.submit(prompt, params, emit)
        done.wait()
        return events

    @property
    def num_active(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def shutdown(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._thread.join(timeout=30)

    def _wake(self) -> None:
        with self._lock:
            self._lock.notify()

    # --- the engine thread -------------------------------------------------

    def _loop(self) -> None:
        # the model runs in this thread: its intra-op threads are set here (OpenMP's
        # count is per calling thread), whatever the thread that built the engine uses
        if self.runner.device.type == "cpu":
            torch.set_num_threads(self.runner.num_threads)
        while True:
            idle = False
            with self._lock:
                while not self._stopping and not self._waiting and not self._running:
                    if not self._lock.wait(timeout=self.runner.heartbeat_seconds):
                        idle = True
                        break
                if self._stopping:
                    break
            if idle:
                self.runner.heartbeat()
                continue
            self._drop_cancelled()
            plan = self._schedule()
            if plan:
                self._run_step(plan)
        for sequence in self._running + list(self._waiting):
            sequence.emit(TokenEvent(finish_reason="cancelled", error="server shutting down"))
        self.runner.close()

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self._running if s.cancelled]:
            self._finish(sequence, TokenEvent(finish_reason="cancelled"))

    def _finish(self, sequence: _Sequence, event: TokenEvent) -> None:
        if sequence in self._running:
            self._running.remove(sequence)
            self._free_slots.append(sequence.slot)
        self.blocks.release(sequence.blocks)
        sequence.blocks, sequence.block_names = [], []
        self.stats.finished += 1
        sequence.emit(event)

    # --- scheduling ----------------------------------------------------------

    def _grow(self, sequence: _Sequence, positions: int) -> bool:
        """Give `sequence` the blocks for `positions` positions; False if the pool lacks them."""
        missing = self.blocks.blocks_for(positions) - len(sequence.blocks)
        if missing <= 0:
            return True
        taken = self.blocks.allocate(missing)
        if taken is None:
            return False
        sequence.blocks += taken
        return True

    def _preempt(self, sequence: _Sequence) -> None:
        """Release its blocks and queue it first again; it is recomputed when readmitted
        (its full blocks stay named, so the recomputation may find them still cached)."""
        self._running.remove(sequence)
        self._free_slots.append(sequence.slot)
        self.blocks.release(sequence.blocks)
        sequence.blocks, sequence.block_names, sequence.computed = [], [], 0
        sequence.draft_computed = 0
        if sequence.collects_prompt_logprobs:
            sequence.prompt_logprobs = []
        self.stats.preemptions += 1
        with self._lock:
            self._waiting.appendleft(sequence)

    def _schedule(self) -> list[tuple[_Sequence, int]]:
        """This step's (sequence, tokens to run) pairs, within the token budget and the pool."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[_Sequence, int]] = []
        planned: set[int] = set()
        decoding = [s for s in self._running if s.remaining == 1]
        prefilling = [s for s in self._running if s.remaining > 1]
        for sequence in decoding + prefilling:
            if budget <= 0:
                break
            if sequence not in self._running:  # preempted for an earlier one
                continue
            count = min(sequence.remaining, budget)
            sequence.lookahead = self._lookahead(sequence, budget - count)
            if sequence.lookahead and not self._grow(
                sequence, sequence.computed + count + sequence.lookahead
            ):
                sequence.lookahead = 0  # draft tokens never preempt anyone
            while not self._grow(sequence, sequence.computed + count):
                victims = [s for s in self._running if s.request_id not in planned]
                victim = victims[-1]  # the latest admitted; `sequence` itself at worst
                self._preempt(victim)
                if victim is sequence:
                    count = 0
                    break
            if count:
                plan.append((sequence, count))
                planned.add(sequence.request_id)
                budget -= count + sequence.lookahead
        self._admit(plan, budget)
        return plan

    def _lookahead(self, sequence: _Sequence, budget: int) -> int:
        """Draft tokens to check for a decoding greedy sequence this step (0: plain decode),
        within the budget, its tokens still to generate and the positions it may use."""
        if self.drafter is None or sequence.remaining != 1 or not sequence.generated:
            return 0
        if not sequence.params.is_greedy:
            return 0
        left = sequence.params.max_new_tokens - len(sequence.generated) - 1
        room = self.max_length - sequence.length
        return max(0, min(self.drafter.num_tokens, budget, left, room))

    def _admit(self, plan: list[tuple[_Sequence, int]], budget: int) -> None:
        """Move waiting requests into the batch while the budget, the running limit and the
        pool allow (a block per running sequence is kept free for their next tokens)."""
        while budget > 0 and len(self._running) < self.max_running:
            with self._lock:
                if not self._waiting:
                    return
                sequence = self._waiting[0]
                if sequence.cancelled:
                    self._waiting.popleft()
                    sequence.emit(TokenEvent(finish_reason="cancelled"))
                    continue
            # prompt log-probabilities need every prompt row's logits; image rows' ids
            # say nothing of the image, so no cached block can stand for them
            if not sequence.collects_prompt_logprobs and sequence.images is None:
                sequence.blocks, sequence.block_names = self.blocks.match_prefix(sequence.tokens)
                sequence.computed = len(sequence.blocks) * self.blocks.block_size
            count = min(sequence.remaining, budget)
            needed = self.blocks.blocks_for(sequence.computed + count) - len(sequence.blocks)
            if needed + len(self._running) > self.blocks.num_available:
                self.blocks.release(sequence.blocks)
                sequence.blocks, sequence.block_names, sequence.computed = [], [], 0
                return
            self._grow(sequence, sequence.computed + count)
            with self._lock:
                self._waiting.popleft()
            if not sequence.generated:
                self.stats.cached_prompt_tokens += sequence.computed
            sequence.slot = self._free_slots.pop()
            sequence.lookahead = 0
            self._running.append(sequence)
            plan.append((sequence, count))
            budget -= count

    # --- running a step ------------------------------------------------------

    def _run_step(self, plan: list[tuple[_Sequence, int]]) -> None:
        try:
            self._draft(plan)
            segments: list[PagedSegment] = []
            ids: list[int] = []
            positions: list[int] = []
            rows: list[int] = []
            spans: list[tuple[int, int]] = []  # each sequence's rows among the logits
            image_rows: list[tuple[Tensor, Tensor]] = []  # (rows of ids, their embeddings)
            for sequence, count in plan:
                start, first = len(ids), sequence.computed
                new = sequence.tokens[first : first + count] + sequence.draft
                blocks = list(sequence.blocks)
                segments.append(PagedSegment(start, len(new), first, blocks, sequence.slot))
                if sequence.images is not None and first < len(sequence.prompt):
                    offsets, embeddings = sequence.images.rows_in(first, count)
                    image_rows.append((offsets + start, embeddings))
                ids += new
                positions += range(first, first + len(new))
                row = len(rows)
                if sequence.collects_prompt_logprobs or sequence.draft:
                    rows += range(start, start + len(new))
                elif first + count == sequence.length:
                    rows.append(start + count - 1)
                spans.append((row, len(rows)))
            if image_rows:  # only then: runners without an image path keep their signature
                where, embeddings = zip(*image_rows, strict=True)
                spliced = (torch.cat(where), torch.cat(embeddings))
                logits = self.runner.forward(segments, ids, positions, rows, image_rows=spliced)
            else:
                logits = self.runner.forward(segments, ids, positions, rows)
            logits = logits[:, : self.vocab_size]
        except Exception as exc:  # a failed step fails its requests, never the engine
            for sequence, _ in plan:
                self._finish(
                    sequence,
                    TokenEvent(finish_reason="error", error=f"{type(exc).__name__}: {exc}"),
                )
            return
        self.stats.steps += 1
        generated_before = self.stats.generated_tokens
        # (sequence, its row of logits, its prompt's log-probabilities) of those that sample
        sampling: list[tuple[_Sequence, int, list[float] | None]] = []
        for (sequence, count), (row, end) in zip(plan, spans, strict=True):
            if sequence.draft:
                self._verify(sequence, logits[row:end])
                continue
            first = sequence.computed
            self._account(sequence, first, count)
            sequence.computed += count
            self._name_full_blocks(sequence)
            if sequence.collects_prompt_logprobs:
                targets = sequence.tokens[first + 1 : first + count + 1]
                if targets:
                    rows_read = logits[row : row + len(targets)]
                    sequence.prompt_logprobs += token_logprobs(rows_read, targets).tolist()
            if sequence.computed < sequence.length:
                continue  # more of its prompt to prefill
            prompt_logprobs = sequence.prompt_logprobs if not sequence.generated else None
            if sequence.params.max_new_tokens == 0:
                self._finish(
                    sequence, TokenEvent(finish_reason="length", prompt_logprobs=prompt_logprobs)
                )
                continue
            sampling.append((sequence, end - 1, prompt_logprobs))
        self._advance(logits, sampling)
        self.stats.recent.append((time.monotonic(), self.stats.generated_tokens - generated_before))

    def _draft(self, plan: list[tuple[_Sequence, int]]) -> None:
        """The draft model's guesses for this step's speculating sequences."""
        for sequence, _ in plan:
            sequence.draft = []
        work = [(s, s.lookahead) for s, _ in plan if s.lookahead]
        if work and self.drafter is not None:
            self.drafter.propose(work)

    def _verify(self, sequence: _Sequence, logits: Tensor) -> None:
        """Keep the draft tokens the target would have chosen, then the target's own next
        token: rows i = 0..k of `logits` follow the sequence's last token and guesses 1..i."""
        params, draft = sequence.params, sequence.draft
        previous, history = sequence.tokens[-1], list(sequence.generated)
        choices: list[TokenChoice] = []
        for i in range(len(draft) + 1):
            state = RowState(params, sequence.top_p, sequence.generator, previous, list(history))
            choice = choose_token(logits[i], state)
            choices.append(choice)
            if i == len(draft) or choice.token != draft[i]:
                break
            previous = choice.token
            history.append(choice.token)
        accepted = len(choices) - 1
        length_before = sequence.length
        self.stats.draft_tokens += len(draft)
        self.stats.accepted_draft_tokens += accepted
        sequence.computed += 1 + accepted
        Drafter.rejected(sequence, length_before, accepted)
        for choice in choices:
            self._emit(sequence, choice, None)
            if sequence not in self._running:
                return  # finished
        self._name_full_blocks(sequence)

    def _account(self, sequence: _Sequence, first: int, count: int) -> None:
        if not sequence.generated:
            self.stats.prompt_tokens += count
        else:  # a readmitted (preempted) sequence runs its earlier tokens again
            self.stats.recomputed_tokens += count - (first + count == sequence.length)

    def _name_full_blocks(self, sequence: _Sequence) -> None:
        """Name the blocks this step filled, so later prompts can reuse them."""
        if not self.blocks.prefix_caching or sequence.images is not None:
            return
        size = self.blocks.block_size
        for i in range(len(sequence.block_names), sequence.computed // size):
            parent = sequence.block_names[-1] if sequence.block_names else None
            name = block_hash(parent, sequence.tokens[i * size : (i + 1) * size])
            self.blocks.name(sequence.blocks[i], name)
            sequence.block_names.append(name)

    def _advance(
        self, logits: Tensor, sampling: list[tuple[_Sequence, int, list[float] | None]]
    ) -> None:
        """Choose the next token of every (sequence, row, prompt log-probabilities) in
        `sampling` in one call, emit them, and finish the sequences that are done."""
        states = [
            RowState(s.params, s.top_p, s.generator, s.tokens[-1], s.generated)
            for s, _, _ in sampling
        ]
        choices = choose_tokens(logits, [row for _, row, _ in sampling], states)
        for (sequence, _, prompt_logprobs), choice in zip(sampling, choices, strict=True):
            self._emit(sequence, choice, prompt_logprobs)

    def _emit(
        self, sequence: _Sequence, choice: TokenChoice, prompt_logprobs: list[float] | None
    ) -> None:
        """Append the chosen token, emit it, and finish the sequence if it is done."""
        sequence.top_p = next_top_p(sequence.top_p, sequence.params)
        sequence.tokens.append(choice.token)
        self.stats.generated_tokens += 1
        now = time.monotonic()
        if self.observe_latency is not None:
            if len(sequence.generated) == 1:
                self.observe_latency("ttft", now - sequence.submitted_at)
            else:
                self.observe_latency("itl", now - sequence.last_token_at)
        sequence.last_token_at = now
        finish = self._finish_reason(sequence, choice.token)
        sequence.emit(TokenEvent(choice=choice, prompt_logprobs=prompt_logprobs))
        if finish is not None:
            self._finish(sequence, TokenEvent(finish_reason=finish))

    def _finish_reason(self, sequence: _Sequence, token: int) -> str | None:
        params = sequence.params
        if token in params.stop_token_ids:
            return "stop"
        if params.stop_strings:
            text = self.detokenize(sequence.generated)
            if any(stop in text for stop in params.stop_strings):
                return "stop"
        if len(sequence.generated) >= params.max_new_tokens or sequence.length >= self.max_length:
            return "length"
        return None
