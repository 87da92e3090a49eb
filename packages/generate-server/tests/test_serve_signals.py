"""A SIGTERM that comes after "listening on" but before uvicorn has installed its own
handlers (a slow start on a loaded machine) still stops the server: it was swallowed, and
the server ran on until killed."""

from __future__ import annotations

import signal
import socket
import threading
import time

import uvicorn

from mg.generate_server.cli import _stop_on_signals


async def _app(scope, receive, send) -> None:  # the smallest ASGI app uvicorn accepts
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})


def test_a_signal_before_uvicorn_starts_stops_the_server() -> None:
    server = uvicorn.Server(uvicorn.Config(_app, log_level="error"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    watchdog = threading.Timer(30, lambda: setattr(server, "should_exit", True))
    watchdog.start()
    before = signal.getsignal(signal.SIGTERM)
    try:
        start = time.monotonic()
        with _stop_on_signals(server):
            signal.raise_signal(signal.SIGTERM)  # before uvicorn's handlers exist
            server.run(sockets=[sock])
        elapsed = time.monotonic() - start
    finally:
        watchdog.cancel()
        sock.close()
    assert elapsed < 20, f"the server ran {elapsed:.0f} s after SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_signal_while_serving_stops_the_server_and_returns() -> None:
    server = uvicorn.Server(uvicorn.Config(_app, log_level="error"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()

    def terminate_once_started() -> None:
        while not server.started:
            time.sleep(0.01)
        signal.raise_signal(signal.SIGTERM)  # uvicorn's handler, then ours on its re-raise

    sender = threading.Thread(target=terminate_once_started, daemon=True)
    sender.start()
    with _stop_on_signals(server):
        server.run(sockets=[sock])  # returns: the process is not killed by the re-raise
    sock.close()
    assert server.should_exit
