"""Prometheus metrics of one server: requests, latency, tokens, batch occupancy.

Each app gets its own registry (several servers in one process, as in tests,
do not collide); `GET /metrics` renders it in the text exposition format.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from mg.generate_server.engine import GenerationEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Token and step counters read from the engine when scraped (no hot-path locking)."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats
        for name, doc, value in (
            ("mg_serve_prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens),
            ("mg_serve_generated_tokens", "Tokens generated.", stats.generated_tokens),
            ("mg_serve_engine_steps", "Model forwards run by the engine.", stats.steps),
            ("mg_serve_sequences_finished", "Sequences finished.", stats.finished),
        ):
            yield CounterMetricFamily(name, doc, value=value)


class ServerMetrics:
    def __init__(self, engine: GenerationEngine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "mg_serve_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "mg_serve_request_seconds",
            "Time to the response (headers, for streams).",
            ["endpoint"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        active = Gauge(
            "mg_serve_active_sequences", "Sequences in the batch.", registry=self.registry
        )
        active.set_function(lambda: engine.num_active)
        waiting = Gauge(
            "mg_serve_waiting_requests", "Requests waiting for a slot.", registry=self.registry
        )
        waiting.set_function(lambda: engine.num_waiting)
        self.registry.register(_EngineCollector(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
