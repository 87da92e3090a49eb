"""Limits, auth, timeouts, slow and vanishing clients, queue overflow, continuous batching."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from mg.generate_server.engine import EngineFullError, GenerationEngine
from mg.generate_server.megatron_api import Limits
from mg.generate_server.runner import ModelRunner
from mg.generate_server.sampling import SamplingParams


def test_api_key(loaded, start_server) -> None:
    with start_server(loaded, api_key="s3cret") as running:
        body = {"prompts": ["a"], "tokens_to_generate": 1}
        r = httpx.put(running.url + "/api", json=body)
        assert r.status_code == 401 and "API key" in r.json()["message"]
        r = httpx.post(running.url + "/v1/completions", json={"prompt": "a"})
        assert r.status_code == 401 and r.json()["error"]["message"]
        assert httpx.get(running.url + "/health").status_code == 200
        ok = httpx.put(running.url + "/api", json=body, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_unhandled_error_is_a_500_with_a_message_and_counted(
    loaded, start_server, monkeypatch
) -> None:
    """A bug inside a route: a 500 naming the error, the server stays up, /metrics counts
    it under its route; a streamed completion passes through the same layer untouched."""
    with start_server(loaded) as running:
        monkeypatch.setattr(
            type(running.engine), "num_active", property(lambda self: 1 / 0), raising=True
        )
        r = httpx.get(running.url + "/health")
        assert r.status_code == 500
        assert "internal error: ZeroDivisionError" in r.json()["message"]
        monkeypatch.undo()
        body = {"prompt": "a", "max_tokens": 3, "stream": True}
        with httpx.stream("POST", running.url + "/v1/completions", json=body) as streamed:
            events = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert streamed.status_code == 200 and events[-1] == "data: [DONE]" and len(events) >= 4
        metrics = httpx.get(running.url + "/metrics").text
        assert 'mg_serve_requests_total{endpoint="/health",status="500"} 1.0' in metrics
        assert 'mg_serve_requests_total{endpoint="/v1/completions",status="200"} 1.0' in metrics


def test_body_size_and_token_limits(loaded, start_server) -> None:
    limits = Limits(64, max_tokens_to_oom=100, max_tokens_to_generate=8)
    with start_server(loaded, max_request_bytes=2000, limits=limits) as running:
        big = {"prompts": ["word " * 1000]}
        r = httpx.put(running.url + "/api", json=big)
        assert r.status_code == 413 and "larger than 2000 bytes" in r.json()["message"]

        def chunks():
            for _ in range(10):
                yield b" " * 500

        r = httpx.put(running.url + "/api", content=chunks())  # no Content-Length
        assert r.status_code == 413
        r = httpx.put(running.url + "/api", json={"prompts": ["a"], "tokens_to_generate": 9})
        assert r.json()["message"] == "tokens_to_generate must be at most 8 on this server"
        r = httpx.put(
            running.url + "/api", json={"prompts": ["a b c"] * 20, "tokens_to_generate": 4}
        )
        assert r.json()["message"] == "Too many tokens.  140 is greater than 100"
        r = httpx.post(running.url + "/v1/completions", json={"prompt": "a", "max_tokens": 9})
        assert r.status_code == 400 and "at most 8" in r.json()["error"]["message"]


def test_timeout_is_504_and_frees_the_slot(loaded, start_server) -> None:
    with start_server(loaded, slots=1, request_timeout=0.05) as running:
        body = {"prompts": ["a"], "tokens_to_generate": 60}
        r = httpx.put(running.url + "/api", json=body, timeout=30)
        assert r.status_code == 504 and "--request-timeout" in r.json()["message"]
        deadline = time.monotonic() + 10
        while running.engine.num_active and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running.engine.num_active == 0


def test_slow_and_vanishing_stream_clients_do_not_stall_others(server) -> None:
    """A client that opens a stream and never reads, and one that hangs up mid-stream, while
    others get complete answers."""
    host, port = server.url.removeprefix("http://").split(":")
    body = b'{"prompt": "x", "max_tokens": 40, "stream": true}'
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    stalled = socket.create_connection((host, int(port)))
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    stalled.sendall(request)  # ...and never read
    gone = socket.create_connection((host, int(port)))
    gone.sendall(request)
    gone.recv(100)
    gone.close()
    results = []

    def ask() -> None:
        r = httpx.put(
            server.url + "/api", json={"prompts": ["y"], "tokens_to_generate": 10}, timeout=60
        )
        results.append(r.status_code)

    threads = [threading.Thread(target=ask) for _ in range(4)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 4
    assert time.monotonic() - started < 60
    stalled.close()
    deadline = time.monotonic() + 20
    while server.engine.num_active and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.engine.num_active == 0


def test_requests_join_between_decode_steps(loaded) -> None:
    """Continuous batching: 4 requests of 12 tokens in 4 slots take far fewer model steps
    than 4 × 12, and a request arriving mid-way joins the running batch."""
    engine = GenerationEngine(ModelRunner(loaded.model, 4, 64), loaded.tokenizer.detokenize, 50257)
    try:
        done = threading.Event()
        finished = []

        def emit(event) -> None:
            if event.finish_reason:
                finished.append(event.finish_reason)
                if len(finished) == 4:
                    done.set()

        params = SamplingParams(max_new_tokens=12, greedy=True)
        for _ in range(3):
            engine.submit([1, 2, 3], params, emit)
        while engine.stats.generated_tokens < 12:
            time.sleep(0.001)
        engine.submit([4, 5], params, emit)
        assert done.wait(60)
        assert finished == ["length"] * 4
        assert engine.stats.generated_tokens == 48
        assert engine.stats.steps < 30  # one sequence at a time would need 48
    finally:
        engine.shutdown()


def test_queue_full_and_length_checks(loaded) -> None:
    engine = GenerationEngine(
        ModelRunner(loaded.model, 1, 64), loaded.tokenizer.detokenize, 50257, max_waiting=1
    )
    try:
        long = SamplingParams(max_new_tokens=50, greedy=True)
        handles = [engine.submit([1], long, lambda e: None)]
        time.sleep(0.2)
        handles.append(engine.submit([1], long, lambda e: None))
        with pytest.raises(EngineFullError, match="already waiting"):
            engine.submit([1], long, lambda e: None)
        with pytest.raises(ValueError, match="exceeds the 64 positions"):
            engine.submit([1] * 20, long, lambda e: None)
        for handle in handles:
            handle.cancel()
    finally:
        engine.shutdown()


def test_same_seed_same_tokens_while_batched(loaded) -> None:
    engine = GenerationEngine(ModelRunner(loaded.model, 4, 64), loaded.tokenizer.detokenize, 50257)
    try:
        params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=5)
        alone = [e.choice.token for e in engine.generate([7, 8, 9], params) if e.choice]
        other = SamplingParams(max_new_tokens=10, seed=99)
        engine.submit([3, 4], other, lambda e: None)
        batched = [e.choice.token for e in engine.generate([7, 8, 9], params) if e.choice]
        assert alone == batched
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/api", {"prompts": ["Hello"], "tokens_to_generate": 8}),
        ("/v1/completions", {"model": "m", "prompt": "Hello", "max_tokens": 8}),
    ],
)
def test_a_client_that_hangs_up_cancels_its_request(
    loaded, start_server, monkeypatch, path, body
) -> None:
    """Non-streaming requests of both APIs: when the client closes the connection before the
    answer, the server cancels the generation (its sequences leave the engine)."""
    import asyncio
    import threading

    import httpx

    from mg.generate_server import app as app_module
    from mg.generate_server import openai_api

    started, cancelled = threading.Event(), threading.Event()

    async def never_done(*args, **kwargs):
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    monkeypatch.setattr(app_module, "collect", never_done)
    monkeypatch.setattr(openai_api, "collect", never_done)
    with start_server(loaded) as running:
        with pytest.raises(httpx.ReadTimeout):
            httpx.request(
                "PUT" if path == "/api" else "POST",
                running.url + path,
                json=body,
                timeout=httpx.Timeout(10, read=1.0),
            )
        assert started.is_set()
        assert cancelled.wait(10), "the generation kept running after the client hung up"


def test_a_slow_body_times_out_with_408(loaded, start_server) -> None:
    """A client that announces a body and sends it too slowly holds no worker for long."""
    import socket
    from urllib.parse import urlparse

    with start_server(loaded, request_body_timeout=1.0) as running:
        url = urlparse(running.url)
        with socket.create_connection((url.hostname, url.port), timeout=20) as sock:
            sock.sendall(
                b"PUT /api HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n" + b'{"prompts": '
            )
            reply = b""
            while b"within" not in reply and (chunk := sock.recv(4096)):
                reply += chunk  # headers and body may come in separate segments
            reply = reply.decode()
        assert reply.startswith("HTTP/1.1 408"), reply
        assert "request body not received within 1 s" in reply
