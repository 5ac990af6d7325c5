"""The block pool: every block, its reference count, the free queue and the prefix-hash index.

Invariants (checked by `BlockPool.check_invariants`):
- A block is either referenced (ref_cnt > 0, owned by one or more block tables) or in the free
  queue (ref_cnt == 0), never both.
- A block's `hash` is set only when it is full and its K/V are (being) computed; it is then in
  `hash_to_block`. A free block may keep its hash: it is "cached" and a prefix hit revives it
  ("touch") until it is evicted.
- A registered block may also carry its `link`: (parent key, its token ids), indexed in
  `children` under that key for as long as it holds its hash, so a new sequence can reuse the
  leading tokens of a cached block it matches only in part (`best_partial`).
- A `partial` block is the written part of a freed sequence's last block, kept for partial
  hits only: free, its hash a key no chain hash equals (never a whole-block hit, never
  revived), its link's ids the written ones; it records no KV events.
- Free-queue order is eviction order: the front is taken first. Freed blocks without a hash go to
  the front (nothing is lost reusing them); freed cached blocks go to the back, so cached blocks
  are evicted least recently freed first. A sequence's blocks are freed tail first, so its block
  covering the most tokens (least likely to be shared) is evicted first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from itertools import islice

from pagedkv.errors import DoubleFreeError, InvalidBlockError, OutOfBlocksError

#: Children of one parent key `best_partial` compares at most (the most recently registered).
PARTIAL_SCAN = 64


def _common(a: bytes, b: bytes) -> int:
    """Tokens in the common leading run of two int64 id strings (a binary search over whole
    ids: at most 5 comparisons of a 16-token block, each in C)."""
    n = min(len(a), len(b)) // 8
    if a[: 8 * n] == b[: 8 * n]:
        return n
    lo, hi = 0, n - 1  # a[:8 lo] == b[:8 lo], and they differ within the first hi + 1 ids
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[: 8 * mid] == b[: 8 * mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    hash: bytes | None = None
    link: tuple[bytes, bytes] | None = None  # (parent key, its int64 token ids) while hashed
    partial: bool = False  # a freed sequence's partial last block, kept for partial hits
    prev: Block | None = field(default=None, repr=False)
    next: Block | None = field(default=None, repr=False)
    in_free_queue: bool = False


#: A window group's table entry for a block it gave back (wholly before the window): never in
#: the pool, never referenced, never read (attention starts at the window's first block).
NULL_BLOCK = Block(-1)


class FreeQueue:
    """Doubly linked list of free blocks: O(1) push at either end, pop front, remove anywhere."""

    def __init__(self) -> None:
        self.head = Block(-1)  # sentinels: no None checks when relinking
        self.tail = Block(-1)
        self.head.next, self.tail.prev = self.tail, self.head
        self.size = 0

    def _insert_after(self, at: Block, b: Block) -> None:
        b.prev, b.next = at, at.next
        at.next.prev = b  # type: ignore[union-attr]
        at.next = b
        b.in_free_queue = True
        self.size += 1

    def push_back(self, b: Block) -> None:
        self._insert_after(self.tail.prev, b)  # type: ignore[arg-type]

    def push_front(self, b: Block) -> None:
        self._insert_after(self.head, b)

    def remove(self, b: Block) -> None:
        b.prev.next, b.next.prev = b.next, b.prev  # type: ignore[union-attr]
        b.prev = b.next = None
        b.in_free_queue = False
        self.size -= 1

    def pop_front(self) -> Block:
        b = self.head.next
        assert b is not self.tail, "pop from an empty free queue"
        self.remove(b)  # type: ignore[arg-type]
        return b  # type: ignore[return-value]

    def __iter__(self):
        b = self.head.next
        while b is not self.tail:
            yield b
            b = b.next

    def __len__(self) -> int:
        return self.size


class BlockPool:
    """Owns all `num_blocks` blocks (created up front); allocation and free are O(1) per block."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeQueue()
        for b in self.blocks:
            self.free_queue.push_back(b)
        self.hash_to_block: dict[bytes, Block] = {}
        self.children: dict[bytes, dict[Block, None]] = {}  # parent key -> its registered children
        self.num_cached_free = 0  # free blocks that still hold a hash (evictable)
        self.allocations = 0
        self.frees = 0
        self.evictions = 0
        self.events = None  # a KVEventRecorder (kv_events.py): hashes registered / dropped

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free, cached ones included (evicted on demand)."""
        return self.free_queue.size

    def block(self, block_id: int) -> Block:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidBlockError(f"block id {block_id} outside [0, {self.num_blocks})")
        return self.blocks[block_id]

    def allocate(self, n: int) -> list[Block]:
        """Take n blocks from the free-queue front (ref_cnt 1), evicting cached ones lazily."""
        if n > self.free_queue.size:
            raise OutOfBlocksError(n, self.free_queue.size)
        out = []
        for _ in range(n):
            b = self.free_queue.pop_front()
            if b.hash is not None:
                self._drop_hash(b)
                self.num_cached_free -= 1
                self.evictions += 1
            b.ref_cnt = 1
            out.append(b)
        self.allocations += n
        return out

    def free(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the given order (pass a table reversed).

        All-or-nothing: a double free anywhere raises before any count changes.
        """
        blocks = list(blocks)
        need: dict[int, int] = {}
        for b in blocks:
            need[b.block_id] = need.get(b.block_id, 0) + 1
            if need[b.block_id] > b.ref_cnt:
                raise DoubleFreeError(f"block {b.block_id} freed with ref_cnt {b.ref_cnt}")
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.frees += 1
                if b.hash is None:
                    self.free_queue.push_front(b)
                else:
                    self.free_queue.push_back(b)
                    self.num_cached_free += 1

    def free_ids(self, block_ids: Iterable[int]) -> None:
        self.free([self.block(i) for i in block_ids])

    def touch(self, b: Block) -> None:
        """Add a reference to a block found by a prefix hit, reviving it if it was free."""
        if b.ref_cnt == 0:
            self.free_queue.remove(b)
            if b.hash is not None:
                self.num_cached_free -= 1
        b.ref_cnt += 1

    def lookup(self, h: bytes) -> Block | None:
        return self.hash_to_block.get(h)

    def set_hash(self, b: Block, h: bytes, link: tuple[bytes, bytes] | None = None,
                 *, partial: bool = False) -> bool:
        """Register a full, computed block under its chained hash; True if it now holds it.
        `link`: (parent key, token ids as int64 bytes), to find it by a partial match too
        (`best_partial`).

        Identical full blocks are not merged: if another block already holds the hash, this one
        stays unhashed (block tables stay append-only). The caller records the stored event
        (it knows the tokens); the pool records every removal (`_drop_hash`).
        """
        if b.hash is not None or h in self.hash_to_block:
            return False
        b.hash = h
        b.partial = partial
        self.hash_to_block[h] = b
        if link is not None:
            b.link = link
            self.children.setdefault(link[0], {})[b] = None
        return True

    def best_partial(self, key: bytes, ids: bytes, scan: int = PARTIAL_SCAN
                     ) -> tuple[Block | None, int]:
        """(the registered block under parent key `key` whose ids start with the longest run of
        `ids` (int64 bytes), that run's length in tokens; (None, 0) if none starts with the
        first). Looks at the `scan`
        most recently registered children only, so a parent with many is no slower."""
        kids = self.children.get(key)
        best, most = None, 0
        if kids and ids:
            for b in islice(reversed(kids), scan):
                k = _common(b.link[1], ids)  # type: ignore[index]
                if k > most:
                    best, most = b, k
        return best, most

    def drop_hash(self, b: Block) -> None:
        """Forget a block's hash (its contents are about to change)."""
        if b.hash is None:
            return
        if b.in_free_queue:
            self.num_cached_free -= 1
        self._drop_hash(b)

    def _drop_hash(self, b: Block) -> None:
        h = b.hash
        if self.hash_to_block.get(h) is b:  # type: ignore[arg-type]
            del self.hash_to_block[h]  # type: ignore[arg-type]
            if self.events is not None and not b.partial:
                self.events.removed((h,))
        link = b.link
        if link is not None:
            kids = self.children[link[0]]
            del kids[b]
            if not kids:
                del self.children[link[0]]
            b.link = None
        b.hash = None
        b.partial = False

    def evict(self, n: int | None = None) -> int:
        """Drop the hashes of up to n cached free blocks (all if None), LRU first."""
        victims = [b for b in self.free_queue if b.hash is not None]
        if n is not None:
            victims = victims[:n]
        for b in victims:
            self.drop_hash(b)
            self.evictions += 1
        return len(victims)

    def reset_hashes(self) -> None:
        """Empty the prefix index: every block forgets its hash."""
        for b in list(self.hash_to_block.values()):
            self.drop_hash(b)

    def compact(self) -> list[tuple[int, int]]:
        """Renumber the blocks: used ones take the lowest ids, cached free ones the next (their
        data kept), plain free ones the rest. Block objects (and so the hash index and every
        table's list) follow; the caller moves the data and rewrites the table buffers.
        The free queue becomes plain blocks in id order, then cached ones in their LRU order.
        Returns (old id, new id) for every block whose data must move."""
        used = [b for b in self.blocks if b.ref_cnt > 0]
        cached = [b for b in self.free_queue if b.hash is not None]
        plain = [b for b in self.blocks if b.ref_cnt == 0 and b.hash is None]
        order = used + cached + plain
        moves = [(b.block_id, new) for new, b in enumerate(order[: len(used) + len(cached)])
                 if b.block_id != new]
        for new, b in enumerate(order):
            b.block_id = new
        self.blocks = order
        for b in list(self.free_queue):
            self.free_queue.remove(b)
        for b in plain + cached:
            self.free_queue.push_back(b)
        return moves

    def check_refs(self, refs: list[int]) -> None:
        """Assert every block's ref_cnt equals its table references `refs` (by block id)."""
        for b in self.blocks:
            assert b.ref_cnt == refs[b.block_id], (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} != {refs[b.block_id]} table references")

    def check_invariants(self) -> None:
        seen = set()
        for b in self.free_queue:
            assert b.ref_cnt == 0, f"free block {b.block_id} has ref_cnt {b.ref_cnt}"
            assert b.block_id not in seen, f"block {b.block_id} twice in the free queue"
            seen.add(b.block_id)
        assert len(seen) == self.free_queue.size
        for b in self.blocks:
            assert b.ref_cnt >= 0
            assert (b.ref_cnt == 0) == b.in_free_queue, f"block {b.block_id} free xor used broken"
            if b.hash is not None:
                assert self.hash_to_block.get(b.hash) is b, f"block {b.block_id} hash not indexed"
            assert not b.partial or (b.hash is not None and b.link is not None
                                     and b.ref_cnt == 0), f"partial block {b.block_id} in use"
        for h, b in self.hash_to_block.items():
            assert b.hash == h, f"index entry for block {b.block_id} is stale"
        for key, kids in self.children.items():
            assert kids, "an empty children entry"
            for b in kids:
                assert b.hash is not None and b.link is not None and b.link[0] == key, (
                    f"children entry for block {b.block_id} is stale")
        linked = sum(1 for b in self.blocks if b.link is not None)
        assert linked == sum(len(k) for k in self.children.values()), "a link not indexed"
        cached = sum(1 for b in self.free_queue if b.hash is not None)
        assert cached == self.num_cached_free, f"cached free count {self.num_cached_free} != {cached}"
