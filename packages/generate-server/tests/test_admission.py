"""Admission before the answer: a streamed request is queued (or refused with a 503) before
its status line is sent, and a 200 stream always ends properly (`data: [DONE]`)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from mg.generate_server.chat import ChatTemplate

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
CHAT = ChatTemplate(TEMPLATE, bos_token="<|endoftext|>", eos_token="<|endoftext|>")


async def _stream(client: httpx.AsyncClient, url: str, body: dict) -> tuple[int, dict, str]:
    """(status, headers, whole body) of one request; an incomplete body raises."""
    async with client.stream("POST", url, json=body) as response:
        text = (await response.aread()).decode()
        return response.status_code, dict(response.headers), text


async def _many(url: str, bodies: list[tuple[str, dict]]) -> list[tuple[int, dict, str] | str]:
    """Every request at once; a transport failure (truncated body) comes back as its text."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        results = await asyncio.gather(
            *(_stream(client, path, body) for path, body in bodies), return_exceptions=True
        )
    return [r if isinstance(r, tuple) else f"{type(r).__name__}: {r}" for r in results]


def _complete_stream(text: str) -> bool:
    events = [e for e in text.split("\n\n") if e]
    if not events or events[-1] != "data: [DONE]":
        return False
    finishes = [
        choice.get("finish_reason")
        for e in events[:-1]
        for choice in json.loads(e.removeprefix("data: ")).get("choices", [])
    ]
    return any(f is not None for f in finishes)


def _check_all(results: list) -> tuple[int, int]:
    """Each answer a 503 with a JSON error and Retry-After, or a complete 200 stream;
    (how many of each)."""
    refused = streamed = 0
    for result in results:
        assert isinstance(result, tuple), result  # a truncated body
        status, headers, text = result
        if status == 503:
            assert headers.get("retry-after", "").isdigit(), headers
            error = json.loads(text)["error"]
            assert "waiting" in error["message"] and error["type"] == "server_error"
            refused += 1
        else:
            assert status == 200, (status, text)
            assert _complete_stream(text), text[-300:]
            streamed += 1
    return refused, streamed


def test_a_full_queue_refuses_streams_with_503_before_any_200(loaded, start_server) -> None:
    completion = {"prompt": "The school", "max_tokens": 24, "temperature": 0, "stream": True}
    chat = {
        "messages": [{"role": "user", "content": "Hello"}],
        "max_tokens": 24,
        "stream": True,
        "n": 2,
    }
    bodies = [("/v1/completions", completion)] * 6 + [("/v1/chat/completions", chat)] * 6
    with start_server(loaded, slots=1, max_waiting=1, chat_template=CHAT) as running:
        results = asyncio.run(_many(running.url, bodies))
        refused, streamed = _check_all(results)
        assert refused >= 1 and streamed >= 1 and refused + streamed == len(bodies)
        r = httpx.get(running.url + "/health").json()
        assert r["waiting"] == 0  # nothing admitted was left behind


def test_a_full_queue_refuses_megatron_api_with_503(loaded, start_server) -> None:
    body = {"prompts": ["The school", "Hello", "Good"], "tokens_to_generate": 24}

    async def put_all(url: str) -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.put("/api", json=body) for _ in range(6)))

    with start_server(loaded, slots=1, max_waiting=2) as running:
        responses = asyncio.run(put_all(running.url))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 503}, statuses
    for r in responses:
        if r.status_code == 503:
            assert "waiting" in r.json()["message"] and r.headers["retry-after"].isdigit()
        else:
            assert len(r.json()["text"]) == 3


def test_an_error_after_the_status_line_ends_the_stream_with_an_error_event(
    loaded, start_server, monkeypatch
) -> None:
    from mg.generate_server import openai_api

    def broken(*args, **kwargs):
        raise RuntimeError("detokenizer exploded")

    monkeypatch.setattr(openai_api, "_last_only", broken)
    body = {"prompt": "Hi", "max_tokens": 4, "stream": True, "logprobs": 1}
    with (
        start_server(loaded) as running,
        httpx.stream("POST", running.url + "/v1/completions", json=body, timeout=60) as response,
    ):
        text = response.read().decode()
    assert response.status_code == 200
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "detokenizer exploded" in error["message"] and error["type"] == "server_error"


@pytest.mark.slow
def test_100_concurrent_streams_all_complete(loaded, start_server) -> None:
    body = {"prompt": "The school", "max_tokens": 8, "temperature": 0.7, "stream": True}
    with start_server(loaded, slots=8, max_waiting=128) as running:
        results = asyncio.run(_many(running.url, [("/v1/completions", body)] * 100))
    refused, streamed = _check_all(results)
    assert (refused, streamed) == (0, 100)


def test_a_request_is_queued_whole_or_not_at_all(loaded) -> None:
    from mg.generate_server.engine import EngineFullError, GenerationEngine
    from mg.generate_server.runner import ModelRunner
    from mg.generate_server.sampling import SamplingParams

    engine = GenerationEngine(
        ModelRunner(loaded.model, 1, 64), loaded.tokenizer.detokenize, 50257, max_waiting=2
    )
    long = SamplingParams(max_new_tokens=50, greedy=True)

    def quiet(event) -> None:
        pass

    try:
        handles = engine.submit_many([([1], long, quiet)])
        deadline = time.monotonic() + 30
        while engine.num_active == 0:  # the first runs; the rest wait behind it
            assert time.monotonic() < deadline
            time.sleep(0.01)
        handles += engine.submit_many([([2], long, quiet)])
        with pytest.raises(EngineFullError, match="1 requests are already waiting"):
            engine.submit_many([([3], long, quiet), ([4], long, quiet)])
        assert engine.num_waiting == 1  # neither of the refused pair was queued
        for handle in handles:
            handle.cancel()
        while engine.num_active or engine.num_waiting:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # a request larger than the whole queue is taken when the queue is empty
        handles = engine.submit_many([([5 + i], long, quiet) for i in range(3)])
        assert len(handles) == 3
        for handle in handles:
            handle.cancel()
    finally:
        engine.shutdown()
