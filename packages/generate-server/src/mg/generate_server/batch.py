"""Offline batch generation over the engine: submit every prompt at once, wait for all.

The HTTP APIs stream events as they come; a script (an evaluation, a parity
check, a dataset of completions) wants the whole list back, generated in one
continuous batch as concurrent clients would be.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from mg.generate_server.engine import GenerationEngine, TokenEvent
from mg.generate_server.sampling import SamplingParams


@dataclass
class BatchResult:
    """One prompt's generated token ids and why it ended ("stop", "length", ...)."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


def generate_batch(
    engine: GenerationEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    timeout: float = 120.0,
) -> list[BatchResult]:
    """Each prompt's result, in order; TimeoutError when they are not all done in time."""
    results = [BatchResult() for _ in prompts]
    done = threading.Semaphore(0)
    for result, prompt in zip(results, prompts, strict=True):

        def emit(event: TokenEvent, result: BatchResult = result) -> None:
            if event.choice is not None:
                result.tokens.append(event.choice.token)
            if event.finish_reason is not None:
                result.finish_reason, result.error = event.finish_reason, event.error
                done.release()

        engine.submit(prompt, params, emit)
    for _ in prompts:
        if not done.acquire(timeout=timeout):
            raise TimeoutError(f"{len(prompts)} prompts not all generated within {timeout} s")
    return results
