"""HTTP fuzz test of the OpenAI-compatible API (issue 8), and of the KV tier's outside inputs:
stored records and snapshot directories (issue 24).

Hypothesis throws request bodies at both generation endpoints (well-formed fields with
hostile values, wrong types, unknown fields, broken JSON, raw bytes) with a fixed, derandomized
budget. Every answer must be JSON: a success, or an OpenAI-style error with a 4xx status,
never a 500 and never plain text; a stream's events are JSON too and end with [DONE]. A
well-formed stream running next to the fuzzer must complete with the right text.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from typing import Any

import httpx
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_server import FakeEngine, Running, assert_idle, expected_echo

from pagedkv.cache import KVStorage, PagedKVCache
from pagedkv.cache.tiers import DiskTier, encode, open_tier
from pagedkv.cache.tiers import warm_restart as snapshot
from pagedkv.server import ServerThread, build_app

junk = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=3),
    max_leaves=8,
)
small_int = st.integers(-3, 300) | st.sampled_from([0, 1, 2**31, 2**62, 2**63, -(2**63) - 1])
floats = (st.floats(-3, 3) | st.sampled_from([0.0, 1e-40, 1e-300, 5e-324, 2.0, 2.0000001])
          | st.floats(allow_nan=False, allow_infinity=False))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "wizard"]) | junk},
    optional={"content": st.text(max_size=20) | junk, "name": st.text(max_size=5) | junk},
)
common = {
    "model": st.sampled_from(["fake", "gpt-4"]) | junk,
    "max_tokens": small_int | junk,
    "temperature": floats | junk,
    "top_p": floats | junk,
    "top_k": small_int | junk,
    "seed": small_int | floats | junk,
    "n": st.integers(-1, 70) | junk,
    "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=20) | junk,
    "stop_token_ids": st.lists(small_int, max_size=6) | junk,
    "logit_bias": st.dictionaries(st.text("0123456789a", max_size=4), floats, max_size=4)
    | junk,
    "stream": st.booleans() | junk,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans() | junk}) | junk,
    "cache_salt": st.text(max_size=8) | junk,
    "ignore_eos": st.booleans() | junk,
    "unknown_field": junk,
}
completion = st.fixed_dictionaries(
    {"prompt": st.text(min_size=1, max_size=30)
     | st.lists(st.integers(-5, 400), min_size=1, max_size=8) | junk},
    optional={**common, "logprobs": st.integers(-1, 7) | junk, "echo": st.booleans() | junk},
)
chat = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4) | junk},
    optional={**common, "max_completion_tokens": small_int | junk,
              "logprobs": st.booleans() | junk, "top_logprobs": st.integers(-1, 25) | junk},
)
raw = st.binary(max_size=64) | st.sampled_from(
    [b"", b"{", b"[]", b"null", b'{"prompt": NaN}', b'{"prompt": "a", "max_tokens": 1e400}',
     b"\xff\xfe", b'{"messages": [' * 200])
request = st.one_of(
    st.tuples(st.just("/v1/completions"), completion.map(json.dumps)),
    st.tuples(st.just("/v1/chat/completions"), chat.map(json.dumps)),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), raw),
)


def check_response(r: httpx.Response) -> None:
    ctype = r.headers.get("content-type", "")
    assert r.status_code < 500, (r.status_code, r.text[:300])
    if ctype.startswith("text/event-stream"):
        assert r.status_code == 200
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", events[-2:]
        for e in events[:-1]:
            obj = json.loads(e.removeprefix("data: "))
            assert "choices" in obj or set(obj["error"]) == {"message", "type", "param", "code"}
        return
    assert ctype.startswith("application/json"), (r.status_code, ctype, r.text[:200])
    body = r.json()
    if r.status_code == 200:
        assert body["object"] in ("text_completion", "chat.completion") and body["choices"]
    else:
        assert 400 <= r.status_code < 500
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]


def test_fuzz_http_api_every_answer_is_json_and_streams_complete() -> None:
    engine = FakeEngine(step_delay=0.001)
    app = build_app(engine, served_model_name="fake", max_tokens_limit=128,
                    max_request_bytes=64 * 1024)
    with ServerThread(app) as thread, httpx.Client(base_url=thread.url, timeout=60) as client:
        results: list[str] = []
        done = threading.Event()

        def well_formed_streams() -> None:  # one after another, for the whole fuzz run
            body = {"prompt": "steady", "max_tokens": 128, "stream": True}
            while not done.is_set() or not results:
                text = ""
                with httpx.stream("POST", thread.url + "/v1/completions", json=body,
                                  timeout=120) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            text += json.loads(line[6:])["choices"][0]["text"]
                results.append(text)

        @settings(max_examples=100, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(request)
        def fuzz(req: tuple[str, Any]) -> None:
            path, body = req
            content = body if isinstance(body, bytes) else body.encode()
            check_response(client.post(path, content=content,
                                       headers={"content-type": "application/json"}))

        streamer = threading.Thread(target=well_formed_streams)
        streamer.start()
        try:
            fuzz()
        finally:
            done.set()
            streamer.join(120)
        assert results and set(results) == {expected_echo("steady", 128)}, len(results)
        assert_idle(Running(thread.url, engine, app))


# --- issue 24: KV tier records and snapshot directories are outside input too ----------------

TIER_FP = bytes(range(32))
TIER_LAYOUT = {"kv": (torch.float32, (2, 2, 4, 2, 8))}


def _tier_key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _tier_parts(seed: int) -> dict[str, torch.Tensor]:
    return {"kv": torch.randn(TIER_LAYOUT["kv"][1], generator=torch.Generator().manual_seed(seed))}


def _checksummed(header: bytes, payload: bytes) -> bytes:
    body = struct.pack("<4sHI", b"PKVB", 1, len(header)) + header + payload
    return body + hashlib.blake2b(body, digest_size=16).digest()


def _hostile_record(data: st.DataObject) -> bytes:
    """A checksum-valid record around a hostile header, or a mutated real record."""
    kind = data.draw(st.sampled_from(["junk-header", "deep", "mutated", "raw"]))
    if kind == "junk-header":
        doc = data.draw(st.fixed_dictionaries(
            {}, optional={"fp": junk | st.just(TIER_FP.hex()), "key": junk,
                          "parts": junk | st.just([["kv", "float32", [2, 2, 4, 2, 8]]])}) | junk)
        header = json.dumps(doc).encode()
        return _checksummed(header, data.draw(st.binary(max_size=64)))
    if kind == "deep":
        n = data.draw(st.integers(1, 60_000))
        return _checksummed(b'{"parts":' + b"[" * n + b"]" * n + b"}", b"")
    if kind == "raw":
        return data.draw(st.binary(max_size=200))
    blob = bytearray(encode(TIER_FP, _tier_key(0), _tier_parts(0)))
    for _ in range(data.draw(st.integers(1, 3))):
        blob[data.draw(st.integers(0, len(blob) - 1))] ^= data.draw(st.integers(1, 255))
    return bytes(blob)


def test_fuzz_tier_records_are_misses_never_errors(redis_server, tmp_path) -> None:  # noqa: ANN001
    """Hostile values in Redis and in a disk tier: each is a counted miss, dropped, and never
    hurts a valid neighbour of the same batch."""
    disk = DiskTier(tmp_path, TIER_FP, fsync=False)
    redis_tier = open_tier(redis_server.url, TIER_FP)
    client = redis_server.client()

    @settings(max_examples=60, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        blob = _hostile_record(data)
        for tier in (disk, redis_tier):
            tier.put(_tier_key(1), _tier_parts(1))
            bad = tier.stats.checksum_failures
            if tier is disk:
                tier.path(_tier_key(0)).parent.mkdir(parents=True, exist_ok=True)
                tier.path(_tier_key(0)).write_bytes(blob)
            else:
                client.set(tier.key(_tier_key(0)), blob)
            got = tier.get_many([_tier_key(0), _tier_key(1)], TIER_LAYOUT)
            assert got[0] is None and tier.stats.checksum_failures == bad + 1
            assert got[1] is not None and torch.equal(got[1]["kv"], _tier_parts(1)["kv"])
            assert not tier.contains(_tier_key(0))  # dropped

    fuzz()
    assert disk.stats.errors == 0 and redis_tier.stats.errors == 0
    redis_tier.clear()


ENTRY_KINDS = ["record", "garbage", "deep", "fifo", "dir", "link", "tmp", "badname", "empty"]


def test_fuzz_snapshot_directories_restore_the_valid_blocks(tmp_path) -> None:  # noqa: ANN001
    """A snapshot directory holding any mix of entries: the start never hangs or fails, and
    exactly the valid records are restored."""
    counter = iter(range(10**6))

    @settings(max_examples=40, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from(ENTRY_KINDS), max_size=12))
    def fuzz(kinds: list[str]) -> None:
        root = tmp_path / f"snap{next(counter)}"
        folder = DiskTier(root, TIER_FP, fsync=False).dir
        valid = 0
        for i, kind in enumerate(kinds):
            k = _tier_key(1000 + i)
            p = folder / k.hex()[:2] / (k.hex() + ".kvb")
            p.parent.mkdir(exist_ok=True)
            if kind == "record":
                p.write_bytes(encode(TIER_FP, k, _tier_parts(i)))
                valid += 1
            elif kind == "garbage":
                p.write_bytes(b"PKVB" + bytes([i]) * 50)
            elif kind == "deep":
                p.write_bytes(_checksummed(b"[" * 50_000 + b"]" * 50_000, b""))
            elif kind == "fifo":
                os.mkfifo(p)
            elif kind == "dir":
                p.mkdir()
            elif kind == "link":
                p.symlink_to("/dev/zero")
            elif kind == "tmp":
                (p.parent / f".tmp-{i}").write_bytes(b"partial")
            elif kind == "badname":
                (p.parent / f"zz{i}.kvb").write_bytes(b"x")
            else:
                p.write_bytes(b"")
        cache = PagedKVCache(32, 4, storage=KVStorage(2, 32, 4, 2, 8))
        done: list[int] = []

        def start() -> None:
            done.append(snapshot.restore(cache, DiskTier(root, TIER_FP, fsync=False))[1])

        t = threading.Thread(target=start, daemon=True)
        t.start()
        t.join(30)
        assert done == [valid], (kinds, done)
        cache.check_invariants()

    fuzz()
