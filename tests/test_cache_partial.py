"""Partial prefix hits: the first block a new sequence computes may start with tokens a cached
block under the same parent holds; those are copied into the new sequence's own fresh block and
count as cached (llama.cpp's slots and SGLang's radix tree reuse tokens, not blocks).

(The stateful machines in test_cache_stateful.py / test_kv_quant_stateful.py check that every
hit, partial ones included, reads back exactly what the original writer wrote.)"""

from __future__ import annotations

import pytest
from cache_snapshot import same_state, snapshot
from hypothesis import given
from hypothesis import strategies as st
from test_cache_manager import make, read_values, refs, write_positions

from pagedkv.cache import PagedKVCache
from pagedkv.cache.block_pool import PARTIAL_SCAN
from pagedkv.errors import OutOfBlocksError


def written(c: PagedKVCache, sid: str, ids: list[int]) -> None:
    """Create sid and write 100 * its id + position at every position (ids differ per test)."""
    c.create(sid, ids)
    write_positions(c, sid, 0, lambda p: 1000 + p)


def test_partial_hit_copies_the_leading_tokens_into_a_private_block():
    c = make(16, 4)
    written(c, "a", list(range(10)))  # blocks [0-3] [4-7] registered, [8 9] partial
    b = [0, 1, 2, 3, 4, 5, 77, 88]
    assert c.lookup(b) == 6
    assert c.create("b", b) == 6  # block 0 whole, then 4 5 of block [4-7]
    assert c.block_ids("b")[0] == c.block_ids("a")[0]
    assert c.block_ids("b")[1] not in c.block_ids("a")  # a private copy, never shared
    assert refs(c, "a") == [2, 1, 1] and refs(c, "b") == [2, 1]
    write_positions(c, "b", 6, lambda p: 2000 + p)
    assert read_values(c, "b") == [1000, 1001, 1002, 1003, 1004, 1005, 2006, 2007]
    assert read_values(c, "a") == [1000 + p for p in range(10)]  # the source is untouched
    st = c.stats()
    assert (st.prefix_hits, st.partial_hits) == (6, 2)
    c.check_invariants()


def test_the_last_token_is_computed_and_an_equal_block_is_not_registered_twice():
    c = make(16, 4)
    written(c, "a", list(range(8)))
    assert c.create("b", list(range(8))) == 7
    write_positions(c, "b", 7, lambda p: 5000 + p)
    assert read_values(c, "b") == [1000 + p for p in range(7)] + [5007]
    h = c.seq("b").chain.hashes[1]  # b's block 1 equals a's: a keeps the hash
    assert c._pool.hash_to_block[h].block_id == c.block_ids("a")[1]
    assert c._pool.blocks[c.block_ids("b")[1]].hash is None
    c.check_invariants()


def test_generated_tokens_serve_the_same_prompt_again():
    """The chat-benchmark case: a prompt is sent again; its tail block, filled up by the first
    answer's tokens, serves every prompt token but the last."""
    c = make(16, 4)
    prompt = list(range(10))
    written(c, "a", prompt)
    c.append("a", [50, 51])  # decode: block [8 9 50 51] fills and is registered
    c.free("a")
    assert c.create("again", prompt) == 9
    c.check_invariants()


def test_tenants_never_share_a_partial_block():
    c = make(16, 4)
    written(c, "a", list(range(8)))
    assert c.lookup([0, 1, 2, 9], extra_key="tenant-b") == 0  # block 0: salted parent key
    assert c.create("b", [0, 1, 2, 9], extra_key="tenant-b") == 0
    assert c.create("c", [0, 1, 2, 9]) == 3
    c.create("e", list(range(8)), extra_key="tenant-b")
    write_positions(c, "e", 0, lambda p: 3000 + p)
    assert c.create("f", [0, 1, 2, 3, 4, 5, 6], extra_key="tenant-b") == 6  # its own tenant's
    assert read_values(c, "f")[:6] == [3000 + p for p in range(6)]
    c.check_invariants()


def test_an_evicted_block_is_no_longer_a_partial_hit():
    c = make(16, 4)
    written(c, "a", list(range(8)))
    c.free("a")
    assert c.lookup([0, 1, 2, 3, 4, 5, 9]) == 6
    c.evict()
    assert c.lookup([0, 1, 2, 3, 4, 5, 9]) == 0
    assert not c._pool.children
    c.check_invariants()


def test_source_block_reallocated_to_the_new_sequence_still_copies_right():
    """The allocation evicts the least recently freed cached block: here the very block the
    partial hit reads. Its data is read before anything writes to it."""
    c = make(2, 4)
    written(c, "a", list(range(8)))
    src = c.block_ids("a")[1]
    c.free("a")  # freed tail first: block 1 is at the queue's front
    assert c.create("b", [0, 1, 2, 3, 4, 5, 9]) == 6
    assert c.block_ids("b")[1] == src  # it became b's block (evicted, so no longer cached)
    assert read_values(c, "b")[:6] == [1000 + p for p in range(6)]
    assert c._pool.blocks[src].hash is None
    c.check_invariants()


def test_failed_create_with_a_partial_candidate_changes_nothing():
    c = make(3, 4)
    written(c, "a", list(range(8)))
    before = snapshot(c)
    with pytest.raises(OutOfBlocksError):
        c.create("b", [0, 1, 2, 3, 4, 5, 6, 9, 9, 9])  # needs 2 fresh blocks, 1 free
    assert same_state(before, snapshot(c))
    c.check_invariants()


def test_many_children_of_one_parent_stay_bounded_and_correct():
    """A hostile client can register thousands of blocks under one parent (one shared prefix,
    then every possible next block): a lookup compares only the most recent PARTIAL_SCAN."""
    c = make(PARTIAL_SCAN * 3 + 4, 2)
    for j in range(PARTIAL_SCAN * 3):
        c.create(j, [7, 7, j, j])  # block [j j] under block [7 7]
    assert len(c._pool.children[c.seq(0).chain.hashes[0]]) == PARTIAL_SCAN * 3
    recent = PARTIAL_SCAN * 3 - 1
    assert c.lookup([7, 7, recent, 5]) == 3
    assert c.lookup([7, 7, 0, 5]) == 2  # too old to be compared: block [7 7] only
    c.check_invariants()


def test_bookkeeping_only_cache_counts_partial_hits_too():
    c = PagedKVCache(8, 4)  # no storage: nothing to copy
    c.create("a", list(range(8)))
    assert c.create("b", list(range(6)) + [9]) == 6
    c.check_invariants()


def test_prefix_caching_off_has_no_partial_hits():
    c = make(8, 4, enable_prefix_caching=False)
    c.create("a", list(range(8)))
    assert c.create("b", list(range(8))) == 0 and not c._pool.children


# --- a freed sequence's partial last block -----------------------------------------------------


def test_a_freed_sequences_partial_last_block_serves_its_written_tokens():
    c = make(16, 4)
    written(c, "a", list(range(10)))  # blocks [0-3] [4-7] full, [8 9] partial
    c.free("a")
    assert c.stats().cached_blocks == 3
    assert c.create("b", list(range(10)) + [77]) == 10  # 8 whole, then 8 9 from a's last block
    write_positions(c, "b", 10, lambda p: 2000 + p)
    assert read_values(c, "b") == [1000 + p for p in range(10)] + [2010]
    assert c.create("c", list(range(9)) + [55, 66]) == 9
    c.check_invariants()


def test_the_next_turn_of_a_conversation_reuses_the_whole_context():
    """The prompt, then the answer's tokens (decoded one by one): the next turn's prompt starts
    with all of them and is served from the cache up to its new tokens."""
    c = make(16, 4)
    prompt = [5, 6, 7, 8, 9, 10]
    written(c, "t1", prompt)
    for tok in (20, 21, 22):  # decode: each token's K/V written in its step
        c.append("t1", [tok])
        write_positions(c, "t1", c.num_tokens("t1") - 1, lambda p: 1000 + p)
    c.free("t1")  # 9 tokens written: [5 6 7 8] [9 10 20 21] [22]
    turn2 = prompt + [20, 21, 22, 30, 31, 32]
    assert c.create("t2", turn2) == 9
    assert read_values(c, "t2")[:9] == [1000 + p for p in range(9)]
    c.check_invariants()


def test_partial_blocks_are_kept_only_when_safe():
    c = make(32, 4)
    written(c, "a", list(range(6)))
    c.fork("a", "b")
    c.free("a")  # the last block is b's too: nothing kept
    assert c.lookup(list(range(6)) + [9]) == 4  # b's live partial block is no source
    c.free("b")  # now b's alone: kept
    assert c.lookup([0, 1, 2, 3, 4, 5, 9]) == 6
    c.evict()
    c.create("bare", 6)  # a bare count: no ids, nothing to index
    c.free("bare")
    assert c.stats().cached_blocks == 0
    c.create("uncomputed", list(range(6)), computed=False)  # no K/V written: nothing kept
    c.free("uncomputed")
    assert c.stats().cached_blocks == 0
    written(c, "edited", list(range(10)))
    c.remove("edited", 1, 2)  # edits from block 0 on: never hashed, never kept
    c.free("edited")
    assert c.stats().cached_blocks == 0 and not c._pool.children
    off = make(8, 4, enable_prefix_caching=False)
    off.create("a", list(range(6)))
    off.free("a")
    assert off.stats().cached_blocks == 0
    c.check_invariants()


def test_a_partial_block_is_never_a_whole_hit_nor_exported():
    c = make(16, 4)
    written(c, "a", [1, 2, 3])
    c.free("a")
    (b,) = [b for b in c._pool.blocks if b.partial]
    assert c.cached_blocks() == []  # a warm-restart snapshot holds whole blocks only
    assert c.lookup([1, 2, 3, 4, 5]) == 3
    assert c.create("x", [1, 2, 3, 4, 5]) == 3
    assert b.ref_cnt == 0 and b.partial  # copied from, never shared
    c.check_invariants()


def test_partial_blocks_record_no_kv_events():
    """Stored / removed events name whole blocks (what a router matches prompts against)."""
    from pagedkv.cache.kv_events import KVEventRecorder, Removed, Stored

    c = make(16, 4)
    rec = KVEventRecorder(4)
    c.attach_events(rec)
    written(c, "a", list(range(6)))
    c.free("a")  # block [4 5] kept as a partial block: no event
    c.evict()
    events = rec.take()
    assert [type(e) for e in events] == [Stored, Removed]
    assert [len(e.hashes) for e in events] == [1, 1]


def test_a_hybrid_create_revives_every_groups_hits_before_allocating():
    """Every group's hits leave the free queue before any group allocates: here the pool holds
    only cached blocks, and group 1's hit is the first in line to be evicted (found by the
    hybrid machine once freed sequences kept their partial blocks cached)."""
    from pagedkv.cache import KVStorage
    from pagedkv.cache.groups import KVGroups

    groups = KVGroups((None, None), ((0, 1), (2, 3)), 2)
    c = PagedKVCache(4, 2, storage=KVStorage(2, 4, 2, 1, 2), groups=groups)
    c.create("a", [1, 2])
    c.create("c", [5, 6])
    c.free("a")
    c.free("c")  # queue: a's group 0, a's group 1, c's blocks: all cached
    assert c.create("b", [1, 2, 9]) == 2
    assert c.block_ids("b", 0)[0] != c.block_ids("b", 1)[1]
    assert len({c.block_ids("b", g)[j] for g in (0, 1) for j in (0, 1)}) == 4
    c.check_invariants()


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=17),
       st.lists(st.integers(-(2**63), 2**63 - 1), max_size=17), st.integers(0, 17))
def test_common_run_of_two_id_strings(a: list[int], b: list[int], shared: int) -> None:
    """The pool's comparison of packed ids equals a plain walk over the ids."""
    from array import array

    from pagedkv.cache.block_pool import _common

    b = a[:shared] + b  # often a long common run
    want = 0
    while want < min(len(a), len(b)) and a[want] == b[want]:
        want += 1
    assert _common(array("q", a).tobytes(), array("q", b).tobytes()) == want
