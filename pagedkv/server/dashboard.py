"""The live KV pool page: `GET /dashboard` (static HTML + plain JS) and `GET /v1/cache/blocks`.

`/v1/cache/blocks` returns the block map of the engine's cache (`pagedkv.cache.snapshot`), run-
length encoded, with the engine's request counters. It carries only states, counts, reference
counts and request ids: never prompt text or token ids. It sits behind `--api-key` like every
other data route. `/dashboard` is one static file with no data in it (a browser cannot attach a
Bearer header to a page load); the page asks for the key once, keeps it in sessionStorage and
sends it as a Bearer header with every poll.

The snapshot is taken on the engine thread (the engine is not thread-safe) and shared by every
poll within `MIN_INTERVAL_S`, so any number of open pages costs the engine at most a few
snapshots a second.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib import resources
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, Response

from pagedkv.cache import PagedKVCache
from pagedkv.cache.snapshot import block_map
from pagedkv.plot import CACHED_RGB, FREE_RGB, OWNED_PALETTE, SHARED_DARK, SHARED_LIGHT, SHARED_MAX
from pagedkv.server.async_engine import EngineDeadError
from pagedkv.server.protocol import ApiError

PAGE_PATH = "/dashboard"
DATA_PATH = "/v1/cache/blocks"
MIN_INTERVAL_S = 0.5
COLORS = {
    "free": FREE_RGB, "cached": CACHED_RGB, "owned": OWNED_PALETTE,
    "shared_light": SHARED_LIGHT, "shared_dark": SHARED_DARK, "shared_max": SHARED_MAX,
}


def seq_labels(engine: Any) -> dict[Any, str]:
    """Cache sequence id -> request id ("#k" added for the k-th of n > 1 samples)."""
    labels: dict[Any, str] = {}
    for rid, req in getattr(engine, "requests", {}).items():
        seqs = getattr(req, "seqs", [])
        for s in seqs:
            labels[s.seq_id] = rid if len(seqs) == 1 else f"{rid}#{s.index}"
    return labels


def blocks_payload(engine: Any) -> dict[str, Any]:
    """Runs on the engine thread: the block map and request counters as a JSON-ready dict."""
    cache = getattr(engine, "cache", None)
    if not isinstance(cache, PagedKVCache):
        raise ApiError(501, "this engine has no paged KV cache to show", type="server_error")
    labels = seq_labels(engine)
    out = block_map(cache, label=lambda sid: labels.get(sid, f"seq-{sid}")).to_json()
    st = engine.stats()
    out["engine"] = {
        "running": st.num_running,
        "waiting": st.num_waiting,
        "kv_usage": st.kv_usage,
        "prefix_hit_rate": st.prefix_hit_rate,
        "generation_tokens_total": st.generation_tokens_total,
        "gen_tokens_per_s": st.gen_tokens_per_s,
        "requests_finished": st.num_requests_finished,
        "preemptions": st.num_preemptions,
    }
    out["time"] = time.time()
    return out


class _Snapshots:
    """One snapshot per MIN_INTERVAL_S, shared by all concurrent and later polls."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.body: bytes | None = None
        self.taken = 0.0
        self.lock = asyncio.Lock()

    async def get(self) -> bytes:
        async with self.lock:
            if self.body is None or time.monotonic() - self.taken >= MIN_INTERVAL_S:
                payload = await self.server.engine.call(blocks_payload)
                self.body = json.dumps(payload, separators=(",", ":")).encode()
                self.taken = time.monotonic()
            return self.body


def page_html() -> str:
    html = resources.files("pagedkv.server").joinpath("dashboard.html").read_text("utf-8")
    return html.replace("/*COLORS*/null", json.dumps(COLORS))


def add_dashboard(app: FastAPI, server: Any) -> None:
    """Registers both routes on the server's app (auth is the server's guard's business)."""
    html = page_html()
    snaps = _Snapshots(server)

    async def page() -> Response:
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    async def blocks() -> Response:
        try:
            body = await snaps.get()
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), type="server_error") from None
        return Response(body, media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    app.add_api_route(PAGE_PATH, page, methods=["GET"], include_in_schema=False)
    app.add_api_route(DATA_PATH, blocks, methods=["GET"])
