"""BlockTable (one KV cache group's tables over the shared pool) and the cache's closed surface:
import_cached (all-or-nothing), cached_prefix_len, cached_blocks, block_states."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cache_snapshot import same_state, snapshot
from test_cache_manager import make, read_values, write_positions

from pagedkv.cache.block_pool import BlockPool
from pagedkv.cache.block_table import BlockTable
from pagedkv.cache.hashing import chain_hashes
from pagedkv.errors import InvalidArgumentError, OutOfBlocksError, StorageMismatchError

# --- BlockTable -------------------------------------------------------------------------------


def table(num_blocks: int = 8, width: int = 2) -> tuple[BlockPool, BlockTable]:
    pool = BlockPool(num_blocks)
    return pool, BlockTable(pool, 4, width, rows=2)


def test_rows_hold_one_reference_per_listing_and_the_buffer_mirrors_them():
    pool, t = table()
    a = t.open(fresh=2)
    b = t.open(a.blocks[:1], fresh=1)  # a prefix hit on a's first block
    assert [x.ref_cnt for x in a.blocks] == [2, 1]
    assert t.buf[a.index, :2].tolist() == [x.block_id for x in a.blocks]
    assert t.buf[b.index, :2].tolist() == [x.block_id for x in b.blocks]
    t.check([a, b])
    c = t.open()  # a third row: the buffer doubles its rows
    t.grow(c, 5)  # and its width, beyond 2 columns
    assert t.buf.shape == (4, 5) and t.buf[c.index].tolist() == [x.block_id for x in c.blocks]
    t.check([a, b, c])
    t.close(c)
    assert pool.num_free == 8 - 3 and not t.buf[c.index].any()
    t.check([a, b])


def test_copy_on_write_gives_the_writer_a_private_copy_with_the_data():
    pool = BlockPool(4)
    copies: list[tuple[list[int], list[int]]] = []
    t = BlockTable(pool, 4, 2, lambda src, dst: copies.append((src, dst)))
    a = t.open(fresh=1)
    b = t.open(a.blocks)
    t.before_write(b, 0)  # shared: copied first
    assert a.blocks[0] is not b.blocks[0] and t.cow_copies == 1
    assert copies == [([a.blocks[0].block_id], [b.blocks[0].block_id])]
    assert [a.blocks[0].ref_cnt, b.blocks[0].ref_cnt] == [1, 1]
    pool.set_hash(a.blocks[0], b"h")
    t.before_write(a, 0)  # private: only its hash goes
    assert a.blocks[0].hash is None and t.cow_copies == 1
    t.check([a, b])


def test_splice_keeps_listed_blocks_frees_the_rest_and_fills_fresh_ones():
    pool, t = table()
    a = t.open(fresh=4)
    old = list(a.blocks)
    new = t.splice(a, 1, [old[3], None])
    assert a.blocks == [old[0], old[3], new[1]] and new[1] not in old
    assert [b.ref_cnt for b in old] == [1, 0, 0, 1] and pool.num_free == 8 - 3
    t.cut(a, 1)
    assert a.blocks == [old[0]] and t.buf[a.index].tolist() == [old[0].block_id, 0, 0, 0]
    t.check([a])


# --- the cache's surface ----------------------------------------------------------------------


def test_cached_prefix_len_counts_leading_cached_hashes():
    c = make(16, 4)
    c.create("a", list(range(10)))
    chain = chain_hashes(list(range(12)), 4)
    assert c.cached_prefix_len(chain) == 2  # blocks 0 and 1 are full and computed
    assert c.cached_prefix_len(chain, limit=1) == 1
    assert c.cached_prefix_len([b"x"] + chain) == 0
    c.free("a")
    assert c.cached_prefix_len(chain) == 2  # cached free blocks count: a hit revives them
    c.evict()
    assert c.cached_prefix_len(chain) == 0 and c.cached_blocks() == []


def test_cached_blocks_and_block_states_read_the_pool():
    c = make(8, 4)
    c.create("a", list(range(9)))
    c.fork("a", "b")
    refs, hashed = c.block_states()
    ids = c.block_ids("a")
    assert refs[ids].tolist() == [2, 2, 2] and int(refs.sum()) == 6
    assert hashed[ids].tolist() == [True, True, False]
    assert sorted(c.cached_blocks()) == sorted(zip(chain_hashes(list(range(9)), 4), ids[:2],
                                                   strict=False))


def test_import_cached_loads_contents_as_cached_prefix_blocks():
    src = make(8, 4)
    src.create("a", list(range(9)))
    write_positions(src, "a", 0, lambda p: 10 + p)
    hashes = [h for h, _ in sorted(src.cached_blocks(), key=lambda x: x[1])]
    parts = [{n: t[0] for n, t in src.storage.export_blocks([b]).items()}
             for b in src.block_ids("a")[:2]]
    c = make(8, 4)
    assert c.import_cached(hashes, parts) == 2
    assert c.num_free_blocks == 8 and c.stats().cached_blocks == 2
    assert c.import_cached(hashes, parts) == 0  # already cached: skipped
    c.check_invariants()
    assert c.create("b", list(range(9))) == 8  # a prefix hit on the imported blocks
    write_positions(c, "b", 8, lambda p: 10 + p)
    assert read_values(c, "b") == [10 + p for p in range(9)]
    c.check_invariants()


def test_import_cached_is_all_or_nothing():
    c = make(4, 4)
    c.create("a", list(range(9)))  # 3 blocks: 1 free
    part = {n: t[0] for n, t in c.storage.export_blocks([0]).items()}
    before = snapshot(c)
    bad_shape = {"kv": part["kv"][:, :, :2]}
    bad_dtype = {"kv": part["kv"].to(torch.float64)}
    for hashes, parts, err in [
        ([b"x", b"y"], [part, part], OutOfBlocksError),
        ([b"x", b"y"], [part, bad_shape], StorageMismatchError),
        ([b"x"], [bad_dtype], StorageMismatchError),
        ([b"x"], [{"kv": part["kv"], "scales": part["kv"]}], StorageMismatchError),
        ([b"x"], [part, part], InvalidArgumentError),
        (["x"], [part], InvalidArgumentError),
    ]:
        with pytest.raises(err):
            c.import_cached(hashes, parts)
        assert same_state(snapshot(c), before)
    assert c.import_cached([b"x", b"x"], [part, part]) == 1  # repeats are skipped
    c.check_invariants()
    assert np.count_nonzero(c.block_states()[1]) == 3
