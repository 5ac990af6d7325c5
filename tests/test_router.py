"""pagedkv serve replicas behind a real sglang-router process (`cache_aware`, `round_robin`):
the worker endpoints it calls, requests through it with the real openai client, cache-aware
placement checked against each replica's KV events, and API keys (tenants) passing through."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from kv_event_subscriber import Subscriber

from pagedkv.bench.router import RouterProcess, router_available
from pagedkv.cache.hashing import chain_hashes
from pagedkv.engine import LLMEngine
from pagedkv.engine.kv_events import external_hash
from pagedkv.server import ServerThread, build_app

pytestmark = pytest.mark.skipif(not router_available(), reason="sglang-router not installed")

MODEL = "smol"
DOCS = [f"Report {d}: " + " ".join(f"item {d}-{i} weighs {i * 7 + d} grams." for i in range(24))
        for d in range(2)]


class Replica:
    def __init__(self, loaded, tmp: Path, name: str, **server) -> None:  # noqa: ANN001
        self.ep = f"ipc://{tmp}/{name}"
        self.engine = LLMEngine(loaded, num_blocks=160, block_size=16, kv_events_config=json.dumps(
            {"enable_kv_cache_events": True, "endpoint": self.ep, "topic": name,
             "replay_endpoint": self.ep + "-replay"}))
        self.sub = Subscriber(self.ep, self.ep + "-replay", name)
        self.thread = ServerThread(build_app(self.engine, served_model_name=MODEL, **server))
        self.url = self.thread.start()

    def finished(self) -> int:
        return self.engine.stats().num_requests_finished

    def close(self) -> None:
        self.thread.stop()
        self.sub.close()
        self.engine.close()


@pytest.fixture
def replicas(smollm2, tmp_path):  # noqa: ANN001, ANN201
    made = [Replica(smollm2, tmp_path, f"r{i}") for i in range(2)]
    yield made
    for r in made:
        r.close()


def _ask(client: openai.OpenAI, doc: str, q: str) -> None:
    client.completions.create(model=MODEL, prompt=f"{doc}\nQuestion: {q}\nAnswer:",
                              max_tokens=2, temperature=0)


def _served_by(replicas: list[Replica], fn) -> int:  # noqa: ANN001
    before = [r.finished() for r in replicas]
    fn()
    after = [r.finished() for r in replicas]
    (i,) = [k for k in range(len(replicas)) if after[k] > before[k]]
    return i


def test_worker_endpoints(replicas):
    r = replicas[0]
    info = httpx.get(r.url + "/server_info", timeout=10).json()
    assert info["model_path"] == MODEL and info["dp_size"] == 1 and info["page_size"] == 16
    assert httpx.get(r.url + "/get_server_info", timeout=10).json() == info
    mi = httpx.get(r.url + "/model_info", timeout=10).json()
    assert mi["model_path"] == MODEL and mi["is_generation"] is True
    (load,) = httpx.get(r.url + "/get_load", timeout=10).json()
    assert load == {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}


def test_cache_aware_router_keeps_a_document_on_the_replica_holding_it(replicas):
    with RouterProcess([r.url for r in replicas], "cache_aware") as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0,
                               timeout=60)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=3)
        assert chat.choices[0].message.content
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="Once upon", max_tokens=3, stream=True, temperature=0))
        assert text
        loads = httpx.get(router.url + "/get_loads", timeout=10).json()["workers"]
        assert sorted(w["load"] for w in loads) == [0, 0]  # our /get_load, parsed
        homes = {}
        for q in range(2):
            for d, doc in enumerate(DOCS):
                i = _served_by(replicas, lambda doc=doc, q=q: _ask(client, doc, f"item {q}?"))
                homes.setdefault(d, set()).add(i)
        assert all(len(h) == 1 for h in homes.values()), homes  # each document stayed home
        tok = replicas[0].engine.tokenizer
        for d, doc in enumerate(DOCS):
            (home,) = homes[d]
            first = external_hash(chain_hashes(tok(doc).input_ids, 16, max_blocks=1)[0])
            for i, r in enumerate(replicas):  # the replica the events say holds it
                r.engine.kv_events.publisher.flush()
                r.sub.poll()
                assert (first in r.sub.sets.of("GPU")) == (i == home)
        hits = sum(r.engine.stats().prefix_cache_hits for r in replicas)
        assert hits >= 2 * 16 * 8  # the follow-ups found their document's blocks


def test_round_robin_spreads_the_same_document(replicas):
    with RouterProcess([r.url for r in replicas], "round_robin") as router:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0,
                               timeout=60)
        served = [_served_by(replicas, lambda q=q: _ask(client, DOCS[0], f"item {q}?"))
                  for q in range(4)]
        assert sorted(served) == [0, 0, 1, 1]


def test_api_keys_pass_through_the_router(smollm2, tmp_path):
    r = Replica(smollm2, tmp_path, "keyed", api_key=["admin-key", "tenant-key"])
    try:
        with RouterProcess([r.url], "cache_aware") as router:  # it forwards Authorization
            ok = openai.OpenAI(base_url=router.url + "/v1", api_key="tenant-key", max_retries=0,
                               timeout=60)
            assert ok.completions.create(model=MODEL, prompt=DOCS[0], max_tokens=2).choices
            bad = openai.OpenAI(base_url=router.url + "/v1", api_key="wrong", max_retries=0,
                                timeout=60)
            with pytest.raises(openai.AuthenticationError):
                bad.completions.create(model=MODEL, prompt="Hello", max_tokens=2)
        time.sleep(0.1)
        r.engine.kv_events.publisher.flush()
        r.sub.poll()
        stored = r.sub.sets.stored_events
        assert stored and all(e.token_ids == [] for e in stored)  # salted: no tokens published
    finally:
        r.close()
