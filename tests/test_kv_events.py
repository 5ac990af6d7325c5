"""KV cache events (vLLM's wire format): config validation, the cache's events replayed by a
subscriber with vLLM's schema equal the cache's cached blocks after every operation (property
test), and the engine publishing over a real ZeroMQ socket (replay, tiers, privacy)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kv_event_subscriber import DECODER, BlockSets, BlockStored, Subscriber

from pagedkv.cache import PagedKVCache
from pagedkv.cache.hashing import chain_hashes
from pagedkv.cache.kv_events import KVEventRecorder
from pagedkv.engine import EngineConfig, LLMEngine, SamplingParams
from pagedkv.engine.kv_events import encode_batch, external_hash, parse_config
from pagedkv.errors import (
    KVEventsConfigError,
    OutOfBlocksError,
    PagedKVError,
    UnknownOptionError,
)

# --- config --------------------------------------------------------------------------------------


def test_config_defaults_are_vllms():
    c = parse_config('{"enable_kv_cache_events": true}')
    assert (c.publisher, c.endpoint, c.replay_endpoint, c.buffer_steps, c.hwm, c.max_queue_size,
            c.topic) == ("zmq", "tcp://*:5557", None, 10_000, 100_000, 100_000, "")
    assert parse_config("{}").publisher == "null" and not parse_config("{}").enabled
    assert parse_config(None) is None


@pytest.mark.parametrize(("text", "names"), [
    ('{"enable_kv_cache_event": true}', "did you mean 'enable_kv_cache_events'"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events"),
    ('{"publisher": "kafka"}', "publisher"),
    ('{"endpoint": "http://x:1"}', "endpoint"),
    ('{"endpoint": "tcp://*:70000"}', "endpoint"),
    ('{"replay_endpoint": 5}', "replay_endpoint"),
    ('{"hwm": 0}', "hwm"),
    ('{"buffer_steps": true}', "buffer_steps"),
    ('{"max_queue_size": -1}', "max_queue_size"),
    ('{"topic": 3}', "topic"),
    ("[1]", "JSON object"),
    ("{", "not valid JSON"),
])
def test_config_errors_name_the_key(text, names):
    with pytest.raises(KVEventsConfigError, match=names):
        parse_config(text)


def test_engine_config_checks_before_loading():
    with pytest.raises(KVEventsConfigError, match="endpoint"):
        EngineConfig(kv_events_config={"enable_kv_cache_events": True, "endpoint": "x"})
    with pytest.raises(KVEventsConfigError, match="prefix caching"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true}',
                     enable_prefix_caching=False)
    with pytest.raises(UnknownOptionError, match="kv_events_config"):
        EngineConfig.build(kv_event_config="{}")


def test_cli_flag_spelling():
    import argparse

    from pagedkv.options import add_arguments, cli_spelling, from_namespace

    p = argparse.ArgumentParser()
    add_arguments(p, EngineConfig)
    args = p.parse_args(["--kv-events-config", '{"enable_kv_cache_events": true, "hwm": 0}'])
    with pytest.raises(KVEventsConfigError) as e:
        from_namespace(EngineConfig, args)
    cli_spelling(e.value, EngineConfig)
    assert str(e.value).startswith("--kv-events-config: hwm")


# --- the cache's events, replayed with vLLM's schema ---------------------------------------------

BS = 4
DOCS = [[100 * d + i for i in range(12)] for d in range(3)]
SALTS = [None, "tenant-a", "tenant-b"]

ops = st.one_of(
    st.tuples(st.just("create"), st.integers(0, 2), st.integers(0, 2), st.integers(0, 9)),
    st.tuples(st.just("free"), st.integers(0, 50)),
    st.tuples(st.just("append"), st.integers(0, 50), st.integers(1, 6)),
    st.tuples(st.just("truncate"), st.integers(0, 50), st.integers(0, 20)),
    st.tuples(st.just("fork"), st.integers(0, 50)),
    st.tuples(st.just("evict"), st.integers(1, 4)),
    st.tuples(st.just("reset")),
)


def _gpu(cache: PagedKVCache) -> set[int]:
    return {external_hash(h) for h, _ in cache.cached_blocks()}


def _make_cache(kind: str) -> PagedKVCache:
    if kind == "plain":
        return PagedKVCache(14, BS)
    from pagedkv.cache import KVStorage
    from pagedkv.cache.groups import KVGroups

    # a hybrid cache: a full-attention group and a 6-token sliding-window group (Gemma 3's
    # shape), each block registered under its group's key
    groups = KVGroups((None, 6), ((0, 1), (2, 3)), 2)
    return PagedKVCache(14, BS, storage=KVStorage(2, 14, BS, 1, 4), groups=groups)


@pytest.mark.parametrize("kind", ["plain", "hybrid"])
@settings(max_examples=100, deadline=None)
@given(program=st.lists(ops, max_size=30))
def test_replayed_events_equal_the_cached_blocks(kind, program):
    cache = _make_cache(kind)
    rec = KVEventRecorder(BS)
    cache.attach_events(rec)
    sets = BlockSets()
    live: list[int] = []
    n = 0
    for op in program:
        if op[0] == "create":
            ids = DOCS[op[1]] + [7000 + n + j for j in range(op[3])]
            got = cache.try_create(n, ids, extra_key=SALTS[op[2]])
            if not isinstance(got, OutOfBlocksError):
                live.append(n)
            n += 1
        elif op[0] == "evict":
            cache.evict(op[1])
        elif op[0] == "reset":
            cache.reset_prefix_cache()
        elif live:
            try:
                _seq_op(cache, op, live, n)
            except PagedKVError:
                pass  # refused (no room, or not for a window group): nothing changed
            n += 1
        batch = DECODER.decode(encode_batch(time.time(), rec.take(), BS))
        sets.apply(batch)
        assert sets.of("GPU") == _gpu(cache), op
    for ev in sets.stored_events:
        assert ev.block_size == BS and ev.medium == "GPU" and ev.lora_id is None
        if ev.token_ids:
            assert len(ev.token_ids) == BS * len(ev.block_hashes)


def _seq_op(cache: PagedKVCache, op: tuple, live: list[int], n: int) -> None:
    """free / append / truncate / fork on one live sequence (`n`: a fresh id)."""
    sid = live[op[1] % len(live)]
    if op[0] == "free":
        cache.free(sid)
        live.remove(sid)
    elif op[0] == "append":
        cache.append(sid, [9000 + n + j for j in range(op[2])])
    elif op[0] == "truncate":
        cache.truncate(sid, min(op[2], cache.num_tokens(sid)))
    elif op[0] == "fork":
        cache.fork(sid, n)
        live.append(n)


def test_stored_events_carry_the_chain_and_withhold_salted_tokens():
    cache = PagedKVCache(32, BS)
    rec = KVEventRecorder(BS)
    cache.attach_events(rec)
    ids = DOCS[0] + [1, 2]
    cache.create("plain", ids)
    cache.create("salted", ids, extra_key="tenant-a")
    sets = BlockSets()
    sets.apply(DECODER.decode(encode_batch(1.0, rec.take(), BS)))
    plain, salted = sets.stored_events
    assert plain.block_hashes == [external_hash(h) for h in chain_hashes(ids, BS)]
    assert plain.parent_block_hash is None and plain.token_ids == ids[:12]
    assert salted.block_hashes == [external_hash(h) for h in chain_hashes(ids, BS, "tenant-a")]
    assert salted.token_ids == []  # a router never sees a tenant's tokens
    assert not set(salted.block_hashes) & set(plain.block_hashes)
    cache.append("plain", [3, 4])  # block 3 fills: its parent is block 2
    (more,) = [e for e in DECODER.decode(encode_batch(1.0, rec.take(), BS)).events]
    assert isinstance(more, BlockStored)
    assert more.parent_block_hash == plain.block_hashes[-1] and more.token_ids == [1, 2, 3, 4]


def test_wire_layout_is_vllms():
    """Outer batch: positional [ts, events, rank]; each event a map tagged by "type"."""
    import msgpack

    cache = PagedKVCache(8, BS)
    rec = KVEventRecorder(BS)
    cache.attach_events(rec)
    cache.create(0, [1, 2, 3, 4, 5])
    cache.free(0)
    cache.evict()
    cache.reset_prefix_cache()
    rec.cleared()
    ts, events, rank = msgpack.unpackb(encode_batch(12.5, rec.take(), BS))
    assert ts == 12.5 and rank == 0
    assert events[0] == {"type": "BlockStored", "block_hashes": events[0]["block_hashes"],
                         "parent_block_hash": None, "token_ids": [1, 2, 3, 4], "block_size": BS,
                         "lora_id": None, "medium": "GPU", "lora_name": None}
    assert 0 <= events[0]["block_hashes"][0] < 2**64
    assert events[1] == {"type": "BlockRemoved", "block_hashes": events[0]["block_hashes"],
                         "medium": "GPU"}
    assert events[2] == {"type": "AllBlocksCleared"}


# --- the engine over a real ZeroMQ socket ---------------------------------------------------------


def _config(tmp_path: Path, **extra) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                       "endpoint": f"ipc://{tmp_path}/pub", "topic": "kv-events",
                       "replay_endpoint": f"ipc://{tmp_path}/replay", **extra})


def _prompts(tok, n: int) -> list[str]:
    doc = ("The paged KV cache keeps every sequence in fixed-size blocks. " * 6).strip()
    return [f"Document {i % 4}: {doc} Question {i}: what is block {i}?" for i in range(n)]


def _wait_equal(engine: LLMEngine, sub: Subscriber) -> None:
    engine.kv_events.publisher.flush()
    sub.poll()
    assert sub.sets.of("GPU") == _gpu(engine.cache)


def test_engine_events_over_zmq_equal_the_cache(smollm2, tmp_path):
    engine = LLMEngine(smollm2, num_blocks=16, block_size=16, kv_events_config=_config(tmp_path))
    sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", "kv-events")
    try:
        time.sleep(0.2)  # PUB/SUB connect; anything missed comes back through the replay
        sub.replay(0)
        params = SamplingParams(max_tokens=2, temperature=0)
        for i, p in enumerate(_prompts(smollm2.tokenizer, 6)):
            engine.add_request(f"r{i}", p, params)
            if i % 2:
                while engine.has_unfinished_requests():
                    engine.step()
                _wait_equal(engine, sub)  # a quiet point
        assert engine.cache.stats().evictions > 0  # 16 blocks: the pool had to evict
        engine.reset_prefix_cache()
        _wait_equal(engine, sub)
        assert sub.sets.of("GPU") == set()
        st_ = engine.kv_events.stats()
        assert st_["events_published"] > 0 and st_["events_dropped"] == 0
        assert engine.stats().kv_events_published == st_["events_published"]
    finally:
        sub.close()
        engine.close()


def test_late_subscriber_replays_what_it_missed(smollm2, tmp_path):
    """A subscriber that joins after batches were sent (or whose batches ZeroMQ dropped past
    hwm) sees a gap in the sequence numbers and fetches it from the replay socket; the engine
    never waits for it."""
    engine = LLMEngine(smollm2, num_blocks=40, block_size=16,
                       kv_events_config=_config(tmp_path, hwm=4))
    sub = None
    try:
        params = SamplingParams(max_tokens=2, temperature=0)
        for i, p in enumerate(_prompts(smollm2.tokenizer, 4)):
            if i == 2:
                engine.kv_events.publisher.flush()
                sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay",
                                 "kv-events")
                time.sleep(0.2)
            engine.add_request(f"r{i}", p, params)
            while engine.has_unfinished_requests():
                engine.step()
        _wait_equal(engine, sub)
        assert sub.gaps == 1 and sub.batches == engine.kv_events.stats()["batches_published"]
    finally:
        if sub is not None:
            sub.close()
        engine.close()


def test_tier_events_and_tenant_privacy(smollm2, tmp_path):
    engine = LLMEngine(smollm2, num_blocks=64, block_size=16, kv_tier=f"disk:{tmp_path}/tier",
                       kv_events_config=_config(tmp_path))
    sub = Subscriber(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", "kv-events")
    try:
        time.sleep(0.2)
        prompt = _prompts(smollm2.tokenizer, 1)[0]
        engine.add_request("a", prompt, SamplingParams(max_tokens=2, temperature=0),
                           cache_salt="tenant-a")
        while engine.has_unfinished_requests():
            engine.step()
        engine.tiers.connector.writer.flush(timeout=10)
        _wait_equal(engine, sub)
        tier = engine.tiers.connector.tier
        assert sub.sets.of("DISK") == {external_hash(k) for k in tier.keys()} != set()
        assert sub.sets.stored_events and all(e.token_ids == [] for e in sub.sets.stored_events)
        # the device prefix cache emptied: the same prompt comes back from the tier
        engine.reset_prefix_cache()
        engine.add_request("b", prompt, SamplingParams(max_tokens=2, temperature=0),
                           cache_salt="tenant-a")
        while engine.has_unfinished_requests():
            engine.step()
        _wait_equal(engine, sub)
        assert engine.tier_stats()["hit_blocks"] > 0
        engine.reset_prefix_cache(tier=True)  # every medium: one AllBlocksCleared
        _wait_equal(engine, sub)
        assert sub.sets.media == {}
    finally:
        sub.close()
        engine.close()


def test_a_stalled_publisher_drops_and_counts_never_blocks(tmp_path):
    """The publisher thread stalls (here: a tier recorder that blocks it); the engine side's
    publish returns at once, the queue holds max_queue_size batches, the rest are dropped and
    counted; once the thread goes on, the queued batch is sent."""
    import threading

    from pagedkv.cache.kv_events import Stored
    from pagedkv.engine.kv_events import KVEventPublisher

    gate = threading.Event()

    class Stalling(KVEventRecorder):
        def take(self):  # noqa: ANN202
            gate.wait(10)
            return super().take()

    cfg = parse_config(_config(tmp_path, max_queue_size=1))
    pub = KVEventPublisher(cfg, BS, [Stalling(BS)])
    sub = Subscriber(cfg.endpoint, cfg.replay_endpoint, "kv-events")
    try:
        time.sleep(0.3)  # the thread is now waiting in the stalled take()
        ev = [Stored((b"\x01" * 32,), None, (1, 2, 3, 4), "GPU")]
        t0 = time.perf_counter()
        results = [pub.publish(ev) for _ in range(5)]
        assert time.perf_counter() - t0 < 0.1
        assert results == [True, False, False, False, False]
        assert pub.snapshot()["events_dropped"] == 4
        gate.set()
        pub.flush()
        sub.poll()
        assert sub.batches == 1 and sub.sets.of("GPU") == {external_hash(b"\x01" * 32)}
    finally:
        gate.set()
        sub.close()
        pub.close()
