"""The block map snapshot (pagedkv/cache/block_map.py) against stats() and the block tables."""

from __future__ import annotations

import json

import numpy as np
from cache_snapshot import same_state, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.cache import PagedKVCache
from pagedkv.cache.block_map import State, block_map, rle, unrle
from pagedkv.errors import OutOfBlocksError


def check_against_cache(cache: PagedKVCache) -> None:
    """Everything the map says follows from the pool and the tables, and matches stats()."""
    before = snapshot(cache)
    m = block_map(cache)
    assert same_state(before, snapshot(cache)), "block_map changed the cache"
    st_ = cache.stats()
    c = m.counts()
    assert c["free"] + c["cached"] == st_.free_blocks
    assert c["cached"] == st_.cached_blocks
    assert c["owned"] + c["shared"] == st_.used_blocks
    assert int(m.fill.sum()) == st_.live_tokens
    for name, value in m.summary.items():
        assert value == getattr(st_, name), name
    holders: dict[int, list[int]] = {}
    for i, sid in enumerate(m.owners):
        for b in cache.block_ids(sid):
            holders.setdefault(b, []).append(i)
    for b in range(cache.num_blocks):
        h = holders.get(b, [])
        assert m.refs[b] == len(h)
        if len(h) == 1:
            assert m.state[b] == State.OWNED and m.owner[b] == h[0]
        else:
            assert m.owner[b] == -1
            assert m.state[b] == (State.SHARED if h else m.state[b])
    js = json.loads(json.dumps(m.to_json()))
    assert unrle(js["states"]).tolist() == m.state.tolist()
    assert unrle(js["owner"]).tolist() == m.owner.tolist()
    assert js["counts"] == c


def test_rle_round_trip() -> None:
    a = np.array([0, 0, 2, 2, 2, 1, 0, 3, 3], np.uint8)
    assert rle(a) == [0, 2, 2, 3, 1, 1, 0, 1, 3, 2]
    assert unrle(rle(a)).tolist() == a.tolist()
    assert rle(np.array([], np.int32)) == []


def test_fork_shows_shared_blocks() -> None:
    cache = PagedKVCache(16, 4)
    cache.create("a", list(range(10)))  # 3 blocks, the last one partly filled
    cache.fork("a", "b")
    m = block_map(cache)
    shared = cache.block_ids("a")
    assert m.state[shared].tolist() == [State.SHARED] * 3
    assert m.refs[shared].tolist() == [2, 2, 2]
    assert m.counts() == {"free": 13, "cached": 0, "owned": 0, "shared": 3}
    cache.append("b", [99])  # copy-on-write of the shared last block
    m = block_map(cache)
    assert m.state[cache.block_ids("b")[-1]] == State.OWNED
    assert m.owner[cache.block_ids("b")[-1]] == m.owners.index("b")
    assert m.state[cache.block_ids("a")[-1]] == State.OWNED
    assert m.summary["cow_copies"] == 1
    check_against_cache(cache)


def test_after_all_finish_nothing_is_owned() -> None:
    cache = PagedKVCache(32, 4)
    for i in range(5):
        cache.create(i, [7] * 8 + [i] * (3 + i))  # shared 8-token prefix, then its own tokens
    cache.fork(0, "f")
    assert block_map(cache).counts()["shared"] > 0
    for sid in list(cache.seqs):
        cache.free(sid)
    m = block_map(cache)
    c = m.counts()
    assert c["owned"] == c["shared"] == 0
    assert c["cached"] > 0  # the full blocks stay as a prefix cache
    assert (m.owner == -1).all() and m.owners == []
    check_against_cache(cache)


def test_labels_name_the_owners() -> None:
    cache = PagedKVCache(8, 4)
    cache.create(3, [1, 2, 3])
    m = block_map(cache, label=lambda sid: f"req-{sid}")
    assert m.owners == ["req-3"]
    assert m.to_json()["owners"] == ["req-3"]


def test_large_pool_is_compact() -> None:
    cache = PagedKVCache(100_000, 16, enable_prefix_caching=False)
    for i in range(200):
        cache.create(i, 16 * 40 + i)
    js = json.dumps(block_map(cache).to_json())
    assert len(js) < 20_000
    check_against_cache(cache)


ops = st.lists(
    st.tuples(st.sampled_from(["create", "append", "fork", "free", "truncate", "defrag"]),
              st.integers(0, 5), st.integers(1, 9)),
    max_size=30,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_random_operations_match_stats(steps: list[tuple[str, int, int]]) -> None:
    cache = PagedKVCache(12, 4)
    for op, sid, k in steps:
        live = list(cache.seqs)
        try:
            if op == "create" and sid not in cache:
                cache.create(sid, [sid % 2] * k)  # two prompt families: prefix hits
            elif op == "append" and sid in cache:
                cache.append(sid, [k] * k)
            elif op == "fork" and sid in cache and sid + 10 not in cache:
                cache.fork(sid, sid + 10)
            elif op == "free" and live:
                cache.free(live[sid % len(live)])
            elif op == "truncate" and sid in cache:
                cache.truncate(sid, min(k, cache.num_tokens(sid)))
            elif op == "defrag":
                cache.defragment()
        except OutOfBlocksError:
            pass
        check_against_cache(cache)
