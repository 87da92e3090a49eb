"""The fixture fetcher against a local PEP 691 index serving a fake artifact."""

from __future__ import annotations

import hashlib
import http.server
import io
import json
import re
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from mg.core import fixtures
from mg.core.fixtures import FIXTURES, Fixture, FixtureError

PAYLOAD = b"hello fixture\n"


def _wheel_bytes() -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("demo/data/hello.txt", PAYLOAD)
    return buffer.getvalue()


@pytest.fixture()
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict]:
    wheel = _wheel_bytes()
    requests: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            requests.append(self.path)
            if self.path == "/simple/demo-pkg/":
                port = self.server.server_address[1]
                body = json.dumps(
                    {
                        "files": [
                            {
                                "filename": "demo_pkg-1.0-py3-none-any.whl",
                                "url": f"http://127.0.0.1:{port}/files/demo.whl",
                                "hashes": {"sha256": hashlib.sha256(wheel).hexdigest()},
                            }
                        ]
                    }
                ).encode()
            elif self.path == "/files/demo.whl":
                body = wheel
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    monkeypatch.setenv("MG_PYPI_SIMPLE_URL", f"http://127.0.0.1:{server.server_address[1]}/simple")
    monkeypatch.setenv("MG_FIXTURES_DIR", str(tmp_path / "cache"))
    yield {"requests": requests, "server": server}
    server.shutdown()


def _register(monkeypatch: pytest.MonkeyPatch, sha: str) -> None:
    fixture = Fixture(
        "demo",
        "demo-pkg",
        "1.0",
        "demo_pkg-1.0-py3-none-any.whl",
        {"hello.txt": ("demo/data/hello.txt", sha)},
    )
    monkeypatch.setitem(FIXTURES, "demo", fixture)


def test_fetch_verifies_and_caches(local_index: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    _register(monkeypatch, hashlib.sha256(PAYLOAD).hexdigest())
    path = fixtures.fixture_path("demo", "hello.txt")
    assert path.read_bytes() == PAYLOAD
    assert len(local_index["requests"]) == 2
    local_index["server"].shutdown()
    # Cached: no network needed the second time.
    assert fixtures.fixture_path("demo", "hello.txt") == path
    assert len(local_index["requests"]) == 2


def test_checksum_mismatch_is_refused_and_leaves_nothing(
    local_index: dict, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _register(monkeypatch, "0" * 64)
    with pytest.raises(FixtureError, match="hello.txt has sha256"):
        fixtures.fixture_dir("demo")
    assert not (tmp_path / "cache" / "demo").exists()
    assert list((tmp_path / "cache").iterdir()) == []


def test_unknown_names_are_explained() -> None:
    with pytest.raises(FixtureError, match="unknown fixture 'nope'; known fixtures: gpt2-bpe"):
        fixtures.fixture_dir("nope")
    with pytest.raises(FixtureError, match="has no file 'x.txt'; it has: vocab.json, merges.txt"):
        fixtures.fixture_path("gpt2-bpe", "x.txt")


def test_every_registered_file_has_a_checksum() -> None:
    for fixture in FIXTURES.values():
        for local, (member, sha) in fixture.files.items():
            assert re.fullmatch(r"[0-9a-f]{64}", sha), (fixture.name, local)
            assert member and local
