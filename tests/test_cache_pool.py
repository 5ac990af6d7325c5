"""BlockPool, FreeQueue and chained hashing: allocation order, ref counts, eviction, errors."""

from __future__ import annotations

import hashlib
from array import array

import pytest

from pagedkv.cache.block_pool import Block, BlockPool, FreeQueue
from pagedkv.cache.hashing import ROOT_HASH, block_hash, chain_hashes
from pagedkv.errors import DoubleFreeError, InvalidBlockError, OutOfBlocksError, PagedKVError


def queue_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def pool_state(pool: BlockPool) -> tuple:
    return (
        [(b.block_id, b.ref_cnt, b.hash, b.in_free_queue) for b in pool.blocks],
        queue_ids(pool),
        {h: b.block_id for h, b in pool.hash_to_block.items()},
        pool.num_cached_free, pool.allocations, pool.frees, pool.evictions,
    )


def h(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


# --- free queue -------------------------------------------------------------------------------


def test_free_queue_push_pop_remove_anywhere():
    q = FreeQueue()
    bs = [Block(i) for i in range(5)]
    for b in bs[1:4]:
        q.push_back(b)
    q.push_front(bs[0])
    q.push_back(bs[4])
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(bs[2])  # middle
    assert [b.block_id for b in q] == [0, 1, 3, 4]
    assert not bs[2].in_free_queue and bs[2].prev is None and bs[2].next is None
    assert q.pop_front() is bs[0]
    q.remove(bs[4])  # tail
    assert [b.block_id for b in q] == [1, 3] and len(q) == 2
    assert q.pop_front() is bs[1] and q.pop_front() is bs[3]
    assert list(q) == [] and len(q) == 0


# --- allocation -------------------------------------------------------------------------------


def test_all_blocks_preallocated_and_free():
    pool = BlockPool(8)
    assert len(pool.blocks) == 8 and pool.num_free == 8
    assert queue_ids(pool) == list(range(8))
    assert all(b.ref_cnt == 0 and b.hash is None for b in pool.blocks)
    pool.check_invariants()


def test_allocate_exact_ids_in_order():
    pool = BlockPool(8)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert [b.block_id for b in pool.allocate(2)] == [3, 4]
    assert [b.ref_cnt for b in pool.blocks] == [1, 1, 1, 1, 1, 0, 0, 0]
    assert pool.num_free == 3 and pool.allocations == 5
    assert pool.allocate(0) == []
    pool.check_invariants()


def test_allocate_beyond_capacity_is_typed_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    before = pool_state(pool)
    with pytest.raises(OutOfBlocksError) as ei:
        pool.allocate(2)
    assert ei.value.needed == 2 and ei.value.available == 1
    assert isinstance(ei.value, MemoryError) and isinstance(ei.value, PagedKVError)
    assert "2" in str(ei.value) and "1" in str(ei.value)
    assert pool_state(pool) == before
    pool.check_invariants()


def test_free_returns_unhashed_blocks_to_the_front():
    pool = BlockPool(6)
    a = pool.allocate(4)  # 0..3
    pool.free(reversed(a[1:3]))  # tail first: 2 then 1
    assert queue_ids(pool) == [1, 2, 4, 5]
    assert [b.ref_cnt for b in pool.blocks] == [1, 0, 0, 1, 0, 0]
    assert pool.frees == 2
    assert [b.block_id for b in pool.allocate(2)] == [1, 2]  # reused before untouched blocks
    pool.check_invariants()


def test_double_free_is_typed_and_all_or_nothing():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.free([b])
    before = pool_state(pool)
    with pytest.raises(DoubleFreeError):
        pool.free([a, b])  # a would be fine, b is already free
    assert pool_state(pool) == before and a.ref_cnt == 1
    with pytest.raises(DoubleFreeError):
        pool.free([a, a])  # one reference, freed twice in one call
    assert pool_state(pool) == before
    assert isinstance(DoubleFreeError("x"), ValueError)
    pool.check_invariants()


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_out_of_range_block_id_is_typed(bad):
    pool = BlockPool(4)
    with pytest.raises(InvalidBlockError):
        pool.block(bad)
    before = pool_state(pool)
    with pytest.raises(InvalidBlockError):
        pool.free_ids([bad])
    assert pool_state(pool) == before
    assert isinstance(InvalidBlockError("x"), IndexError)


def test_free_ids_and_ref_counts():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    pool.touch(b)
    assert b.ref_cnt == 2
    pool.free_ids([0])
    assert b.ref_cnt == 1 and not b.in_free_queue and pool.num_free == 3
    pool.free_ids([0])
    assert b.ref_cnt == 0 and b.in_free_queue and pool.num_free == 4
    pool.check_invariants()


# --- hashes, caching and eviction -------------------------------------------------------------


def test_hashed_blocks_go_to_the_back_lru_and_are_evicted_lazily():
    pool = BlockPool(6)
    blocks = pool.allocate(3)  # 0, 1, 2
    for i, b in enumerate(blocks[:2]):
        pool.set_hash(b, h(i))
    pool.free(reversed(blocks))  # 2 (no hash) front, then 1, 0 to the back
    assert queue_ids(pool) == [2, 3, 4, 5, 1, 0]
    assert pool.num_cached_free == 2 and pool.num_free == 6
    assert pool.lookup(h(0)) is blocks[0] and blocks[0].hash == h(0)  # still reusable
    got = [b.block_id for b in pool.allocate(5)]  # the 4 plain ones, then evicts block 1
    assert got == [2, 3, 4, 5, 1]
    assert pool.evictions == 1 and pool.lookup(h(1)) is None and blocks[1].hash is None
    assert pool.num_cached_free == 1 and pool.lookup(h(0)) is blocks[0]
    pool.check_invariants()


def test_touch_revives_a_cached_block():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.set_hash(b, h(7))
    pool.free([b])
    assert b.in_free_queue and pool.num_cached_free == 1
    pool.touch(b)
    assert b.ref_cnt == 1 and not b.in_free_queue and pool.num_cached_free == 0
    assert pool.num_free == 2 and b.hash == h(7)
    pool.check_invariants()


def test_set_hash_does_not_merge_duplicates():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.set_hash(a, h(1))
    pool.set_hash(b, h(1))
    assert b.hash is None and pool.lookup(h(1)) is a
    pool.set_hash(a, h(2))  # already hashed: unchanged
    assert a.hash == h(1) and pool.lookup(h(2)) is None
    pool.check_invariants()


def test_evict_lru_first_and_count():
    pool = BlockPool(5)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.set_hash(b, h(i))
    pool.free([blocks[3], blocks[1]])  # freed first: evicted first
    pool.free([blocks[0]])
    assert pool.evict(1) == 1
    assert blocks[3].hash is None and blocks[1].hash == h(1) and blocks[0].hash == h(0)
    assert pool.evict() == 2 and pool.evictions == 3
    assert pool.num_cached_free == 0 and blocks[2].hash == h(2)  # in use: kept
    assert pool.evict() == 0
    pool.check_invariants()


def test_reset_hashes_empties_the_index():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.set_hash(a, h(0))
    pool.set_hash(b, h(1))
    pool.free([b])
    pool.reset_hashes()
    assert pool.hash_to_block == {} and a.hash is None and b.hash is None
    assert pool.num_cached_free == 0 and a.ref_cnt == 1
    pool.check_invariants()


def test_drop_hash_of_cached_block_updates_count():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.set_hash(a, h(0))
    pool.free([a])
    pool.drop_hash(a)
    pool.drop_hash(a)  # idempotent
    assert pool.num_cached_free == 0 and pool.lookup(h(0)) is None
    pool.check_invariants()


def test_check_invariants_catches_corruption():
    pool = BlockPool(3)
    (a,) = pool.allocate(1)
    a.ref_cnt = 0  # used block that is not in the free queue
    with pytest.raises(AssertionError):
        pool.check_invariants()
    a.ref_cnt = 1
    pool.blocks[1].hash = h(9)  # hash missing from the index
    with pytest.raises(AssertionError):
        pool.check_invariants()


# --- hashing ----------------------------------------------------------------------------------


def test_block_hash_is_sha256_of_parent_and_int64_ids():
    want = hashlib.sha256(ROOT_HASH + array("q", [1, 2, 3]).tobytes()).digest()
    assert block_hash(ROOT_HASH, [1, 2, 3]) == want and len(want) == 32
    assert block_hash(ROOT_HASH, [1, 2, 3], "salt") != want
    assert block_hash(ROOT_HASH, [1, 2, 3], "salt") == block_hash(ROOT_HASH, [1, 2, 3], "salt")
    assert ROOT_HASH == hashlib.sha256(b"pagedkv-root").digest()


def test_chain_hashes_chain_full_blocks_only():
    toks = list(range(10))
    hs = chain_hashes(toks, 4)
    assert len(hs) == 2  # the partial tail (8, 9) has no hash
    assert hs[0] == block_hash(ROOT_HASH, [0, 1, 2, 3])
    assert hs[1] == block_hash(hs[0], [4, 5, 6, 7])
    assert chain_hashes(toks, 4, max_blocks=1) == hs[:1]
    # a change in an early block changes every later hash (the whole prefix is named)
    other = chain_hashes([9] + toks[1:], 4)
    assert other[0] != hs[0] and other[1] != hs[1]
    # the extra key salts the first block, and so the whole chain
    salted = chain_hashes(toks, 4, extra_key="tenant")
    assert salted[0] == block_hash(ROOT_HASH, [0, 1, 2, 3], "tenant")
    assert salted[1] == block_hash(salted[0], [4, 5, 6, 7])
    assert salted[1] != hs[1]
