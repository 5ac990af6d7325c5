"""Issue 24 on the real model: KV tiers and snapshots are input from outside the process.

Through the real server (uvicorn, real sockets) and a real redis-server: a hostile record never
fails a request (its own or another tenant's) and is dropped; with --kv-tier-key the store holds
no plaintext, a forged or moved record is refused and recomputed; a server without API keys
cannot reset a shared tier; a snapshot directory full of hostile entries never stops the start;
and a replica with another activations mode never loads K/V it would not compute itself.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import struct
import threading
from pathlib import Path

import httpx
import pytest

from pagedkv.cache.hashing import chain_hashes
from pagedkv.engine import LLM, LLMEngine, SamplingParams
from pagedkv.model import load_model
from pagedkv.server import ServerThread, build_app
from pagedkv.server.auth import tenant_id

pytestmark = pytest.mark.slow

DOC = ("The ferry left the harbour at seven with forty passengers, three cars and a crate of "
       "oranges for the island school, and the captain logged the wind as a steady north-east. ") * 5
PROMPT = f"{DOC}\nQuestion: what did the crate hold?\nAnswer:"
OTHER = "Write one sentence about the sea."
ENGINE = dict(num_blocks=128, max_num_batched_tokens=512, kv_tier_read_timeout=10.0)  # reads untimed here
SECRET = "5f" * 32


def complete(url: str, key: str, prompt: str = PROMPT) -> dict:
    r = httpx.post(url + "/v1/completions", headers={"Authorization": f"Bearer {key}"},
                   timeout=300, json={"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def tier_tokens(body: dict) -> int:
    return body["usage"].get("prompt_tokens_details", {}).get("tier_cached_tokens", 0)


def hashes(engine: LLMEngine, api_key: str, prompt: str = PROMPT) -> list[bytes]:
    ids = engine.tokenize(prompt)
    return chain_hashes(ids, engine.cache.block_size, tenant_id(api_key),
                        max_blocks=(len(ids) - 1) // engine.cache.block_size)


def deep_record(depth: int = 50_000) -> bytes:
    header = b'{"fp":"x","key":"y","parts":' + b"[" * depth + b"]" * depth + b"}"
    body = struct.pack("<4sHI", b"PKVB", 1, len(header)) + header
    return body + hashlib.blake2b(body, digest_size=16).digest()


def flush(engine: LLMEngine) -> None:
    engine.tiers.connector.writer.flush()


def reset(url: str) -> None:
    """Empty the device prefix cache (on the engine thread): later hits come from the tier."""
    r = httpx.post(url + "/v1/cache/reset", headers={"Authorization": "Bearer a"})
    assert r.status_code == 200, r.text


def test_deep_record_in_redis_fails_no_request_and_is_dropped(smollm2, redis_server) -> None:  # noqa: ANN001
    engine = LLMEngine(smollm2, kv_tier=redis_server.url, **ENGINE)
    tier = engine.tiers.connector.tier
    client = redis_server.client()
    bad = tier.key(hashes(engine, "a")[0])
    client.set(bad, deep_record())
    with ServerThread(build_app(engine, api_key=["a", "b"])) as srv:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two tenants, concurrently
            mine = pool.submit(complete, srv.url, "a")
            other = pool.submit(complete, srv.url, "b", OTHER)
            body, _ = mine.result(), other.result()
        assert tier_tokens(body) == 0 and tier.stats.checksum_failures == 1
        flush(engine)
        assert client.get(bad) != deep_record()  # dropped, then written again from the recompute
        reset(srv.url)
        again = complete(srv.url, "a")
        assert again["choices"][0]["text"] == body["choices"][0]["text"]
        assert tier_tokens(again) >= 64
        metrics = httpx.get(srv.url + "/metrics", headers={"Authorization": "Bearer a"}).text
        assert any(ln.startswith("pagedkv:kv_tier_checksum_failures_total{") and ln.endswith(" 1.0")
                   for ln in metrics.splitlines())
    tier.clear()
    engine.close()


def test_keyed_tier_encrypts_refuses_forgeries_and_keyless_reset(smollm2, redis_server) -> None:  # noqa: ANN001
    engine = LLMEngine(smollm2, kv_tier=redis_server.url, kv_tier_key=SECRET, **ENGINE)
    tier = engine.tiers.connector.tier
    client = redis_server.client()
    keyless = LLMEngine(smollm2, kv_tier=redis_server.url, **ENGINE)
    with ServerThread(build_app(engine, api_key=["a", "b"])) as srv, \
            ServerThread(build_app(keyless)) as open_srv:
        first = complete(srv.url, "a")
        flush(engine)
        a_keys, b_keys = hashes(engine, "a"), hashes(engine, "b")
        values = [client.get(tier.key(h)) for h in a_keys]
        assert all(values) and len(values) >= 4
        for v in values:  # a store reader sees no header, no fingerprint, no layout
            assert b'"parts"' not in v and tier.fingerprint.hex().encode() not in v
        # tenant a's real record under tenant b's block: b's key never opens it
        client.set(tier.key(b_keys[0]), values[0])
        b = complete(srv.url, "b")
        assert tier_tokens(b) == 0 and b["choices"][0]["text"] == first["choices"][0]["text"]
        assert tier.stats.checksum_failures == 1
        # an altered byte in a's second record: refused, a's prefix loads up to it, same text
        altered = bytearray(values[1])
        altered[len(altered) // 2] ^= 1
        client.set(tier.key(a_keys[1]), bytes(altered))
        reset(srv.url)
        again = complete(srv.url, "a")
        assert tier_tokens(again) == engine.cache.block_size
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert tier.stats.checksum_failures == 2
        # a server without API keys may empty its device cache, never the shared tier
        assert httpx.post(open_srv.url + "/v1/cache/reset").status_code == 200
        r = httpx.post(open_srv.url + "/v1/cache/reset", json={"tier": True})
        assert r.status_code == 403 and "api-key" in r.json()["error"]["message"]
        assert client.exists(tier.key(a_keys[2]))
        r = httpx.post(srv.url + "/v1/cache/reset", json={"tier": True},
                       headers={"Authorization": "Bearer a"})
        assert r.status_code == 200 and r.json()["tier_blocks"] >= 3
    keyless.close()
    engine.close()


def test_hostile_snapshot_directory_never_stops_the_start(smollm2, tmp_path: Path) -> None:  # noqa: ANN001
    first = LLM(smollm2, kv_snapshot=str(tmp_path), **ENGINE)
    out = first.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6))[0]
    written = first.engine.snapshot()
    first.engine.close()
    folder = first.engine.tiers.snap.dir
    bad = [bytes([0xEE, i]) * 16 for i in range(4)]
    paths = [folder / k.hex()[:2] / (k.hex() + ".kvb") for k in bad]
    for p in paths:
        p.parent.mkdir(exist_ok=True)
    paths[0].write_bytes(deep_record())
    os.mkfifo(paths[1])
    paths[2].mkdir()
    paths[3].symlink_to("/dev/zero")
    started: list[LLM] = []
    t = threading.Thread(target=lambda: started.append(
        LLM(smollm2, kv_snapshot=str(tmp_path), **ENGINE)), daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive() and started, "the engine did not start"
    llm = started[0]
    assert written >= 5 and llm.engine.tiers.restored == written
    again = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6))[0]
    assert again.token_ids == out.token_ids and again.num_cached_tokens >= 64
    assert not paths[0].exists()  # the decodable-looking one was read and dropped
    llm.engine.close()


def test_int8_activations_replica_never_feeds_an_exact_one(smollm2, tmp_path: Path) -> None:  # noqa: ANN001
    greedy = SamplingParams(temperature=0, max_tokens=8)
    spec = f"disk:{tmp_path}"
    int8 = LLM(load_model(activations="int8"), kv_tier=spec, **ENGINE)
    int8_out = int8.generate([PROMPT], greedy)[0]
    flush(int8.engine)
    int8.engine.close()
    want = LLM(smollm2, enable_prefix_caching=False, **ENGINE).generate([PROMPT], greedy)[0]
    exact = LLM(smollm2, kv_tier=spec, **ENGINE)
    got = exact.generate([PROMPT], greedy)[0]
    assert got.num_tier_cached_tokens == 0 and got.token_ids == want.token_ids
    assert exact.engine.tiers.fp != int8.engine.tiers.fp
    assert int8_out.token_ids != want.token_ids or True  # (the int8 text may or may not differ)
    exact.engine.close()
