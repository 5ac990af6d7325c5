"""`/v1/cache/blocks` and `/dashboard` over real HTTP, on the server tests' deterministic engine
(fast; the real model and a real browser are in test_dashboard.py)."""

from __future__ import annotations

import json
import time

import httpx
from test_server import FakeEngine

from pagedkv.cache import PagedKVCache
from pagedkv.server import ServerThread, build_app
from pagedkv.server.dashboard import COLORS, MIN_INTERVAL_S


def engine_with_cache() -> FakeEngine:
    engine = FakeEngine()
    engine.cache = PagedKVCache(32, 4)  # a real pool; FakeEngine never touches it
    engine.cache.create(7, [1, 2, 3, 4, 5])
    engine.cache.fork(7, 8)
    engine.cache.create(9, [6, 6])
    return engine


def test_key_guards_the_data_not_the_page() -> None:
    with ServerThread(build_app(engine_with_cache(), api_key="k")) as srv:
        r = httpx.get(f"{srv.url}/v1/cache/blocks")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{srv.url}/v1/cache/blocks",
                         headers={"Authorization": "Bearer nope"}).status_code == 401
        ok = httpx.get(f"{srv.url}/v1/cache/blocks", headers={"Authorization": "Bearer k"})
        assert ok.status_code == 200
        page = httpx.get(f"{srv.url}/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/*COLORS*/null" not in page.text and json.dumps(COLORS) in page.text


def test_blocks_payload_and_shared_snapshots() -> None:
    with ServerThread(build_app(engine_with_cache())) as srv:
        first = httpx.get(f"{srv.url}/v1/cache/blocks")
        again = httpx.get(f"{srv.url}/v1/cache/blocks")
        snap = first.json()
        assert first.content == again.content  # one snapshot serves polls within the interval
        assert snap["num_blocks"] == 32 and snap["block_size"] == 4
        assert snap["counts"] == {"free": 29, "cached": 0, "owned": 1, "shared": 2}
        assert snap["owners"] == ["seq-7", "seq-8", "seq-9"]  # no request: plain sequence ids
        assert snap["states"] == [3, 2, 2, 1, 0, 29] and snap["refs"] == [2, 2, 1, 1, 0, 29]
        assert snap["engine"]["running"] == 0
        time.sleep(MIN_INTERVAL_S + 0.05)
        assert httpx.get(f"{srv.url}/v1/cache/blocks").json()["time"] > snap["time"]


def test_engine_without_paged_cache_is_501() -> None:
    with ServerThread(build_app(FakeEngine())) as srv:
        r = httpx.get(f"{srv.url}/v1/cache/blocks")
        assert r.status_code == 501 and "no paged KV cache" in r.json()["error"]["message"]
