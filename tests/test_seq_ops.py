"""Sequence range operations on PagedKVCache: remove, copy, shift (llama.cpp's seq_rm / seq_cp /
seq_add), their block sharing, hashes, typed errors and "a failed operation changes nothing"."""

from __future__ import annotations

import pytest
import torch
from cache_snapshot import same_state, snapshot
from test_cache_manager import make, read_values, refs, write_positions

from pagedkv.cache.hashing import HashChain
from pagedkv.errors import (
    CacheConfigError,
    InvalidArgumentError,
    OutOfBlocksError,
    PositionError,
    UnknownSequenceError,
)


def filled(n: int, *, num_blocks: int = 16, block_size: int = 4, sid="a"):
    c = make(num_blocks, block_size)
    c.create(sid, list(range(n)))
    write_positions(c, sid, 0, lambda p: 10 + p)
    return c


def add_k(k: torch.Tensor, delta: int) -> torch.Tensor:
    """A stand-in "rotation": K + delta (V untouched), easy to check exactly."""
    return k + delta


# --- remove -----------------------------------------------------------------------------------


@pytest.mark.parametrize("start, end", [(0, 4), (4, 8), (2, 5), (1, 2), (3, 11), (0, 9), (5, 6)])
def test_remove_moves_later_positions_down(start, end):
    c = filled(14)
    c.remove("a", start, end)
    want = [10 + p for p in range(14) if not start <= p < end]
    assert read_values(c, "a") == want and read_values(c, "a", 1) == want
    assert c.seq("a").token_ids == [p for p in range(14) if not start <= p < end]
    assert len(c.block_ids("a")) == -(-len(want) // 4)
    c.check_invariants()


def test_block_aligned_remove_releases_blocks_and_moves_nothing():
    c = filled(16)
    before = c.block_ids("a")
    c.remove("a", 4, 12)
    assert c.block_ids("a") == [before[0], before[3]]
    assert c.num_free_blocks == 16 - 2
    assert read_values(c, "a") == [10, 11, 12, 13, 22, 23, 24, 25]


def test_remove_to_the_end_is_truncate_and_keeps_hashing():
    c = filled(10)
    c.remove("a", 6, 10)
    assert c.num_tokens("a") == 6 and c.seq("a").hash_limit is None
    c.append("a", [6, 7])
    assert len(c.seq("a").block_hashes) == 2


def test_remove_never_touches_a_forks_data():
    c = filled(12)
    c.fork("a", "b")
    c.remove("a", 1, 3)
    assert read_values(c, "b") == [10 + p for p in range(12)]
    assert read_values(c, "a") == [10, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    c.check_invariants()


def test_remove_drops_hashes_of_rewritten_blocks_and_stops_hashing():
    c = filled(12)
    tokens = list(range(12))
    c.remove("a", 1, 3)
    assert c.lookup(tokens) == 0  # block 0 was rewritten, its hash gone
    assert c.seq("a").block_hashes == [] and c.seq("a").hash_limit == 0
    c.append("a", [7, 7, 7, 7, 7, 7])
    assert c.seq("a").block_hashes == []  # contents after an edit never serve prefix hits
    c.free("a")
    assert not c._pool.hash_to_block or all(b.ref_cnt == 0 for b in c._pool.hash_to_block.values())
    assert c.lookup(tokens) == 0
    c.check_invariants()


def test_unchanged_blocks_keep_a_valid_hash():
    c = filled(12)
    c.remove("a", 4, 8)  # block-aligned: no data moves
    # blocks 0 (kept), 1 (released, now cached) and 2 (moved up a place, its data untouched)
    # still hold exactly what they held: 8 tokens whole, then 3 of block 2 as a partial hit
    assert c.lookup(list(range(12))) == 11 and c._pool.num_cached_free == 1
    assert len(c.seq("a").block_hashes) == 1 and c.seq("a").hash_limit == 1


def test_failed_remove_changes_nothing():
    c = filled(12, num_blocks=3)
    c.fork("a", "b")  # every block shared: rewriting needs fresh blocks, none free
    before = snapshot(c)
    with pytest.raises(OutOfBlocksError):
        c.remove("a", 1, 2)
    assert same_state(before, snapshot(c))


@pytest.mark.parametrize("args, err", [
    (("a", 3, 2), PositionError), (("a", -1, 2), PositionError), (("a", 0, 13), PositionError),
    (("a", 0.5, 2), InvalidArgumentError), (("a", True, 2), InvalidArgumentError),
    (("zz", 0, 1), UnknownSequenceError),
])
def test_bad_ranges_are_typed_and_change_nothing(args, err):
    c = filled(12)
    c.register_rotation(add_k)
    before = snapshot(c)
    for op in (c.remove, lambda *a: c.shift(*a, 1), lambda s, a, b: c.copy(s, "new", a, b)):
        with pytest.raises(err):
            op(*args)
        assert same_state(before, snapshot(c))


def test_uncomputed_positions_cannot_be_copied_or_shifted_but_stay_uncomputed_on_remove():
    c = make(8, 4)
    c.register_rotation(add_k)
    c.create("a", list(range(6)), computed=False)
    c.mark_computed("a", 3)
    before = snapshot(c)
    with pytest.raises(PositionError):
        c.copy("a", "b", 0, 4)
    with pytest.raises(PositionError):
        c.shift("a", 2, 4, 1)
    assert same_state(before, snapshot(c))
    c.remove("a", 1, 2)
    assert c.seq("a").num_written == 2 and c.num_tokens("a") == 5


# --- copy -------------------------------------------------------------------------------------


def test_aligned_copy_shares_whole_blocks():
    c = filled(12)
    c.copy("a", "b", 4, 10)
    ids = c.block_ids("a")
    assert c.block_ids("b") == ids[1:3] and refs(c, "a") == [1, 2, 2]
    assert read_values(c, "b") == [14, 15, 16, 17, 18, 19]
    c.append("b", [1])  # b's partial last block is shared: copy-on-write
    write_positions(c, "b", 6, lambda p: 99)
    assert read_values(c, "a") == [10 + p for p in range(12)]
    c.check_invariants()


def test_prefix_copy_keeps_hashing_like_a_fork():
    c = filled(12)
    c.copy("a", "b", 0, 8)
    assert c.seq("b").block_hashes == c.seq("a").block_hashes[:2]
    assert c.seq("b").hash_limit is None


def test_unaligned_copy_copies_data_into_own_blocks():
    c = filled(12)
    c.create("b", [5, 5, 5])
    write_positions(c, "b", 0, lambda p: 1)
    c.copy("a", "b", 2, 7)
    assert read_values(c, "b") == [1, 1, 1, 12, 13, 14, 15, 16]
    assert not set(c.block_ids("b")) & set(c.block_ids("a"))
    assert c.seq("b").token_ids == [5, 5, 5, 2, 3, 4, 5, 6]
    assert c.seq("b").hash_limit == 0
    c.check_invariants()


def test_failed_copy_changes_nothing():
    c = filled(12, num_blocks=4)
    c.create("b", [1])
    before = snapshot(c)
    with pytest.raises(OutOfBlocksError):
        c.copy("a", "b", 1, 10)
    assert same_state(before, snapshot(c))
    with pytest.raises(InvalidArgumentError):
        c.copy("a", "a", 0, 1)
    assert same_state(before, snapshot(c))


# --- shift ------------------------------------------------------------------------------------


def test_shift_rewrites_k_only_in_the_range():
    c = filled(10)
    c.register_rotation(add_k)
    c.shift("a", 3, 9, -2)
    for p in range(10):
        k, v = c.storage.read(1, c.slot("a", p))
        assert float(k[0, 0]) == 10 + p + 1 - (2 if 3 <= p < 9 else 0)
        assert float(v[0, 0]) == -(10 + p + 1)
    assert c.seq("a").hash_limit == 0 and c.lookup(list(range(10))) == 0


def test_shift_copies_shared_blocks_first():
    c = filled(8)
    c.register_rotation(add_k)
    c.fork("a", "b")
    c.shift("b", 4, 8, 5)
    assert c.block_ids("a")[0] == c.block_ids("b")[0]
    assert c.block_ids("a")[1] != c.block_ids("b")[1]
    assert read_values(c, "a") == [10 + p for p in range(8)]
    c.check_invariants()


def test_shift_needs_a_rotation_and_fails_cleanly():
    c = filled(8, num_blocks=2)
    before = snapshot(c)
    with pytest.raises(CacheConfigError):
        c.shift("a", 0, 4, 1)
    c.register_rotation(lambda k, d: k[:1])  # a broken callback
    with pytest.raises(Exception, match="rotation returned"):
        c.shift("a", 0, 4, 1)
    c.register_rotation(add_k)
    c.fork("a", "b")
    with pytest.raises(OutOfBlocksError):
        c.shift("b", 0, 8, 1)
    c.free("b")
    assert same_state(before, snapshot(c))
    with pytest.raises(InvalidArgumentError):
        c.register_rotation(3)


def test_context_shift_with_remove_then_shift():
    """llama.cpp's context shift: keep 2, drop 4, move the rest down and re-rotate it."""
    c = filled(12)
    c.register_rotation(add_k)
    c.remove("a", 2, 6)
    c.shift("a", 2, 8, -4)
    kept = [0, 1] + list(range(6, 12))
    for i, p in enumerate(kept):
        k, v = c.storage.read(0, c.slot("a", i))
        assert float(v[0, 0]) == -(10 + p) and float(k[0, 0]) == 10 + p - (4 if i >= 2 else 0)
    c.check_invariants()


# --- the model's K re-rotation ----------------------------------------------------------------

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("scaling", [None, LLAMA3], ids=["rope", "llama3"])
@pytest.mark.parametrize("delta", [-37, -1, 5, 300])
def test_rope_shift_equals_rope_at_the_new_positions(scaling, delta):
    """RoPE at p, re-rotated by delta == RoPE at p + delta (Llama-3 frequency scaling too)."""
    from pagedkv.model.config import ModelConfig
    from pagedkv.model.llama import RotaryEmbedding

    cfg = ModelConfig("llama", 32, 64, 128, 1, 4, 2, 64, rope_theta=500000.0,
                      rope_scaling=scaling, max_position_embeddings=1024)
    rope = RotaryEmbedding(cfg, torch.float32)
    k = torch.randn(40, 2, 64, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(400, 440)
    stored = RotaryEmbedding.rotate(k, *rope.lookup(pos))
    fresh = RotaryEmbedding.rotate(k, *rope.lookup(pos + delta))
    # float32 tables: an angle near position 440 is rounded by ~440 * 6e-8 rad on either side
    tol = {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(rope.shift_keys(stored, delta), fresh, **tol)
    # any leading dims ([L, T, H, D] as the cache passes them)
    torch.testing.assert_close(rope.shift_keys(stored[None], delta)[0], fresh, **tol)


def test_remove_from_a_table_listing_a_block_twice_keeps_ref_counts():
    """Regression (found by the state machine): an aligned copy of a sequence's own first block
    onto its end lists that block twice; removing the first copy must drop one reference."""
    c = filled(4, block_size=2)
    c.fork("a", "b")
    c.copy("b", "a", 0, 2)
    assert c.block_ids("a")[0] == c.block_ids("a")[2]
    c.remove("a", 0, 2)
    c.check_invariants()
    assert read_values(c, "a") == [12, 13, 10, 11]


def test_an_owners_chain_gets_the_contexts_edits():
    """The engine's sequences pass their own HashChain: remove deletes the range from it too
    (it holds the context; ids appended ahead are kept) and hashing stops at the edit, so the
    chain's hashes past it are never registered."""
    c = make(8, 4)
    ids = list(range(10))
    chain = HashChain(4, ids)
    c.create("a", chain)
    chain.append(10)  # the owner is one id ahead of the cache
    c.register_rotation(add_k)
    c.remove("a", 4, 6)
    c.shift("a", 4, 8, -2)
    assert ids == list(range(10)) and c.num_tokens("a") == 8
    assert chain.ids == [0, 1, 2, 3, 6, 7, 8, 9, 10]
    assert c.seq("a").hash_limit == 1 and len(c.seq("a").block_hashes) == 1
    c.append_one_each(["a"])
    c.check_invariants()
