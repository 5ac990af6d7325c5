"""Prometheus text-format metrics, written by hand (no prometheus_client dependency).

Engine-side figures (KV blocks, prefix cache, preemptions, token counters) are read from
`engine.stats()` at scrape time; request-side figures (TTFT, latency, finish reasons) are
recorded by the server as requests complete.
"""

from __future__ import annotations

import bisect
import collections
from typing import Any

PREFIX = "pagedkv"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip(self.buckets, self.counts, strict=False):
            cumulative += n
            lines.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.sum}")
        lines.append(f"{name}_count {self.count}")
        return lines


def _metric(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{labels} {value}" for labels, value in samples]
    return lines


class ServerMetrics:
    """Counters the server owns; all updated from the event loop thread."""

    def __init__(self) -> None:
        self.ttft = Histogram(TTFT_BUCKETS)
        self.e2e_latency = Histogram(LATENCY_BUCKETS)
        self.finished: collections.Counter[tuple[str, str]] = collections.Counter()
        self.errors: collections.Counter[int] = collections.Counter()

    def request_finished(self, endpoint: str, finish_reason: str, latency: float) -> None:
        self.finished[(endpoint, finish_reason)] += 1
        self.e2e_latency.observe(latency)

    def render(self, stats: Any, in_flight: int) -> str:
        p = PREFIX
        gauge, counter = "gauge", "counter"
        lines: list[str] = []
        lines += _metric(f"{p}_kv_cache_usage_ratio", gauge, "Fraction of KV blocks in use.",
                         [("", stats.kv_usage)])
        lines += _metric(f"{p}_kv_blocks", gauge, "KV blocks by state: used by requests; free; "
                         "cached = free blocks still holding a reusable prefix.",
                         [('{state="used"}', stats.blocks_used),
                          ('{state="cached"}', stats.blocks_cached),
                          ('{state="free"}', stats.blocks_free)])
        lines += _metric(f"{p}_kv_blocks_total", gauge, "Total KV blocks.",
                         [("", stats.num_blocks)])
        lines += _metric(f"{p}_prefix_cache_hit_rate", gauge,
                         "Prompt tokens served from the prefix cache / tokens queried.",
                         [("", stats.prefix_hit_rate)])
        lines += _metric(f"{p}_prefix_cache_queries_total", counter,
                         "Prompt tokens looked up in the prefix cache.",
                         [("", stats.prefix_cache_queries)])
        lines += _metric(f"{p}_prefix_cache_hits_total", counter,
                         "Prompt tokens found in the prefix cache.",
                         [("", stats.prefix_cache_hits)])
        lines += _metric(f"{p}_num_preemptions_total", counter, "Requests preempted.",
                         [("", stats.num_preemptions)])
        lines += _metric(f"{p}_num_requests_running", gauge, "Requests being decoded.",
                         [("", stats.num_running)])
        lines += _metric(f"{p}_num_requests_waiting", gauge, "Requests waiting to be scheduled.",
                         [("", stats.num_waiting)])
        lines += _metric(f"{p}_http_requests_in_flight", gauge,
                         "Generation requests the server is handling.", [("", in_flight)])
        lines += _metric(f"{p}_engine_requests_finished_total", counter,
                         "Requests the engine finished.", [("", stats.num_requests_finished)])
        lines += _metric(f"{p}_prompt_tokens_total", counter, "Prompt tokens processed.",
                         [("", stats.prompt_tokens_total)])
        lines += _metric(f"{p}_generation_tokens_total", counter, "Tokens generated.",
                         [("", stats.generation_tokens_total)])
        lines += _metric(f"{p}_request_success_total", counter,
                         "Requests finished by the server, by endpoint and finish reason.",
                         [(f'{{endpoint="{e}",finish_reason="{r}"}}', n)
                          for (e, r), n in sorted(self.finished.items())])
        lines += _metric(f"{p}_request_errors_total", counter,
                         "Requests refused with an error status.",
                         [(f'{{status="{s}"}}', n) for s, n in sorted(self.errors.items())])
        lines += self.ttft.render(f"{p}_time_to_first_token_seconds",
                                  "Time from request arrival to its first generated token.")
        lines += self.e2e_latency.render(f"{p}_e2e_request_latency_seconds",
                                         "Time from request arrival to its last token.")
        return "\n".join(lines) + "\n"
