"""Joining (or starting) the Ray cluster that every `--engine ray` command runs on.

One place for what `tokenize`, `clean` and `dedup` share: `--ray-address` is
checked before Ray is asked to join it (an address where nothing listens is a
one-line error within `--ray-connect-timeout` seconds, not a hang in Ray's
reconnect loop), a Ray that cannot start is one line too, and a session that
this command started is shut down when it ends.

`ray` is imported here only inside functions, and this module only by a command
that runs with `--engine ray`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import socket
import threading
from collections.abc import Iterator
from typing import Any

from mg.corpus_prep.engine_flags import RayAddressError, host_and_port
from mg.corpus_prep.reader import Segment

AGENT_WAIT_MS = 180_000  # a loaded machine starts Ray's agents slowly: wait longer than Ray
DEFAULT_CONNECT_TIMEOUT = 30.0


class RayConnectError(Exception):
    """The cluster could not be joined or started; the message is the user's one line."""


def first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def probe(address: str, timeout: float) -> None:
    """Fail at once, in one line, when nothing accepts connections at `address`."""
    try:
        target = host_and_port(address)
    except RayAddressError as err:
        raise RayConnectError(str(err)) from None
    if target is None:
        return
    try:
        with socket.create_connection(target, timeout=timeout):
            pass
    except OSError as err:
        why = "timed out" if isinstance(err, TimeoutError) else (err.strerror or str(err))
        raise RayConnectError(
            f"--ray-address {address}: no Ray cluster answers there ({why}); start one with "
            "`ray start --head` and pass the address it prints"
        ) from None


def _init(ray: Any, address: str | None, timeout: float) -> None:
    """`ray.init`, bounded by `timeout` seconds when joining an address (Ray may retry long)."""
    options = {"address": address, "include_dashboard": False, "log_to_driver": False}
    if address is None:  # starting a local instance: its agents may take long to register
        ray.init(**options)
        return
    # Joining: Ray's own start-up chatter (and its retry warnings) would bury our one line.
    os.environ.setdefault("RAY_BACKEND_LOG_LEVEL", "error")
    options["logging_level"] = logging.ERROR
    outcome: list[BaseException | None] = []

    def connect() -> None:
        try:
            ray.init(**options)
            outcome.append(None)
        except BaseException as err:  # noqa: BLE001 -- handed to the caller's thread
            outcome.append(err)

    thread = threading.Thread(target=connect, name="ray-connect", daemon=True)
    thread.start()
    thread.join(timeout)
    if not outcome:
        raise RayConnectError(
            f"--ray-address {address}: no Ray cluster answered within {timeout:g} s "
            "(--ray-connect-timeout); check that `ray start --head` runs there"
        )
    if outcome[0] is not None:
        raise outcome[0]


@contextlib.contextmanager
def ray_session(address: str | None, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Iterator[Any]:
    """The `ray` module, joined to `address` (or a local instance) for the block.

    A session already open in this process (a test's cluster) is used as it is
    and left open; one started here is shut down at the end.
    """
    import ray  # lazy: an optional dependency, imported only for --engine ray

    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_agent_register_timeout_ms", str(AGENT_WAIT_MS))
        if address is not None:
            probe(address, timeout)
        try:
            _init(ray, address, timeout)
        except RayConnectError:
            raise
        except Exception as err:  # Ray raises plain Exception, ConnectionError, RuntimeError
            where = f"join the Ray cluster at {address}" if address else "start a local instance"
            flag = f"--ray-address {address}" if address else "--engine ray"
            raise RayConnectError(f"{flag}: could not {where} ({first_line(err)})") from err
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


# A shard's `.done` record: a rerun reuses a shard only if the fingerprint of what decides
# its bytes (its segments, the inputs' modification times, the settings) is the same.


def fingerprint(segments: list[Segment], *settings: object) -> str:
    """What decides a shard's output: an input file changed since, even at the same size,
    changes it."""
    changed = [os.stat(segment.source.name).st_mtime_ns for segment in segments]
    return hashlib.sha256(pickle.dumps([segments, changed, *settings])).hexdigest()


def load_done(done_path: str, expected: str, files: list[str]) -> Any | None:
    """The payload of a shard completed with the `expected` fingerprint whose `files` all
    exist; else None."""
    try:
        with open(done_path, "rb") as stream:
            record = pickle.load(stream)
    except (OSError, pickle.UnpicklingError, EOFError):
        return None
    if record.get("fingerprint") != expected or not all(map(os.path.exists, files)):
        return None
    return record["stats"]


def save_done(done_path: str, expected: str, payload: object) -> None:
    """Publish the `.done` record atomically (written last, after the shard's files)."""
    temporary = done_path + ".tmp"
    with open(temporary, "wb") as stream:
        pickle.dump({"fingerprint": expected, "stats": payload}, stream)
    os.replace(temporary, done_path)
