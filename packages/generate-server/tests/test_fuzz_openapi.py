"""Fuzzing the server against its own OpenAPI document (schemathesis): generated bodies for
every operation, valid and invalid; no answer may be a 5xx, and the server keeps serving."""

from __future__ import annotations

import httpx
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode


def test_fuzz_every_operation_no_server_errors(server) -> None:
    spec = httpx.get(server.url + "/openapi.json").json()
    schema = schemathesis.openapi.from_dict(spec)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/api", "/v1/completions", "/health"}
    failures: list[str] = []
    statuses: set[int] = set()
    runs = [(op, GenerationMode.POSITIVE) for op in operations]
    # invalid bodies; operations without a body have nothing to make invalid
    runs += [(op, GenerationMode.NEGATIVE) for op in operations if op.method in ("put", "post")]
    for operation, mode in runs:

        @settings(
            max_examples=30,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def fuzz(case) -> None:
            response = case.call(base_url=server.url, timeout=60)
            statuses.add(response.status_code)
            if response.status_code >= 500:
                failures.append(f"{case.method} {case.path} {case.body!r}: {response.text}")

        fuzz()
    assert not failures, "\n".join(failures[:5])
    assert {200, 400} <= statuses  # both valid and invalid requests were made
    r = httpx.put(server.url + "/api", json={"prompts": ["ok"], "tokens_to_generate": 2})
    assert r.status_code == 200
