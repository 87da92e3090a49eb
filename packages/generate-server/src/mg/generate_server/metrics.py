"""Prometheus metrics of one server: requests, latency, tokens, batch occupancy, KV cache.

Per request: time to first token and inter-token latency (histograms). Engine:
tokens prompted / cached / recomputed / generated, steps, preemptions, recent
tokens per second, KV-cache blocks in use and kept for prefix reuse.

Each app gets its own registry (several servers in one process, as in tests,
do not collide); `GET /metrics` renders it in the text exposition format.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from mg.generate_server.engine import GenerationEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Token and step counters read from the engine when scraped (no hot-path locking)."""

    def __init__(self, engine: GenerationEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        stats = engine.stats
        for name, doc, value in (
            ("mg_serve_prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens),
            (
                "mg_serve_prefix_cache_hit_tokens",
                "Prompt tokens taken from the prefix cache instead of computed.",
                stats.cached_prompt_tokens,
            ),
            (
                "mg_serve_recomputed_tokens",
                "Tokens computed again after a preemption.",
                stats.recomputed_tokens,
            ),
            ("mg_serve_generated_tokens", "Tokens generated.", stats.generated_tokens),
            ("mg_serve_engine_steps", "Model forwards run by the engine.", stats.steps),
            ("mg_serve_sequences_finished", "Sequences finished.", stats.finished),
            (
                "mg_serve_preemptions",
                "Sequences preempted (blocks released, recomputed later) for lack of KV cache.",
                stats.preemptions,
            ),
            (
                "mg_serve_spec_decode_draft_tokens",
                "Draft-model tokens checked by the served model (speculative decoding).",
                stats.draft_tokens,
            ),
            (
                "mg_serve_spec_decode_accepted_tokens",
                "Draft-model tokens the served model agreed with and kept.",
                stats.accepted_draft_tokens,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        blocks = engine.blocks
        for name, doc, value in (
            (
                "mg_serve_generation_tokens_per_second",
                "Tokens generated per second over the last 10 s.",
                stats.tokens_per_second(),
            ),
            ("mg_serve_kv_cache_blocks", "Blocks in the KV-cache pool.", blocks.num_blocks),
            ("mg_serve_kv_cache_block_size", "Positions per KV-cache block.", blocks.block_size),
            ("mg_serve_kv_cache_used_blocks", "Blocks held by running sequences.", blocks.num_used),
            (
                "mg_serve_kv_cache_cached_blocks",
                "Unheld blocks kept for prefix reuse (taken back first when the pool runs out).",
                blocks.num_cached,
            ),
            (
                "mg_serve_kv_cache_usage",
                "Fraction of the KV-cache pool held by running sequences.",
                blocks.num_used / blocks.num_blocks,
            ),
        ):
            yield GaugeMetricFamily(name, doc, value=value)


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


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
        ttft = Histogram(
            "mg_serve_time_to_first_token_seconds",
            "From a request's arrival to its first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        itl = Histogram(
            "mg_serve_inter_token_latency_seconds",
            "Between consecutive generated tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        histograms = {"ttft": ttft, "itl": itl}
        engine.observe_latency = lambda kind, seconds: histograms[kind].observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
