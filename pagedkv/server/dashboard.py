"""The live KV pool page: `GET /dashboard` (static HTML + plain JS) and `GET /v1/cache/blocks`.

`/v1/cache/blocks` returns the block map of the engine's cache (`pagedkv.cache.block_map`), run-
length encoded, with the engine's request counters. It carries only states, counts, reference
counts and request ids: never prompt text or token ids. It sits behind `--api-key` like every
other data route, and shows each tenant only its own request ids: the admin (the first key) and
a server without keys see every id; any other tenant sees the blocks of other tenants' requests
(and of sequences no request of this server owns) as one anonymous owner, `null` in `owners`,
with the same states and counts. The owner of a request is the tenant the guard authenticated
when the request was submitted (`RequestStream.tenant`), never anything the client sends. `/dashboard` is one static file with no data in it (a browser cannot attach a
Bearer header to a page load); the page asks for the key once, keeps it in sessionStorage and
sends it as a Bearer header with every poll.

The snapshot is taken on the engine thread (the engine is not thread-safe) and shared by every
poll within `MIN_INTERVAL_S`, so any number of open pages costs the engine at most a few
snapshots a second; each tenant's view of it is encoded once per snapshot.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, Response

from pagedkv.cache import PagedKVCache
from pagedkv.cache.block_map import block_map, rle
from pagedkv.plot import CACHED_RGB, FREE_RGB, OWNED_PALETTE, SHARED_DARK, SHARED_LIGHT, SHARED_MAX
from pagedkv.server.async_engine import EngineDeadError
from pagedkv.server.protocol import ApiError

PAGE_PATH = "/dashboard"
DATA_PATH = "/v1/cache/blocks"
MIN_INTERVAL_S = 0.5
COLORS = {
    "free": FREE_RGB, "cached": CACHED_RGB, "owned": OWNED_PALETTE,
    "shared_light": SHARED_LIGHT, "shared_dark": SHARED_DARK, "shared_max": SHARED_MAX,
    "other": (150, 150, 160),  # blocks of another tenant's requests
}
ALL = object()  # a caller that may see every request id


def seq_owners(engine: Any) -> dict[Any, tuple[str, str]]:
    """Cache sequence id -> (label, engine request id); the label is the request id, with
    "#k" added for the k-th of n > 1 samples."""
    owners: dict[Any, tuple[str, str]] = {}
    for rid, req in getattr(engine, "requests", {}).items():
        seqs = getattr(req, "seqs", [])
        for s in seqs:
            owners[s.seq_id] = (rid if len(seqs) == 1 else f"{rid}#{s.index}", rid)
    return owners


@dataclass
class Snapshot:
    """One block map: `full` is the admin's JSON (every request id); `owner` the OWNED blocks'
    owner indices and `tenants` each owner's tenant, from which `view` builds the others'."""

    full: dict[str, Any]
    owner: np.ndarray
    tenants: list[str | None]
    views: dict[Any, bytes] = field(default_factory=dict)

    def view(self, tenant: Any) -> bytes:
        """The JSON body for `tenant` (ALL: every id), encoded once per snapshot and tenant."""
        body = self.views.get(tenant)
        if body is None:
            out = self.full if tenant is ALL else self._anonymized(tenant)
            body = self.views[tenant] = json.dumps(out, separators=(",", ":")).encode()
        return body

    def _anonymized(self, tenant: str | None) -> dict[str, Any]:
        """Owners of other tenants become one `null` owner: a block's owner index says only
        "mine (which)" or "someone else's", never which other request holds it."""
        labels = self.full["owners"]
        mine = [i for i, t in enumerate(self.tenants) if tenant is not None and t == tenant]
        owners: list[str | None] = [labels[i] for i in mine]
        remap = np.full(len(labels) + 1, -1, np.int64)  # the last slot keeps owner -1 at -1
        if len(mine) < len(labels):
            remap[:-1] = len(owners)
            owners.append(None)
        remap[mine] = np.arange(len(mine))
        return {**self.full, "owners": owners, "owner": rle(remap[self.owner])}


def take_snapshot(engine: Any, tenant_of: Any) -> Snapshot:
    """Runs on the engine thread: the block map, each owner's tenant (`tenant_of(request id)`)
    and the engine's request counters."""
    cache = getattr(engine, "cache", None)
    if not isinstance(cache, PagedKVCache):
        raise ApiError(501, "this engine has no paged KV cache to show", type="server_error")
    owners = seq_owners(engine)
    bmap = block_map(cache)  # owners: the cache's sequence ids
    labels = [owners[s][0] if s in owners else f"seq-{s}" for s in bmap.owners]
    tenants = [tenant_of(owners[s][1]) if s in owners else None for s in bmap.owners]
    bmap.owners = labels
    out = bmap.to_json()
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
    return Snapshot(out, bmap.owner, tenants)


class _Snapshots:
    """One snapshot per MIN_INTERVAL_S, shared by all concurrent and later polls."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.snap: Snapshot | None = None
        self.taken = 0.0
        self.lock = asyncio.Lock()

    async def get(self) -> Snapshot:
        async with self.lock:
            if self.snap is None or time.monotonic() - self.taken >= MIN_INTERVAL_S:
                tenant_of = self.server.engine.tenant_of
                self.snap = await self.server.engine.call(
                    lambda engine: take_snapshot(engine, tenant_of))
                self.taken = time.monotonic()
            return self.snap


def page_html() -> str:
    html = resources.files("pagedkv.server").joinpath("dashboard.html").read_text("utf-8")
    return html.replace("/*COLORS*/null", json.dumps(COLORS))


def add_dashboard(app: FastAPI, server: Any) -> None:
    """Registers both routes on the server's app (auth is the server's guard's business)."""
    html = page_html()
    snaps = _Snapshots(server)

    async def page() -> Response:
        return HTMLResponse(html, headers={"Cache-Control": "no-cache"})

    from pagedkv.server.guard import TENANT_KEY  # here: the guard imports this module

    keys = server.api_keys

    async def blocks(request: Request) -> Response:
        try:
            snap = await snaps.get()
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), type="server_error") from None
        tenant = request.scope.get(TENANT_KEY)
        body = snap.view(ALL if keys is None or tenant == keys.admin else tenant)
        return Response(body, media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    app.add_api_route(PAGE_PATH, page, methods=["GET"], include_in_schema=False)
    app.add_api_route(DATA_PATH, blocks, methods=["GET"])
