"""From the engine thread to asyncio: one request's events as an async iterator, with a deadline.

A client request's sequences are admitted (`submit_all`) before its answer
starts, all or none: a full queue is a 503, never a 200 stream that stops.
The engine's callback only schedules `queue.put_nowait` on the event loop, so
a slow HTTP client (or a full socket buffer) never blocks the engine; a
client that goes away, or a request past its deadline, is cancelled and its
cache slot freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mg.generate_server.engine import GenerationEngine, RequestHandle, TokenEvent
from mg.generate_server.errors import ApiError
from mg.generate_server.sampling import SamplingParams
from mg.generate_server.vision_prefill import ImageRows

T = TypeVar("T")

DISCONNECT_POLL_SECONDS = 0.25


class ClientGone(Exception):
    """The client closed its connection before its (non-streaming) answer was ready."""


async def unless_disconnected(request: Any, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone once the client has hung up: a non-streaming request
    is cancelled then (its sequences leave the engine and free their blocks), as a
    stream is when its reader goes away. `request`: Starlette's; the app's body-limit
    middleware puts the hang-up event in its scope ("mg.client_gone")."""
    task = asyncio.ensure_future(work)
    gone = request.scope.get("mg.client_gone")
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                return task.result()
            if gone is not None and gone.is_set():
                raise ClientGone
    finally:
        task.cancel()


class GenerationTimeout(Exception):
    """The request ran past --request-timeout and was cancelled."""


class GenerationFailed(Exception):
    """The engine failed this request (the message says why)."""


@dataclass
class Completion:
    """Everything one prompt produced."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    """Each token's log-probability; None where the request did not ask for them."""
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    finish_reason: str = "length"

    def add(self, event: TokenEvent) -> None:
        """Take in one engine event."""
        if event.prompt_logprobs is not None:
            self.prompt_logprobs = event.prompt_logprobs
        if event.choice is not None:
            self.tokens.append(event.choice.token)
            self.logprobs.append(event.choice.logprob)
            self.top_logprobs.append(event.choice.top)
        if event.finish_reason is not None:
            self.finish_reason = event.finish_reason


class AsyncGeneration:
    """One admitted sequence whose events are read with `async for` (`submit_all` makes them)."""

    def __init__(self, prompt: list[int], timeout: float | None) -> None:
        self.prompt = list(prompt)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self.handle: RequestHandle | None = None
        self.finished = False

    def emit(self, event: TokenEvent) -> None:
        """The engine's callback (its thread): hand the event to the event loop."""
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    def cancel(self) -> None:
        """Take the sequence out of the engine unless it has finished (harmless twice)."""
        if not self.finished and self.handle is not None:
            self.handle.cancel()

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Token events until the finishing one (included); cancels the request if
        the reader stops early, raises GenerationTimeout past the deadline."""
        try:
            while True:
                remaining = None if self._deadline is None else self._deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise GenerationTimeout
                try:
                    event = await asyncio.wait_for(self._queue.get(), remaining)
                except asyncio.TimeoutError:
                    raise GenerationTimeout from None
                if event.finish_reason == "error":
                    self.finished = True
                    raise GenerationFailed(event.error or "generation failed")
                if event.finish_reason is not None:
                    self.finished = True
                yield event
                if self.finished:
                    return
        finally:
            self.cancel()


def submit_all(
    engine: GenerationEngine,
    requests: Sequence[tuple[list[int], SamplingParams]],
    timeout: float | None,
    images: Sequence[ImageRows | None] | None = None,
) -> list[AsyncGeneration]:
    """Admit a client request's sequences into the engine, all or none, before anything is
    answered: EngineFullError (a 503) on a full queue, ApiError (a 400) for a sequence
    the server can never hold. A caller cancels the generations it stops reading.
    `images`: each sequence's image rows (a vision-language model), None for text only."""
    generations = [AsyncGeneration(prompt, timeout) for prompt, _ in requests]
    pairs = zip(generations, requests, strict=True)
    try:
        work = [(g.prompt, params, g.emit) for g, (_, params) in pairs]
        handles = engine.submit_many(work, images) if images else engine.submit_many(work)
    except ValueError as exc:
        raise ApiError(str(exc)) from None
    for generation, handle in zip(generations, handles, strict=True):
        generation.handle = handle
    return generations


def cancel_all(generations: Sequence[AsyncGeneration]) -> None:
    """Free the engine of every sequence not finished (the client went, or an error)."""
    for generation in generations:
        generation.cancel()


async def collect(generation: AsyncGeneration) -> Completion:
    """Run one admitted sequence to the end and gather its tokens and log-probabilities."""
    result = Completion(prompt=generation.prompt)
    async for event in generation.events():
        result.add(event)
    return result


async def complete(
    engine: GenerationEngine, prompt: list[int], params: SamplingParams, timeout: float | None
) -> Completion:
    """Admit one prompt, run it to the end and gather its tokens and log-probabilities."""
    return await collect(submit_all(engine, [(prompt, params)], timeout)[0])
