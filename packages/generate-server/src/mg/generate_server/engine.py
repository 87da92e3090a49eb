"""The generation engine: continuous batching over a slot-based KV cache, in one thread.

Requests arrive from any thread (`submit`). The engine thread loops:

1. admit waiting requests into free cache slots and prefill their prompts
   together (right-padded, one forward), sampling each one's first token;
2. run one decode step for every active sequence at once, each at its own
   position, and sample each one's next token;
3. hand every token to its request's callback; finished or cancelled
   sequences free their slot at once, so waiting requests join before the
   next decode step.

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

from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import (
    SamplingParams,
    TokenChoice,
    choose_token,
    make_generator,
    next_top_p,
)


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


@dataclass
class _Sequence:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    emit: Callable[[TokenEvent], None]
    generator: torch.Generator
    top_p: float
    generated: list[int] = field(default_factory=list)
    slot: int = -1
    cancelled: bool = False
    submitted_at: float = field(default_factory=time.monotonic)

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.generated)


class RequestHandle:
    """What `submit` returns: cancel() frees the request's slot at the next step."""

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
    generated_tokens: int = 0
    finished: int = 0
    steps: int = 0


class GenerationEngine:
    """Continuous-batching generation over a `ModelRunner` (see the module docstring)."""

    def __init__(
        self,
        runner: ModelRunner,
        detokenize: Callable[[Sequence[int]], str],
        vocab_size: int,
        max_waiting: int = 256,
        max_prefill_tokens: int = 4096,
    ) -> None:
        self.runner = runner
        self.detokenize = detokenize
        self.vocab_size = vocab_size
        """Tokens at or above this id (vocabulary padding) are never produced."""
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.max_length = runner.max_length
        self.stats = EngineStats()
        self._waiting: deque[_Sequence] = deque()
        self._active: dict[int, _Sequence] = {}
        self._free_slots = list(range(runner.num_slots - 1, -1, -1))
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
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        if len(prompt) + params.max_new_tokens > self.max_length:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + tokens to generate ({params.max_new_tokens}) "
                f"exceeds the {self.max_length} positions this server holds per sequence"
            )
        sequence = _Sequence(
            request_id=next(self._ids),
            prompt=list(prompt),
            params=params,
            emit=emit,
            generator=make_generator(params.seed),
            top_p=params.top_p,
        )
        with self._lock:
            if self._stopping:
                raise RuntimeError("the generation engine is shut down")
            if len(self._waiting) >= self.max_waiting:
                raise EngineFullError(
                    f"{len(self._waiting)} requests are already waiting; try again shortly"
                )
            self._waiting.append(sequence)
            self._lock.notify()
        return RequestHandle(sequence, self)

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
        return len(self._active)

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
        while True:
            idle = False
            with self._lock:
                while not self._stopping and not self._waiting and not self._active:
                    if not self._lock.wait(timeout=self.runner.heartbeat_seconds):
                        idle = True
                        break
                if self._stopping:
                    break
                admitted = self._take_waiting()
            if idle:
                self.runner.heartbeat()
                continue
            self._drop_cancelled()
            if admitted:
                self._run_step(admitted, self._prefill)
            if self._active:
                self._run_step(list(self._active.values()), self._decode)
        for sequence in list(self._active.values()) + list(self._waiting):
            sequence.emit(TokenEvent(finish_reason="cancelled", error="server shutting down"))
        self.runner.close()

    def _take_waiting(self) -> list[_Sequence]:
        """Waiting requests that fit in free slots and the prefill budget (under the lock)."""
        taken: list[_Sequence] = []
        budget = self.max_prefill_tokens
        while self._waiting and self._free_slots:
            sequence = self._waiting[0]
            if sequence.cancelled:
                self._waiting.popleft()
                sequence.emit(TokenEvent(finish_reason="cancelled"))
                continue
            if taken and len(sequence.prompt) > budget:
                break
            self._waiting.popleft()
            budget -= len(sequence.prompt)
            sequence.slot = self._free_slots.pop()
            self._active[sequence.request_id] = sequence
            taken.append(sequence)
        return taken

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self._active.values() if s.cancelled]:
            self._finish(sequence, TokenEvent(finish_reason="cancelled"))

    def _finish(self, sequence: _Sequence, event: TokenEvent) -> None:
        self._active.pop(sequence.request_id, None)
        with self._lock:
            self._free_slots.append(sequence.slot)
        self.stats.finished += 1
        sequence.emit(event)

    def _run_step(
        self, sequences: list[_Sequence], step: Callable[[list[_Sequence]], None]
    ) -> None:
        try:
            step(sequences)
            self.stats.steps += 1
        except Exception as exc:  # a failed step fails its requests, never the engine
            for sequence in sequences:
                if sequence.request_id in self._active:
                    self._finish(
                        sequence,
                        TokenEvent(finish_reason="error", error=f"{type(exc).__name__}: {exc}"),
                    )

    def _prefill(self, sequences: list[_Sequence]) -> None:
        width = max(len(s.prompt) for s in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence.prompt)] = torch.tensor(sequence.prompt)
        slots = torch.tensor([s.slot for s in sequences])
        logits = self.runner.forward(ids, slots, torch.zeros(len(sequences), dtype=torch.long))
        logits = logits[..., : self.vocab_size]
        self.stats.prompt_tokens += sum(len(s.prompt) for s in sequences)
        for row, sequence in enumerate(sequences):
            n = len(sequence.prompt)
            prompt_logprobs = None
            if sequence.params.prompt_logprobs:
                logprobs = torch.log_softmax(logits[row, : n - 1], dim=-1)
                targets = torch.tensor(sequence.prompt[1:])
                prompt_logprobs = logprobs.gather(1, targets[:, None])[:, 0].tolist()
            if sequence.params.max_new_tokens == 0:
                self._finish(
                    sequence, TokenEvent(finish_reason="length", prompt_logprobs=prompt_logprobs)
                )
                continue
            self._advance(sequence, logits[row, n - 1], prompt_logprobs)

    def _decode(self, sequences: list[_Sequence]) -> None:
        live = [s for s in sequences if not s.cancelled]
        self._drop_cancelled()
        if not live:
            return
        ids = torch.tensor([[s.generated[-1]] for s in live])
        slots = torch.tensor([s.slot for s in live])
        starts = torch.tensor([s.length - 1 for s in live])
        logits = self.runner.forward(ids, slots, starts)[:, 0, : self.vocab_size]
        for row, sequence in enumerate(live):
            self._advance(sequence, logits[row], None)

    def _advance(
        self, sequence: _Sequence, logits: Tensor, prompt_logprobs: list[float] | None
    ) -> None:
        """Sample one token for `sequence`, emit it, and finish the sequence if it is done."""
        params = sequence.params
        previous = sequence.generated[-1] if sequence.generated else sequence.prompt[-1]
        choice = choose_token(
            logits,
            torch.log_softmax(logits, dim=-1),
            params,
            sequence.top_p,
            sequence.generator,
            previous,
            sequence.generated,
        )
        sequence.top_p = next_top_p(sequence.top_p, params)
        sequence.generated.append(choice.token)
        self.stats.generated_tokens += 1
        finish = self._finish_reason(sequence, choice.token)
        event = TokenEvent(choice=choice, prompt_logprobs=prompt_logprobs)
        if finish is None:
            sequence.emit(event)
            return
        sequence.emit(event)
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
