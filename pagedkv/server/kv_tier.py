"""Server surface of the KV tier: POST /v1/cache/reset, tier metrics, snapshot on shutdown.

Metrics: `pagedkv:kv_tier_{hit,miss}_tokens_total`, `..._{read,written}_bytes_total`,
`..._write_drops_total`, `..._checksum_failures_total`, `..._errors_total`.

`POST /v1/cache/reset` empties the device prefix cache (blocks in use keep serving their
requests) and, with `{"tier": true}`, this model's entries in the KV tier too. It runs on the
engine thread, between steps. It is an admin route: with API keys, only the first key (the
admin's) may call it (any other tenant gets 403: one tenant must not flush everyone's cache).
Emptying the tier (`{"tier": true}`) always needs the admin key: a tier may be shared by other
replicas, and a server without API keys (anyone may call it) cannot reset it (403).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pagedkv.server.auth import tenant_id
from pagedkv.server.guard import TENANT_KEY
from pagedkv.server.metrics import PREFIX

log = logging.getLogger("pagedkv.tier")

MAX_BODY = 1024

TIER_COUNTERS = (  # (stats key, metric name without prefix and _total, help)
    ("hit_tokens", "kv_tier_hit_tokens", "Prompt tokens loaded from the KV tier."),
    ("miss_tokens", "kv_tier_miss_tokens", "Prompt tokens asked from the KV tier, not found."),
    ("bytes_read", "kv_tier_read_bytes", "Bytes read from the KV tier."),
    ("bytes_written", "kv_tier_written_bytes", "Bytes written to the KV tier."),
    ("write_drops", "kv_tier_write_drops", "Blocks not written: the tier's write queue was full."),
    ("checksum_failures", "kv_tier_checksum_failures",
     "Tier entries ignored and dropped: bad checksum or tag (forged, altered, another key or "
     "tenant), undecodable, truncated, oversized, not a regular file, or another layout's."),
    ("errors", "kv_tier_errors", "KV tier I/O or connection errors (served by recompute)."),
    ("read_timeouts", "kv_tier_read_timeouts",
     "Requests admitted at their --kv-tier-read-timeout with the tier read unfinished."),
)


class TierCollector(Collector):
    """The tier's counters at scrape time (plain integers, read without the engine thread)."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def collect(self) -> Iterator[Metric]:
        engine = self.server.engine.engine
        stats = engine.tier_stats() if hasattr(engine, "tier_stats") else None
        if not stats:
            return
        label = [self.server.metrics.model_name]
        for key, name, doc in TIER_COUNTERS:
            fam = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric(label, float(stats.get(key, 0)))
            yield fam


def add_kv_routes(app: Any, server: Any, admin_key: str | None = None) -> None:
    admin = tenant_id(admin_key) if admin_key else None

    async def reset(request: Request) -> Response:
        if admin is not None and request.scope.get(TENANT_KEY) != admin:
            return _error(403, "resetting the cache needs the admin API key (the first key)")
        body = await request.body()
        if len(body) > MAX_BODY:
            return _error(413, "request body too large")
        tier = False
        if body.strip():
            try:
                doc = json.loads(body)
            except ValueError:
                return _error(400, "body must be JSON: {\"tier\": true|false}")
            if not isinstance(doc, dict) or set(doc) - {"tier"} or not isinstance(
                    doc.get("tier", False), bool):
                return _error(400, "body must be {\"tier\": true|false}")
            tier = doc.get("tier", False)
        if tier and admin is None:
            return _error(403, "resetting the KV tier needs the admin API key: a server without "
                               "--api-key cannot reset a tier other replicas may share")
        out = await server.engine.call(lambda engine: engine.reset_prefix_cache(tier=tier))
        log.info("cache reset: %s", out)
        return JSONResponse({"object": "cache.reset", **out})

    app.add_api_route("/v1/cache/reset", reset, methods=["POST"])
    server.metrics.registry.register(TierCollector(server))


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": None, "code": None}}, status_code=status)


def finish_engine(engine: Any) -> None:
    """After the server drained (SIGTERM): write the KV snapshot, flush tier writes."""
    if getattr(engine, "tiers", None) is None:
        return
    try:
        n = engine.snapshot()
        if n:
            log.warning("KV snapshot: wrote %d blocks", n)
    finally:
        engine.close()
