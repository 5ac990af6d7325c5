"""PagedKVCache: sequences, slot mapping, fork + copy-on-write, prefix caching, truncate, stats,
defragmentation, invariants, and "a failed operation changes nothing"."""

from __future__ import annotations

import pytest
import torch
from cache_snapshot import same_state, snapshot

from pagedkv.cache import KVStorage, PagedKVCache, bytes_per_block
from pagedkv.cache.hashing import HashChain, chain_hashes
from pagedkv.errors import (
    CacheConfigError,
    DuplicateSequenceError,
    OutOfBlocksError,
    PagedKVError,
    PositionError,
    StorageMismatchError,
    UnknownSequenceError,
)

LAYERS, HEADS, DIM = 2, 2, 3


def refs(cache: PagedKVCache, seq_id) -> list[int]:
    return [cache._pool.blocks[i].ref_cnt for i in cache.block_ids(seq_id)]


def queue(cache: PagedKVCache) -> list[int]:
    return [b.block_id for b in cache._pool.free_queue]


def make(num_blocks: int = 16, block_size: int = 4, **kw) -> PagedKVCache:
    storage = KVStorage(LAYERS, num_blocks, block_size, HEADS, DIM)
    return PagedKVCache(num_blocks, block_size, storage=storage, **kw)


def write_positions(cache: PagedKVCache, seq_id, start: int, value_of) -> None:
    """Write value_of(pos) (+ layer, V negated) for positions [start, len) of seq_id."""
    n = cache.num_tokens(seq_id)
    slots = cache.slot_mapping([seq_id], n - start)
    base = torch.tensor([float(value_of(p)) for p in range(start, n)]).view(-1, 1, 1)
    for layer in range(LAYERS):
        k = (base + layer).expand(-1, HEADS, DIM).contiguous()
        cache.storage.write(layer, slots, k, -k)


def read_values(cache: PagedKVCache, seq_id, layer: int = 0) -> list[float]:
    out = []
    for p in range(cache.num_tokens(seq_id)):
        k, v = cache.storage.read(layer, cache.slot(seq_id, p))
        assert torch.equal(v, -k) and bool((k == k[0, 0]).all())
        out.append(float(k[0, 0]) - layer)
    return out


# --- configuration ----------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks, block_size", [(0, 4), (4, 0), (-1, 4), (4.0, 4)])
def test_bad_config_is_typed(num_blocks, block_size):
    with pytest.raises(CacheConfigError):
        PagedKVCache(num_blocks, block_size)


def test_storage_must_match_the_pool():
    with pytest.raises(StorageMismatchError):
        PagedKVCache(8, 4, storage=KVStorage(1, 9, 4, 1, 1))
    with pytest.raises(StorageMismatchError):
        PagedKVCache(8, 4, storage=KVStorage(1, 8, 2, 1, 1))


# --- sequences --------------------------------------------------------------------------------


def test_create_allocates_exact_blocks_and_counts():
    c = make(8, 4)
    assert c.create("a", list(range(10))) == 0
    assert c.block_ids("a") == [0, 1, 2]
    assert c.num_tokens("a") == 10 and "a" in c and "b" not in c
    assert c.block_token_counts("a") == [4, 4, 2]
    assert c.create("b", 4) == 0  # a bare count: unknown token ids
    assert c.block_ids("b") == [3] and c.block_token_counts("b") == [4]
    assert c.num_free_blocks == 4
    assert refs(c, "a") == [1, 1, 1]
    c.check_invariants()


def test_create_empty_sequence_then_grow():
    c = make(4, 4)
    c.create("e", [])
    assert c.block_ids("e") == [] and c.num_tokens("e") == 0
    c.append("e", [1])
    assert c.block_ids("e") == [0]
    c.check_invariants()


def test_append_grows_block_by_block():
    c = make(8, 4)
    c.create("a", [1, 2, 3])
    c.create("b", [9])
    assert c.block_ids("a") == [0] and c.block_ids("b") == [1]
    c.append("a", [4])
    assert c.block_ids("a") == [0] and c.block_token_counts("a") == [4]
    c.append("a", [5])
    assert c.block_ids("a") == [0, 2] and c.block_token_counts("a") == [4, 1]
    c.append("a", list(range(9)))  # 14 tokens
    assert c.block_ids("a") == [0, 2, 3, 4] and c.block_token_counts("a") == [4, 4, 4, 2]
    c.append("a", [])  # no-op
    assert c.num_tokens("a") == 14
    assert c.blocks_needed(3, "a") == 1 and c.blocks_needed(2, "a") == 0
    assert c.blocks_needed(9) == 3
    c.check_invariants()


def test_append_mixing_ids_and_counts_is_typed():
    c = make(8, 4)
    c.create("a", [1, 2])
    c.create("n", 2)
    with pytest.raises(CacheConfigError):
        c.append("a", 3)
    with pytest.raises(CacheConfigError):
        c.append("n", [1])
    with pytest.raises(PositionError):
        c.create("neg", -1)


def test_free_returns_blocks_tail_first():
    c = make(8, 4, enable_prefix_caching=False)
    c.create("a", list(range(10)))  # 0, 1, 2
    c.create("b", list(range(5)))  # 3, 4
    c.free("a")
    assert "a" not in c and c.num_free_blocks == 6
    # unhashed blocks go to the front, pushed tail first: the head block ends up first
    assert queue(c) == [0, 1, 2, 5, 6, 7]
    c.create("c", [1] * 5)
    assert c.block_ids("c") == [0, 1]
    c.check_invariants()


def test_truncate_returns_blocks_past_the_end():
    c = make(8, 4)
    c.create("a", list(range(14)))  # 0..3
    c.truncate("a", 6)
    assert c.block_ids("a") == [0, 1] and c.num_tokens("a") == 6
    assert c.block_token_counts("a") == [4, 2]
    assert c.num_free_blocks == 6
    assert c.seq("a").token_ids == list(range(6))
    c.truncate("a", 6)  # same length: no-op
    c.truncate("a", 0)
    assert c.block_ids("a") == [] and c.num_free_blocks == 8
    c.append("a", [7, 7])
    assert c.num_tokens("a") == 2
    c.check_invariants()


def test_unknown_sequences_are_typed_errors():
    c = make(8, 4)
    c.create("a", [1, 2])
    calls = [
        lambda: c.append("x", [1]), lambda: c.free("x"), lambda: c.truncate("x", 0),
        lambda: c.fork("x", "y"), lambda: c.slot("x", 0), lambda: c.num_tokens("x"),
        lambda: c.block_ids("x"), lambda: c.block_token_counts("x"),
        lambda: c.slot_mapping(["a", "x"], 1), lambda: c.block_tables(["x"]),
        lambda: c.decode_tensors(["a", "x"]), lambda: c.append_one_each(["a", "x"], [1, 2]),
        lambda: c.mark_computed("x", 0), lambda: c.blocks_needed(1, "x"),
        lambda: c.seq(["unhashable"]),
    ]
    before = snapshot(c)
    for call in calls:
        with pytest.raises(UnknownSequenceError) as ei:
            call()
        assert isinstance(ei.value, KeyError) and isinstance(ei.value, PagedKVError)
        assert str(ei.value).startswith("unknown sequence")
    assert same_state(snapshot(c), before)


def test_duplicate_sequences_are_typed_errors():
    c = make(8, 4)
    c.create("a", [1, 2])
    c.create("b", [3])
    before = snapshot(c)
    with pytest.raises(DuplicateSequenceError):
        c.create("a", [5])
    with pytest.raises(DuplicateSequenceError):
        c.fork("a", "b")
    with pytest.raises(DuplicateSequenceError):
        c.fork("a", "a")
    assert same_state(snapshot(c), before)


def test_positions_past_the_end_are_typed_errors():
    c = make(8, 4)
    c.create("a", [1, 2, 3])
    before = snapshot(c)
    for bad in (3, 10, -1):
        with pytest.raises(PositionError):
            c.slot("a", bad)
    with pytest.raises(PositionError):
        c.truncate("a", 4)
    with pytest.raises(PositionError):
        c.truncate("a", -1)
    with pytest.raises(PositionError):
        c.slot_mapping(["a"], 4)
    with pytest.raises(PositionError):
        c.mark_computed("a", 4)
    assert isinstance(PositionError("x"), IndexError)
    assert same_state(snapshot(c), before)


# --- slot mapping and batched tensors ---------------------------------------------------------


def test_slot_is_block_id_times_block_size_plus_offset():
    c = make(8, 4)
    c.create("x", 1)  # takes block 0 (a bare count: nothing kept when freed)
    c.create("a", list(range(6)))  # blocks 1, 2
    assert [c.slot("a", p) for p in range(6)] == [4, 5, 6, 7, 8, 9]
    c.free("x")
    c.append("a", list(range(3)))  # 9 tokens: third block is block 0 (front of the queue)
    assert c.block_ids("a") == [1, 2, 0]
    assert c.slot("a", 8) == 0 * 4 + 0


def test_slot_mapping_and_block_tables_batched():
    c = make(16, 4)
    c.create("a", list(range(6)))  # 0, 1
    c.create("b", list(range(10, 19)))  # 2, 3, 4
    c.create("c", [1])  # 5
    sm = c.slot_mapping(["a", "b", "c"], [2, 3, 1])
    assert sm.dtype == torch.int64
    want = [c.slot("a", p) for p in (4, 5)] + [c.slot("b", p) for p in (6, 7, 8)] + [c.slot("c", 0)]
    assert sm.tolist() == want == [4, 5, 14, 15, 16, 20]
    assert c.slot_mapping(["b", "a"], 1).tolist() == [16, 5]
    assert c.slot_mapping(["a"], 0).tolist() == []
    assert c.slot_mapping([], 1).tolist() == []
    tables, lens = c.block_tables(["a", "b", "c"])
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32
    assert tables.tolist() == [[0, 1, 0], [2, 3, 4], [5, 0, 0]]
    assert lens.tolist() == [6, 9, 1]
    slots, t2, l2 = c.decode_tensors(["a", "b", "c"])
    assert slots.tolist() == c.slot_mapping(["a", "b", "c"], 1).tolist()
    assert torch.equal(t2, tables) and torch.equal(l2, lens)
    # the returned tensors are copies: later appends do not change them
    c.append("c", [1] * 5)
    assert tables.tolist()[2] == [5, 0, 0]


def test_decode_step_fast_path():
    c = make(16, 4)
    c.create("a", [1, 2, 3])
    c.create("b", [1, 2, 3, 4])
    c.append_one_each(["a", "b"], [7, 8])
    assert c.seq("a").token_ids == [1, 2, 3, 7] and c.seq("b").token_ids == [1, 2, 3, 4, 8]
    assert c.block_ids("a") == [0] and c.block_ids("b") == [1, 2]
    # the block "a" just filled is hashed like any full computed block
    assert c._pool.blocks[0].hash == chain_hashes([1, 2, 3, 7], 4)[0]
    slots, tables, lens = c.decode_tensors(["a", "b"])
    assert slots.tolist() == [3, 8] and lens.tolist() == [4, 5]
    assert tables.tolist() == [[0, 0], [1, 2]]
    c.check_invariants()


def test_decode_step_bad_arguments_change_nothing():
    c = make(16, 4)
    c.create("a", [1, 2, 3])
    c.create("n", 3)
    c.create("z", [])
    before = snapshot(c)
    for call, err in [
        (lambda: c.append_one_each(["a"], [1, 2]), CacheConfigError),
        (lambda: c.append_one_each(["a", "a"], [1, 2]), CacheConfigError),
        (lambda: c.append_one_each(["a", "n"], [1, 2]), CacheConfigError),
        (lambda: c.append_one_each(["a", "q"], [1, 2]), UnknownSequenceError),
        (lambda: c.decode_tensors(["a", "z"]), PositionError),
    ]:
        with pytest.raises(err):
            call()
        assert same_state(snapshot(c), before)


# --- failed operations change nothing ---------------------------------------------------------


def test_failed_create_changes_nothing():
    c = make(4, 4)
    c.create("a", list(range(9)))  # 3 blocks
    before = snapshot(c)
    with pytest.raises(OutOfBlocksError) as ei:
        c.create("b", list(range(100, 109)))
    assert (ei.value.needed, ei.value.available) == (3, 1)
    assert same_state(snapshot(c), before) and "b" not in c
    c.check_invariants()


def test_failed_create_with_prefix_hit_counts_revived_blocks():
    c = make(4, 4)
    c.create("a", list(range(9)))  # blocks 0, 1 full + hashed, 2 partial
    c.free("a")  # 2 to the front; 1, 0 cached at the back
    c.create("x", [50, 51])  # takes block 2
    before = snapshot(c)
    # hits blocks 0 and 1 (reviving them) and needs 2 more, but only block 3 is left
    with pytest.raises(OutOfBlocksError) as ei:
        c.create("b", list(range(8)) + [60, 61, 62, 63, 64])
    assert (ei.value.needed, ei.value.available) == (2, 1)
    assert same_state(snapshot(c), before)
    c.check_invariants()


def test_failed_append_changes_nothing():
    c = make(4, 4)
    c.create("a", list(range(7)))  # 2 blocks
    c.create("b", [1])  # 1 block
    before = snapshot(c)
    with pytest.raises(OutOfBlocksError) as ei:
        c.append("a", list(range(6)))  # 13 tokens: 2 more blocks, 1 free
    assert (ei.value.needed, ei.value.available) == (2, 1)
    assert same_state(snapshot(c), before)
    c.check_invariants()


def test_failed_cow_append_changes_nothing():
    c = make(3, 4)
    c.create("a", [1, 2, 3, 4, 5])  # 0, 1 (partial)
    c.fork("a", "b")
    c.create("x", [9])  # takes the last free block
    before = snapshot(c)
    with pytest.raises(OutOfBlocksError) as ei:
        c.append("b", [6])  # needs a private copy of block 1
    assert (ei.value.needed, ei.value.available) == (1, 0)
    with pytest.raises(OutOfBlocksError):
        c.append_one_each(["a"], [6])
    assert same_state(snapshot(c), before)
    assert c.blocks_needed(1, "b") == 1
    c.check_invariants()


def test_failed_decode_step_changes_nothing():
    c = make(3, 4)
    c.create("a", [1, 2, 3, 4])
    c.create("b", [1, 2, 3, 4])
    c.create("c", [1, 2, 3])
    before = snapshot(c)
    with pytest.raises(OutOfBlocksError) as ei:
        c.append_one_each(["c", "a", "b"], [1, 2, 3])  # a and b both need a block
    assert (ei.value.needed, ei.value.available) == (2, 0)
    assert same_state(snapshot(c), before)


# --- fork and copy-on-write -------------------------------------------------------------------


def test_fork_shares_every_block():
    c = make(8, 4)
    c.create("a", list(range(6)))
    c.fork("a", "b")
    assert c.block_ids("b") == c.block_ids("a") == [0, 1]
    assert refs(c, "a") == [2, 2]
    assert c.num_tokens("b") == 6 and c.num_free_blocks == 6
    c.check_invariants()


def test_copy_on_write_isolates_writers_in_all_layers():
    c = make(8, 4)
    c.create("a", list(range(6)))  # blocks 0, 1 (partial)
    write_positions(c, "a", 0, lambda p: 10 + p)
    c.fork("a", "b")
    c.append("b", [100])  # first write into shared block 1: b gets a copy
    assert c.cow_copies == 1
    assert c.block_ids("a") == [0, 1] and c.block_ids("b") == [0, 2]
    assert refs(c, "a") == [2, 1] and refs(c, "b") == [2, 1]
    assert read_values(c, "b")[:6] == [10, 11, 12, 13, 14, 15]  # copied data
    write_positions(c, "b", 6, lambda p: 500)
    c.append("a", [7])  # a's block 1 is private again: written in place
    assert c.cow_copies == 1 and c.block_ids("a") == [0, 1]
    write_positions(c, "a", 6, lambda p: 300)
    for layer in range(LAYERS):  # neither side sees the other's later write, in any layer
        assert read_values(c, "a", layer) == [10, 11, 12, 13, 14, 15, 300]
        assert read_values(c, "b", layer) == [10, 11, 12, 13, 14, 15, 500]
    c.check_invariants()


def test_fork_of_block_aligned_sequence_needs_no_copy():
    c = make(8, 4)
    c.create("a", list(range(8)))
    c.fork("a", "b")
    c.append("b", [1])
    c.append_one_each(["a"], [2])
    assert c.cow_copies == 0
    assert c.block_ids("a") == [0, 1, 3] and c.block_ids("b") == [0, 1, 2]
    c.check_invariants()


def test_decode_fast_path_copies_on_write():
    c = make(8, 4)
    c.create("a", [1, 2, 3, 4, 5])
    write_positions(c, "a", 0, lambda p: p + 1)
    c.fork("a", "b")
    c.append_one_each(["a", "b"], [6, 7])
    assert c.cow_copies == 1
    assert c.block_ids("a") == [0, 2] and c.block_ids("b") == [0, 1]  # a copied first
    slots, _, _ = c.decode_tensors(["a", "b"])
    assert slots.tolist() == [9, 5]
    assert read_values(c, "a")[:5] == read_values(c, "b")[:5] == [1, 2, 3, 4, 5]
    c.check_invariants()


def test_blocks_return_only_at_zero_refs():
    c = make(8, 4)
    c.create("a", list(range(6)))
    c.fork("a", "b")
    c.fork("b", "c")
    assert refs(c, "a") == [3, 3]
    c.free("a")
    c.free("b")
    assert refs(c, "c") == [1, 1] and c.num_free_blocks == 6
    c.free("c")
    assert c.num_free_blocks == 8
    c.check_invariants()


# --- prefix caching ---------------------------------------------------------------------------


def test_full_blocks_get_the_chained_hash_partial_ones_none():
    c = make(8, 4)
    toks = list(range(10))
    c.create("a", toks)
    blocks = [c._pool.blocks[i] for i in c.block_ids("a")]
    assert [b.hash for b in blocks[:2]] == chain_hashes(toks, 4)
    assert blocks[2].hash is None  # partial
    c.append("a", [10, 11])
    assert blocks[2].hash == chain_hashes(toks + [10, 11], 4)[2]


def test_prefix_hit_shares_blocks_and_reports_cached_tokens():
    c = make(16, 4)
    c.create("a", list(range(10)))
    assert c.lookup(list(range(9)) + [99]) == 8
    n = c.create("b", list(range(9)) + [99])
    assert n == 8
    assert c.block_ids("b")[:2] == c.block_ids("a")[:2] == [0, 1]
    assert c.block_ids("b")[2] == 3
    assert refs(c, "a") == [2, 2, 1]
    st = c.stats()
    assert (st.prefix_queries, st.prefix_hits) == (20, 8)
    assert st.prefix_hit_rate == pytest.approx(0.4)
    assert c.seq("b").num_written == 10
    c.check_invariants()


def test_prefix_hit_reads_back_the_original_writers_kv():
    c = make(16, 4)
    c.create("a", list(range(8)))
    write_positions(c, "a", 0, lambda p: 40 + p)
    n = c.create("b", list(range(8)) + [1, 2])
    assert n == 8
    write_positions(c, "b", n, lambda p: 70 + p)
    assert read_values(c, "b") == [40, 41, 42, 43, 44, 45, 46, 47, 78, 79]


def test_last_prompt_token_is_always_recomputed():
    c = make(16, 4)
    c.create("a", list(range(8)))
    # capped at len - 1: the second block's first 3 tokens are a partial hit, its last is redone
    assert c.create("same", list(range(8))) == 7
    assert c.create("longer", list(range(9))) == 8
    assert c.create("one", [0]) == 0
    assert c.lookup(list(range(5))) == 4 and c.lookup(list(range(4))) == 3
    c.check_invariants()


def test_salted_request_misses():
    c = make(16, 4)
    c.create("a", list(range(10)))
    assert c.lookup(list(range(10)), extra_key="tenant-b") == 0
    assert c.create("b", list(range(10)), extra_key="tenant-b") == 0
    assert set(c.block_ids("b")).isdisjoint(c.block_ids("a"))
    assert c.create("c", list(range(10)), extra_key="tenant-b") == 8  # same salt: hit
    assert c.block_ids("c")[:2] == c.block_ids("b")[:2]
    c.check_invariants()


def test_freed_blocks_stay_cached_until_evicted():
    c = make(8, 4)
    c.create("a", list(range(10)))  # 0, 1 hashed, 2 partial
    c.free("a")  # 2 is kept as a partial block (its 2 tokens, for partial hits)
    st = c.stats()
    assert st.cached_blocks == 3 and st.free_blocks == 8 and st.used_blocks == 0
    assert c.create("b", list(range(9))) == 8  # revives 0, 1; a plain free block after them
    assert c.block_ids("b") == [0, 1, 3]
    assert c.stats().cached_blocks == 1
    c.check_invariants()


def test_exact_free_queue_and_eviction_order():
    c = make(8, 2)
    c.create("a", [1, 2, 3, 4, 5, 6])  # 0, 1, 2: all full and hashed
    c.create("b", [7, 8, 9, 10, 11])  # 3, 4 hashed, 5 partial
    c.free("a")  # tail first to the back: 2, 1, 0
    c.free("b")  # 5 (kept as a partial block: [11]), 4, 3 to the back
    assert queue(c) == [6, 7, 2, 1, 0, 5, 4, 3]
    assert c.stats().cached_blocks == 6
    # plain blocks are reused first, then cached ones least recently freed first, tail first
    c.create("x", [50, 51, 52, 53, 54, 55, 56])  # 4 blocks: 6, 7 then evicts 2, 1
    assert c.block_ids("x") == [6, 7, 2, 1]
    assert c.stats().evictions == 2
    assert c.lookup([1, 2, 3, 4, 5, 6, 0]) == 2  # a's first block still cached
    assert c.evict(1) == 1  # explicit eviction: block 0 next
    assert c.lookup([1, 2, 3, 4, 5, 6, 0]) == 0
    assert c.lookup([7, 8, 9, 10, 11]) == 4
    assert c.lookup([7, 8, 9, 10, 11, 12]) == 5  # and 11 from b's partial block
    assert c.evict() == 3 and c.stats().evictions == 6
    assert c.lookup([7, 8, 9, 10, 11, 12]) == 0 and c.stats().cached_blocks == 0
    c.check_invariants()


def test_reset_prefix_cache_empties_the_index():
    c = make(8, 4)
    c.create("a", list(range(10)))
    c.create("b", list(range(20, 30)))
    c.free("b")
    c.reset_prefix_cache()
    assert c._pool.hash_to_block == {} and c.stats().cached_blocks == 0
    assert c.lookup(list(range(10))) == 0 and c.lookup(list(range(20, 30))) == 0
    c.append("a", [1, 2])  # live sequences keep working
    c.check_invariants()


def test_prefix_caching_disabled():
    c = make(8, 4, enable_prefix_caching=False)
    c.create("a", list(range(10)))
    assert c.create("b", list(range(10))) == 0
    assert c._pool.hash_to_block == {} and c.stats().prefix_queries == 0
    assert c.lookup(list(range(10))) == 0


def test_uncomputed_blocks_are_not_hashed_until_marked():
    c = make(8, 4)
    c.create("a", list(range(10)), computed=False)
    assert c._pool.hash_to_block == {} and c.lookup(list(range(10))) == 0
    c.mark_computed("a", 5)
    assert c.lookup(list(range(10))) == 4
    c.mark_computed("a", 10)
    assert c.lookup(list(range(10))) == 8
    c.check_invariants()


def test_truncate_drops_the_hash_of_a_block_it_will_overwrite():
    c = make(8, 4)
    c.create("a", list(range(8)))
    c.truncate("a", 6)
    assert c._pool.blocks[1].hash is None and c.lookup(list(range(8)) + [0]) == 4
    c.check_invariants()


def test_shared_block_cut_by_truncate_cannot_serve_stale_hits():
    """Regression: a full, shared, hashed block cut by truncate keeps its hash for the other
    holder; once that holder is gone, an in-place append must forget the hash, else a later
    prefix hit would read the overwritten K/V."""
    c = make(8, 4)
    c.create("a", list(range(8)))
    write_positions(c, "a", 0, lambda p: 10 + p)
    c.fork("a", "b")  # speculation branch
    c.truncate("b", 6)  # rejected tokens: cut into the shared, hashed block 1
    assert c._pool.blocks[1].hash is not None  # "a" still holds it full
    c.free("a")
    c.append("b", [99])  # in place: block 1 is b's alone now
    write_positions(c, "b", 6, lambda p: 999)
    assert c._pool.blocks[1].hash is None
    assert c.create("c", list(range(8)) + [5]) == 4
    write_positions(c, "c", 4, lambda p: 10 + p)
    assert read_values(c, "c") == [10 + p for p in range(8)] + [18]
    assert read_values(c, "b") == [10, 11, 12, 13, 14, 15, 999]
    c.check_invariants()


def test_lookup_changes_nothing():
    c = make(8, 4)
    c.create("a", list(range(10)))
    c.free("a")
    before = snapshot(c)
    assert c.lookup(list(range(10))) == 9  # 8 whole, then 8 of a's partial last block [8 9]
    assert same_state(snapshot(c), before)


# --- statistics -------------------------------------------------------------------------------


def test_stats_counts_and_fragmentation():
    c = PagedKVCache(10, 4, bytes_per_block=1000)
    c.create("a", list(range(6)))  # 0, 1
    c.create("b", list(range(10, 14)))  # 2
    c.create("c", list(range(20, 29)))  # 3, 4, 5
    c.fork("c", "d")
    c.append("d", [1])  # CoW of block 5 -> 6
    c.free("b")  # hole at 2 (cached: full + hashed)
    st = c.stats()
    assert (st.used_blocks, st.free_blocks, st.cached_blocks) == (6, 4, 1)
    assert st.active_sequences == 3
    assert st.live_tokens == 6 + 8 + 1 + 2  # shared blocks counted once
    assert st.internal_waste == 6 * 4 - st.live_tokens
    assert st.utilization == pytest.approx(st.live_tokens / 24)
    assert st.usage == pytest.approx(0.6)
    assert st.holes == 1 and st.largest_free_run == 3
    assert st.external_fragmentation == pytest.approx(1 - 3 / 4)
    assert (st.allocations, st.frees, st.cow_copies) == (7, 1, 1)
    assert st.memory_used_bytes == 6000 and st.memory_total_bytes == 10_000


def test_stats_of_an_empty_cache():
    st = PagedKVCache(4, 4).stats()
    assert st.used_blocks == 0 and st.utilization == 1.0 and st.holes == 0
    assert st.largest_free_run == 4 and st.prefix_hit_rate == 0.0
    assert st.external_fragmentation == 0.0


def test_paged_memory_is_a_fraction_of_a_contiguous_buffer():
    """32 layers, a max context of 4096, 10 tokens stored: paged < 1/10 of contiguous."""
    layers, heads, dim, bs, max_ctx = 32, 8, 128, 16, 4096
    per_block = bytes_per_block(layers, bs, heads, dim, "float16")
    c = PagedKVCache(max_ctx // bs, bs, bytes_per_block=per_block)
    c.create("s", list(range(10)))
    paged = c.stats().memory_used_bytes
    contiguous = torch.empty(
        (layers, 2, max_ctx, heads, dim), dtype=torch.float16, device="meta"
    )
    contiguous_bytes = contiguous.numel() * contiguous.element_size()
    assert paged == per_block == 2 * layers * bs * heads * dim * 2
    assert paged < contiguous_bytes / 10
    assert paged / contiguous_bytes == pytest.approx(bs / max_ctx)


# --- defragmentation --------------------------------------------------------------------------


def test_defragment_compacts_and_keeps_every_sequence_intact():
    c = make(12, 4)
    for name, n, base in (("a", 6, 100), ("b", 9, 200), ("c", 5, 300), ("d", 8, 400)):
        c.create(name, [base + i for i in range(n)])
        write_positions(c, name, 0, lambda p, base=base: base + p)
    c.fork("c", "e")
    c.append("e", [1])
    write_positions(c, "e", 5, lambda p: 999)
    c.free("b")
    c.free("a")
    assert c.stats().holes > 0 and c.should_defragment()
    expect = {s: read_values(c, s) for s in c.seqs}
    moved = c.defragment()
    assert moved > 0
    st = c.stats()
    assert st.holes == 0 and st.largest_free_run == st.free_blocks
    used_ids = sorted({i for s in c.seqs for i in c.block_ids(s)})
    assert used_ids == list(range(st.used_blocks))
    for s, vals in expect.items():
        for layer in range(LAYERS):
            assert read_values(c, s, layer) == vals
        k, _ = c.storage.gather(0, c.block_ids(s), c.num_tokens(s))
        assert k[:, 0, 0].tolist() == vals
    tables, _ = c.block_tables(list(c.seqs))
    for row, s in zip(tables.tolist(), c.seqs, strict=True):
        assert row[: len(c.block_ids(s))] == c.block_ids(s)
    assert not c.should_defragment()
    c.check_invariants()


def test_defragment_keeps_the_prefix_index_pointing_at_the_right_data():
    c = make(8, 4)
    c.create("x", [9] * 12)  # 0, 1, 2
    c.create("a", list(range(8)))  # 3, 4 (hashed)
    write_positions(c, "a", 0, lambda p: 50 + p)
    c.free("x")
    c.free("a")  # a's blocks cached at the back of the queue
    c.create("y", [7])
    c.defragment()
    assert c.stats().cached_blocks == 5
    n = c.create("b", list(range(8)) + [1])
    assert n == 8
    write_positions(c, "b", 8, lambda p: 0)
    assert read_values(c, "b")[:8] == [50 + p for p in range(8)]
    c.check_invariants()


def test_defragment_without_storage_and_on_a_compact_cache():
    c = PagedKVCache(8, 4)
    c.create("a", [1, 2, 3])
    assert c.defragment() == 0 and not c.should_defragment()
    c.create("b", [1])
    c.free("a")
    assert c.should_defragment()
    assert c.defragment() == 2 and c.block_ids("b") == [0]  # a's kept partial block: 0 -> 1
    c.check_invariants()


# --- invariants -------------------------------------------------------------------------------


def test_check_invariants_catches_a_stale_table():
    c = make(8, 4)
    c.create("a", list(range(6)))
    c.check_invariants()
    c.table.np[c.seq("a").table.index, 0] = 5
    with pytest.raises(AssertionError):
        c.check_invariants()


def test_check_invariants_catches_a_wrong_ref_count():
    c = make(8, 4)
    c.create("a", list(range(6)))
    c._pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError):
        c.check_invariants()


def test_table_buffer_grows_with_many_sequences_and_long_ones():
    c = PagedKVCache(400, 2)
    for i in range(40):
        c.create(i, [i] * 3)
    c.append(0, list(range(300)))
    assert c.block_token_counts(0)[-1] == 1 and len(c.block_ids(0)) == 152
    tables, lens = c.block_tables([0, 39])
    assert tables.shape == (2, 152) and lens.tolist() == [303, 3]
    c.check_invariants()


def test_create_reserve_keeps_headroom_or_changes_nothing() -> None:
    cache = PagedKVCache(4, 4)
    cache.create("a", list(range(4)))
    with pytest.raises(OutOfBlocksError) as e:
        cache.create("b", list(range(100, 108)), reserve=2)  # 2 blocks + 2 reserved > 3 free
    assert e.value.needed == 2 and e.value.available == 1
    assert "b" not in cache and cache.num_free_blocks == 3
    cache.create("b", list(range(100, 108)), reserve=1)
    assert cache.num_free_blocks == 1
    cache.check_invariants()


def test_decode_fast_path_counts_one_copy_when_every_sharer_writes():
    # three blocks (the last partial), a fork, one free block: the first writer copies, the
    # last holder writes in place, so the batch fits exactly as appending one by one does
    c = PagedKVCache(4, 4)
    c.create("a", list(range(9)))
    c.fork("a", "b")
    assert c.num_free_blocks == 1
    assert c.blocks_needed_one_each(["a", "b"]) == 1
    c.append_one_each(["a", "b"], [1, 2])
    assert c.num_free_blocks == 0 and c.cow_copies == 1
    c.fork("a", "x")
    c.fork("a", "y")  # a's tail now has three holders; two of them in the batch need copies
    assert c.blocks_needed_one_each(["a", "x"]) == 2
    c.check_invariants()


def test_an_owners_chain_is_read_not_copied():
    """The engine's sequences pass their own HashChain: the cache grows by counts into ids the
    owner appended first, and registers the chain's hashes (computed once, by the chain)."""
    c = PagedKVCache(8, 4)
    chain = HashChain(4, range(6))
    c.create("a", chain, computed=False)
    assert c.seq("a").chain is chain
    chain.append(6)  # the owner appends first; the cache grows by a count
    c.append_one_each(["a"], computed=False)
    assert c.num_tokens("a") == 7 and c.lookup(chain.ids) == 0  # nothing hashed before mark_computed
    c.mark_computed("a", 7)
    assert c.lookup(chain.ids + [9]) == 4 and c.seq("a").block_hashes == chain.hashes[:1]
    child = chain.prefix(7)
    c.fork("a", "b", chain=child)
    child.append(8)
    with pytest.raises(PositionError):
        c.append("b", 2)  # only one id ahead
    with pytest.raises(CacheConfigError):
        c.append("b", [5])  # ids come from the owner, not from the call
    c.append("b", 1)
    c.check_invariants()
    with pytest.raises(CacheConfigError):
        c.append_one_each(["a"])  # the owner holds no id beyond the cache's
    with pytest.raises(CacheConfigError):
        c.create("z", HashChain(8, [1, 2]))  # another block size
    c.check_invariants()


def test_chain_hashes_match_the_block_hashes():
    """A chain hashes each block once, when it fills, exactly as `chain_hashes` does; edits
    rehash from the first block they change."""
    ids = list(range(23))
    chain = HashChain(4, (), "salt")
    for t in ids:
        chain.append(t)
    assert chain.hashes == chain_hashes(ids, 4, "salt") and len(chain.hashes) == 5
    chain.delete(5, 9)
    assert chain.ids == ids[:5] + ids[9:] and chain.hashes == chain_hashes(chain.ids, 4, "salt")
    copy = chain.prefix(9)
    assert copy.ids == chain.ids[:9] and copy.hashes == chain.hashes[:2]
    assert HashChain(4, ids, hashed=False).hashes == []
