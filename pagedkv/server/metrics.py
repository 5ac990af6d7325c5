"""Prometheus metrics through prometheus_client, named as vLLM names them.

Every metric is `pagedkv:<vLLM's name>` (as SGLang does with `sglang:`) and carries a
`model_name` label, so vLLM dashboards and alerts carry over by swapping the prefix; metrics
vLLM has no name for (block states, copy-on-write, fork sharing) follow the same scheme.
Counters end in `_total`; no gauge does.

Engine-side figures are read from `engine.stats()` at scrape time (the server hands them to
`render`); request-side figures (TTFT, latency, finish reasons, refusals) are recorded by the
server as requests complete. Each server owns its registry, so several apps in one process
(tests) never share counts.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pagedkv:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# (name without prefix, EngineStats field, help); counters are exported as <name>_total
ENGINE_GAUGES = (
    ("num_requests_running", "num_running", "Requests being decoded."),
    ("num_requests_waiting", "num_waiting", "Requests waiting to be scheduled."),
    ("kv_cache_usage_perc", "kv_usage", "Fraction of KV blocks in use (1 = full)."),
    ("kv_cache_num_blocks", "num_blocks", "KV blocks in the pool."),
    ("spec_decode_acceptance_rate", "spec_decode_acceptance_rate",
     "Speculative decoding: accepted / draft tokens, since start."),
    ("prefix_cache_hit_rate", "prefix_hit_rate",
     "Prompt tokens served from the prefix cache / tokens looked up, since start."),
)
ENGINE_COUNTERS = (
    ("prefix_cache_queries", "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    ("prefix_cache_partial_hits", "prefix_cache_partial_hits",
     "Of the prefix cache hits: tokens copied from the leading part of a cached block."),
    ("num_preemptions", "num_preemptions", "Requests preempted (blocks freed, recomputed later)."),
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens processed."),
    ("generation_tokens", "generation_tokens_total", "Tokens generated."),
    ("engine_requests_finished", "num_requests_finished", "Requests the engine finished."),
    ("kv_cache_evictions", "evictions",
     "Cached prefix blocks evicted (reused for new data, LRU)."),
    ("kv_cache_cow_copies", "cow_copies", "Copy-on-write block copies (a shared block written)."),
    ("kv_cache_fork_shared_blocks", "fork_shared_blocks",
     "Blocks n > 1 samples shared with their parent instead of copying."),
    ("kv_cache_fork_saved_bytes", "fork_saved_bytes", "KV memory that fork sharing saved."),
    ("prefix_dedup_requests_held", "dedup_requests_held",
     "Requests held until a prefix another prefill was computing was cached."),
    ("prefix_dedup_tokens_saved", "dedup_tokens_saved",
     "Prompt tokens held requests got from the prefix cache instead of computing."),
    ("kv_events_published", "kv_events_published",
     "KV cache events published (--kv-events-config)."),
    ("kv_events_dropped", "kv_events_dropped",
     "KV cache events dropped because the publisher's queue was full."),
    ("spec_decode_num_drafts", "spec_decode_num_drafts",
     "Speculative decoding: sequence-steps that verified draft tokens."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens",
     "Speculative decoding: draft tokens verified."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Speculative decoding: draft tokens the target model agreed with."),
    ("context_shifts", "context_shifts",
     "Times a sequence filled the context and was shifted (oldest tokens after n_keep "
     "dropped) instead of finishing."),
)


class _Snapshot(Collector):
    """Exports the engine stats and server counters handed over at the latest scrape."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.m = metrics

    def collect(self) -> Iterator[Metric]:
        m, stats, label = self.m, self.m.stats, [self.m.model_name]
        if stats is not None:
            for name, field, doc in ENGINE_GAUGES:
                yield _one(GaugeMetricFamily, name, doc, getattr(stats, field, 0), label)
            for name, field, doc in ENGINE_COUNTERS:
                yield _one(CounterMetricFamily, name, doc, getattr(stats, field, 0), label)
            blocks = GaugeMetricFamily(
                PREFIX + "kv_cache_blocks", "KV blocks by state: used by requests; free; "
                "cached = free blocks still holding a reusable prefix (also counted as free).",
                labels=["model_name", "state"])
            for state, field in (("used", "blocks_used"), ("cached", "blocks_cached"),
                                 ("free", "blocks_free")):
                blocks.add_metric([m.model_name, state], getattr(stats, field))
            yield blocks
        yield _one(GaugeMetricFamily, "http_requests_in_flight",
                   "Requests holding a concurrency slot (generation, /tokenize, /detokenize).", m.in_flight, label)
        success = CounterMetricFamily(
            PREFIX + "request_success", "Requests finished, by endpoint and finish reason.",
            labels=["model_name", "endpoint", "finished_reason"])
        for (endpoint, reason), n in sorted(m.finished.items()):
            success.add_metric([m.model_name, endpoint, reason], n)
        yield success
        errors = CounterMetricFamily(PREFIX + "request_errors", "Requests refused, by status.",
                                     labels=["model_name", "status"])
        for status, n in sorted(m.errors.items()):
            errors.add_metric([m.model_name, str(status)], n)
        yield errors


def _one(kind: type, name: str, doc: str, value: float, label: list[str]) -> Metric:
    fam = kind(PREFIX + name, doc, labels=["model_name"])
    fam.add_metric(label, float(value))
    return fam


class ServerMetrics:
    """Counters the server owns; all updated from the event loop thread."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.finished: collections.Counter[tuple[str, str]] = collections.Counter()
        self.errors: collections.Counter[int] = collections.Counter()
        self.stats: Any = None  # the engine's stats at the latest scrape
        self.in_flight = 0
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time from request arrival to its first generated token.", ["model_name"],
            registry=self.registry, buckets=TTFT_BUCKETS).labels(model_name)
        self.e2e_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Time from request arrival to its last token.", ["model_name"],
            registry=self.registry, buckets=LATENCY_BUCKETS).labels(model_name)
        self.registry.register(_Snapshot(self))

    def request_finished(self, endpoint: str, finish_reason: str, latency: float) -> None:
        self.finished[(endpoint, finish_reason)] += 1
        self.e2e_latency.observe(latency)

    def render(self, stats: Any, in_flight: int) -> str:
        """The Prometheus text exposition, with `stats` as the engine's current figures."""
        self.stats, self.in_flight = stats, in_flight
        return generate_latest(self.registry).decode()
