"""`/v1/cache/blocks` and `/dashboard` over real HTTP, on the server tests' deterministic engine
(fast; the real model and a real browser are in test_dashboard.py)."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import httpx
from test_server import FakeEngine

from pagedkv.cache import PagedKVCache
from pagedkv.cache.block_map import unrle
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


class CachedFake(FakeEngine):
    """FakeEngine whose requests also hold real blocks of a real pool while they live."""

    def __init__(self) -> None:
        super().__init__(step_delay=0.05)  # 200 tokens: 10 s, aborted sooner
        self.cache = PagedKVCache(64, 4)
        self.seq_ids = itertools.count(100)
        self.seq_of: dict[str, int] = {}

    def add_request(self, request_id: str, prompt: Any, params: Any, **kw: Any) -> None:
        super().add_request(request_id, prompt, params, **kw)
        sid = next(self.seq_ids)
        self.cache.create(sid, self.requests[request_id].prompt_ids)
        self.requests[request_id].seqs = [SimpleNamespace(seq_id=sid, index=0)]
        self.seq_of[request_id] = sid

    def _release(self, request_id: str) -> None:
        super()._release(request_id)
        if request_id in self.seq_of:
            self.cache.free(self.seq_of.pop(request_id))


@contextmanager
def running(url: str, key: str, prompt: str) -> Iterator[str]:
    """A streamed completion of tenant `key`, held open (its blocks held) while inside."""
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept referenced: closing it would close the stream
        line = next(lines)
        while not line.startswith("data: "):
            line = next(lines)
        yield json.loads(line[6:])["id"]


def test_tenants_see_only_their_own_request_ids() -> None:
    engine = CachedFake()
    with ServerThread(build_app(engine, api_key=["admin", "key-a", "key-b"])) as srv:
        def view(key: str) -> dict[str, Any]:
            r = httpx.get(f"{srv.url}/v1/cache/blocks", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
            return r.json()

        with running(srv.url, "key-a", "A" * 21) as a_id, \
                running(srv.url, "key-b", "B" * 9) as b_id:
            admin, a, b = view("admin"), view("key-a"), view("key-b")
            b_text = httpx.get(f"{srv.url}/v1/cache/blocks",
                               headers={"Authorization": "Bearer key-b"}).text
        assert sorted(admin["owners"]) == sorted([a_id, b_id])
        assert a["owners"] == [a_id, None] and b["owners"] == [b_id, None]
        assert a_id not in b_text and b_id not in json.dumps(a)
        for v in (a, b):  # same map, states and counts; only the owners differ
            assert {k: v[k] for k in v if k not in ("owner", "owners")} == \
                {k: admin[k] for k in admin if k not in ("owner", "owners")}
        owner = {k: unrle(v["owner"]) for k, v in (("admin", admin), ("a", a), ("b", b))}
        a_blocks = owner["admin"] == admin["owners"].index(a_id)
        b_blocks = owner["admin"] == admin["owners"].index(b_id)
        assert a_blocks.sum() == 6 and b_blocks.sum() == 3  # ceil(21 / 4), ceil(9 / 4)
        assert (owner["b"][a_blocks] == 1).all() and (owner["b"][b_blocks] == 0).all()
        assert (owner["a"][a_blocks] == 0).all() and (owner["a"][b_blocks] == 1).all()
        assert ((owner["b"] == -1) == (owner["admin"] == -1)).all()
