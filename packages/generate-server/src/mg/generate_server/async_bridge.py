"""From the engine thread to asyncio: one request's events as an async iterator, with a deadline.

The engine's callback only schedules `queue.put_nowait` on the event loop, so
a slow HTTP client (or a full socket buffer) never blocks the engine; a
client that goes away, or a request past its deadline, is cancelled and its
cache slot freed at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mg.generate_server.engine import GenerationEngine, TokenEvent
from mg.generate_server.sampling import SamplingParams

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
    """A submitted request whose events are read with `async for`."""

    def __init__(
        self,
        engine: GenerationEngine,
        prompt: list[int],
        params: SamplingParams,
        timeout: float | None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self._deadline = None if timeout is None else time.monotonic() + timeout

        def emit(event: TokenEvent) -> None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(self._queue.put_nowait, event)

        self.handle = engine.submit(prompt, params, emit)

    async def events(self) -> AsyncIterator[TokenEvent]:
        """Token events until the finishing one (included); cancels the request if
        the reader stops early, raises GenerationTimeout past the deadline."""
        finished = False
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
                    finished = True
                    raise GenerationFailed(event.error or "generation failed")
                if event.finish_reason is not None:
                    finished = True
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self.handle.cancel()


async def complete(
    engine: GenerationEngine, prompt: list[int], params: SamplingParams, timeout: float | None
) -> Completion:
    """Run one prompt to the end and gather its tokens and log-probabilities."""
    result = Completion(prompt=list(prompt))
    async for event in AsyncGeneration(engine, prompt, params, timeout).events():
        result.add(event)
    return result
