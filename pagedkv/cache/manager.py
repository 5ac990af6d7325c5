"""PagedKVCache: sequences over a shared BlockPool, each with its block table (block_table.py).

Ownership: a sequence's `TableRow` holds one reference to each block it lists; a block shared by
a fork or a prefix hit has one reference per table that lists it. Only the last block of a table
can be partly filled, and only it is ever written by an append; if it is shared, the writer first
gets a private copy (`BlockTable.copy_on_write`, the cache's one copy-on-write), so no sequence
ever sees another's later writes. (A partial prefix hit also copies a block, but into a fresh
block of the new sequence's own: nothing shared is ever written.) Nothing outside this module,
block_table.py and block_pool.py touches the pool: the engine uses the calls below
(`cached_prefix_len`, `cached_blocks`, `import_cached`, `attach_tier`, `block_states`).

Hashes: a sequence's token ids and their block hashes are a `HashChain` (hashing.py): the caller's
(the engine's Sequence owns one and appends to it before growing the cache by a count) or one the
cache builds from the ids it is given (direct users: tests, the demo, the benchmarks). Each block
is hashed once, by the chain; a full block is registered under its hash once its K/V are computed
(`computed=True` on create/append, or `mark_computed` after the forward pass that wrote them): a
block is never findable by a prefix lookup before its K/V exist. A full block never changes again
unless `truncate` makes it a partial last block again: then, if no one else holds it, its hash is
dropped before it can be overwritten. The cache applies its context edits (truncate, remove,
copy) to the chain too, so the chain always holds the sequence's context, plus ids its owner
appended ahead of the cache.

Validation: every public method checks its arguments (sequence ids hashable, token ids ints
within int64, paired lists of equal length) before it changes anything, and reports bad input
as a PagedKVError (InvalidArgumentError, PositionError, UnknownSequenceError...).
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from operator import index
from typing import Any

import numpy as np
import torch

from pagedkv.cache import seq_ops
from pagedkv.cache.block_pool import NULL_BLOCK, Block, BlockPool
from pagedkv.cache.block_table import BlockTable, TableRow
from pagedkv.cache.groups import KVGroups, single_group
from pagedkv.cache.hashing import HashChain
from pagedkv.cache.storage import KVStorage
from pagedkv.errors import (
    CacheConfigError,
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    PositionError,
    SlidingWindowError,
    StorageMismatchError,
    UnknownSequenceError,
)

SeqId = Hashable
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(slots=True, eq=False)
class SeqState:
    """One sequence in the cache. Invariants: each of `tables` (one TableRow per KV group,
    all at the same buffer row; `table` is group 0's) lists ceil(num_tokens / block_size)
    entries, a window group's leading ones NULL_BLOCK (given back); `chain` (None: ids
    unknown, a bare count, never hashed) holds at least num_tokens ids;
    num_hashed <= num_written // block_size, and its first num_hashed blocks were registered
    under chain.hashes, keyed by group (a block keeps that hash until the pool drops it).
    `lookahead` slots past num_tokens (speculative drafts) are listed too, in every group,
    while a step verifies them, 0 between steps."""

    seq_id: SeqId
    table: TableRow
    chain: HashChain | None
    num_tokens: int = 0
    num_written: int = 0  # tokens whose K/V are written; full blocks below are hashed
    num_hashed: int = 0  # leading blocks registered under their chain hash
    hash_limit: int | None = None  # blocks from here on were edited (seq_ops): never hashed
    tier_tokens: int = 0  # prompt tokens whose K/V were loaded from the KV tier at creation
    tables: list[TableRow] = None  # type: ignore[assignment]  # per group; None: [table]
    lookahead: int = 0  # slots reserved past num_tokens for draft tokens (speculative decoding)
    blocks: list[Block] = field(init=False)  # table.blocks itself (the table edits it in place)
    row: int = field(init=False)  # table.index (fixed for the sequence's life)

    def __post_init__(self) -> None:
        if self.tables is None:
            self.tables = [self.table]
        self.blocks = self.table.blocks
        self.row = self.table.index

    @property
    def token_ids(self) -> list[int] | None:
        """The ids the cache holds (a copy), None for a bare count."""
        return None if self.chain is None else self.chain.ids[: self.num_tokens]

    @property
    def block_hashes(self) -> list[bytes]:
        """Hashes of the blocks registered so far, in order."""
        return [] if self.chain is None else self.chain.hashes[: self.num_hashed]

    @property
    def extra_key(self) -> object:
        return None if self.chain is None else self.chain.extra_key

    def freeze(self, first_block: int) -> None:
        """Blocks from `first_block` on no longer equal a fresh prefill: never hash them."""
        self.num_hashed = min(self.num_hashed, first_block)
        limit = self.hash_limit
        self.hash_limit = first_block if limit is None else min(limit, first_block)


@dataclass(slots=True)
class CacheStats:
    num_blocks: int
    block_size: int
    used_blocks: int
    free_blocks: int  # includes cached ones (they are evictable)
    cached_blocks: int  # free blocks still holding a prefix hash
    active_sequences: int
    live_tokens: int  # distinct token slots holding live data (shared blocks counted once)
    utilization: float  # live_tokens / (used_blocks * block_size)
    usage: float  # used_blocks / num_blocks
    internal_waste: int  # unused slots inside used blocks
    holes: int  # free blocks below the highest used block id
    largest_free_run: int  # longest run of consecutive free block ids
    external_fragmentation: float  # 1 - largest_free_run / free_blocks
    allocations: int
    frees: int
    cow_copies: int
    evictions: int
    prefix_queries: int  # tokens looked up
    prefix_hits: int  # tokens served from the cache
    prefix_hit_rate: float
    partial_hits: int  # of prefix_hits: tokens copied from the leading part of a cached block
    memory_used_bytes: int
    memory_total_bytes: int


def _as_list(values: Any) -> list:
    if isinstance(values, str | bytes | dict | set) or not hasattr(values, "__iter__"):
        raise InvalidArgumentError(f"a list of ints expected, got {values!r:.80}")
    return list(values)


def _check_ids(ids: list) -> list[int]:
    """`ids` as plain ints, each within int64 (what the hashes and tensors store)."""
    if not all(type(t) is int for t in ids):
        ids = [_as_int(t) for t in ids]
    if ids and (min(ids) < INT64_MIN or max(ids) > INT64_MAX):
        raise InvalidArgumentError("token ids must fit in int64")
    return ids


def _as_int(value: Any) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"an int expected, got {value!r:.80}")
    return index(value)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


TABLE_COLS = 4096  # the block tables' widest first width (64k tokens at 16 a block)


class PagedKVCache:
    """Sequences, block tables, sharing and prefix caching over a pool of `num_blocks` blocks.

    `storage` (optional) holds the K/V data; when given, copy-on-write and defragmentation move
    data there too. Without it the cache does pure bookkeeping (for simulations).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        *,
        storage: KVStorage | None = None,
        enable_prefix_caching: bool = True,
        max_seq_len: int | None = None,
        bytes_per_block: int | None = None,
        groups: KVGroups | None = None,
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise CacheConfigError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise CacheConfigError(f"block_size must be a positive int, got {block_size!r}")
        if storage is not None and (
            storage.num_blocks != num_blocks or storage.block_size != block_size
        ):
            raise StorageMismatchError(
                f"storage has {storage.num_blocks} blocks of {storage.block_size}, cache wants "
                f"{num_blocks} of {block_size}"
            )
        if groups is None:
            groups = single_group(storage.num_layers if storage is not None else 1)
        if not isinstance(groups, KVGroups):
            raise CacheConfigError(f"groups must be KVGroups, got {groups!r:.80}")
        if storage is not None and storage.num_layers != groups.layers_per_group:
            raise StorageMismatchError(f"storage has {storage.num_layers} layers per block, the "
                                       f"groups {groups.layers_per_group}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.storage = storage
        self.enable_prefix_caching = enable_prefix_caching
        self.bytes_per_block = bytes_per_block or (storage.bytes_per_block if storage else 0)
        self.groups = groups
        self.num_groups = groups.num_groups
        # (group, window) of each sliding-window group; a plain cache (one full group) takes
        # the single-group fast paths, exactly the cache before groups existed
        self._windows = [(g, w) for g, w in enumerate(groups.windows) if w is not None]
        self._full = [g for g, w in enumerate(groups.windows) if w is None]
        self._plain = groups.num_groups == 1 and not self._windows
        self._pool = BlockPool(num_blocks)
        # the tables' first width: a sequence's row grows past it on demand (BlockTable._write),
        # so a model whose metadata claims a huge context costs nothing until one is that long
        cols = min(_cdiv(max_seq_len, block_size), TABLE_COLS) if max_seq_len else min(num_blocks, 64)
        copy = None if storage is None else storage.copy_blocks
        self.tables = [BlockTable(self._pool, block_size, cols, copy) for _ in groups.windows]
        self.table = self.tables[0]
        self.seqs: dict[SeqId, SeqState] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0  # tokens served: whole blocks + partial_hits
        self.partial_hits = 0  # tokens served by copying the leading part of a cached block
        self.tier = None  # a TierConnector (pagedkv.cache.tiers): the second level under the pool
        self.rotate_k: seq_ops.RotateK | None = None
        self.events = None  # a KVEventRecorder (attach_events)

    # --- queries ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    @property
    def cow_copies(self) -> int:
        return sum(t.cow_copies for t in self.tables)

    @property
    def token_capacity(self) -> int:
        """The most tokens one sequence can hold (all its groups' blocks allocated)."""
        return self.num_blocks // self.num_groups * self.block_size

    def group_key(self, h: bytes, group: int) -> bytes:
        """The pool's key of group `group`'s block under chain hash h (group 0: h itself)."""
        return h if group == 0 else h + group.to_bytes(2, "big")

    @property
    def num_evictions(self) -> int:
        return self._pool.evictions

    def seq(self, seq_id: SeqId) -> SeqState:
        try:
            return self.seqs[seq_id]
        except (KeyError, TypeError):
            raise UnknownSequenceError(f"unknown sequence {seq_id!r}") from None

    def _seqs_of(self, seq_ids: Sequence[SeqId]) -> list[SeqState]:
        """States of a batch of sequences (UnknownSequenceError for the first unknown id)."""
        if isinstance(seq_ids, str | bytes) or not isinstance(seq_ids, Sequence):
            raise InvalidArgumentError(f"a list of sequence ids expected, got {seq_ids!r:.80}")
        try:
            return [self.seqs[i] for i in seq_ids]
        except (KeyError, TypeError):
            for i in seq_ids:
                self.seq(i)  # raises the typed error
            raise

    def __repr__(self) -> str:
        """Counts only (O(1)): `PagedKVCache(1024 blocks x 16 tokens: 12 used, 3 cached,
        1009 free; 2 sequences; prefix caching on)`. `stats()` has the rest."""
        free = self._pool.num_free
        return (f"PagedKVCache({self.num_blocks} blocks x {self.block_size} tokens: "
                f"{self.num_blocks - free} used, {self._pool.num_cached_free} cached, {free} free; "
                f"{len(self.seqs)} sequences; prefix caching "
                f"{'on' if self.enable_prefix_caching else 'off'})")

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self.seqs

    def num_tokens(self, seq_id: SeqId) -> int:
        return self.seq(seq_id).num_tokens

    def block_ids(self, seq_id: SeqId, group: int = 0) -> list[int]:
        """Group `group`'s block ids of the sequence (-1: a window group gave it back)."""
        return [b.block_id for b in self._row(self.seq(seq_id), group).blocks]

    def held_blocks(self, seq_id: SeqId) -> int:
        """Blocks the sequence's tables hold, every group (given-back entries not counted)."""
        return sum(len(r.blocks) - r.start for r in self.seq(seq_id).tables)

    def seq_pos_min(self, seq_id: SeqId) -> int:
        """The first position whose K/V every group still holds (llama.cpp's seq_pos_min):
        0 unless a window group gave blocks back. Truncating below what the window needs from
        here, or a range operation, is a SlidingWindowError."""
        s = self.seq(seq_id)
        return max((s.tables[g].start for g, _ in self._windows), default=0) * self.block_size

    def _row(self, s: SeqState, group: int) -> TableRow:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_groups:
            raise InvalidArgumentError(f"group must be an int in [0, {self.num_groups}), got "
                                       f"{group!r:.40}")
        return s.tables[group]

    def block_token_counts(self, seq_id: SeqId) -> list[int]:
        """Tokens this sequence holds in each of its blocks (all full but maybe the last)."""
        s = self.seq(seq_id)
        bs = self.block_size
        return [min(bs, s.num_tokens - i * bs) for i in range(len(s.blocks))]

    def block_states(self) -> tuple[np.ndarray, np.ndarray]:
        """(int32 [num_blocks] reference counts, bool [num_blocks] holds a prefix hash), by
        block id: a read-only picture of the pool (block maps, tests)."""
        blocks, n = self._pool.blocks, self.num_blocks
        refs = np.fromiter((b.ref_cnt for b in blocks), np.int32, n)
        hashed = np.fromiter((b.hash is not None for b in blocks), np.bool_, n)
        return refs, hashed

    def slot(self, seq_id: SeqId, pos: int, group: int = 0) -> int:
        """Cache slot of token `pos` in group `group`: block_id * block_size + offset."""
        s = self.seq(seq_id)
        r = self._row(s, group)
        pos = _as_int(pos)
        if not 0 <= pos < s.num_tokens:
            raise PositionError(f"position {pos} outside sequence {seq_id!r} of {s.num_tokens}")
        b, o = divmod(pos, self.block_size)
        if b < r.start:
            raise SlidingWindowError(f"position {pos} of {seq_id!r}: group {group} gave its "
                                     f"block back (before the window)")
        return r.blocks[b].block_id * self.block_size + o

    def blocks_needed(self, num_tokens: int, seq_id: SeqId | None = None) -> int:
        """New blocks to hold `num_tokens` more tokens (for `seq_id`, or a new sequence)."""
        num_tokens = _as_int(num_tokens)
        if seq_id is None:
            return _cdiv(num_tokens, self.block_size) * self.num_groups
        s = self.seq(seq_id)
        grow = _cdiv(s.num_tokens + num_tokens, self.block_size) - len(s.blocks)
        return grow * self.num_groups + (self.needs_cow(s) if num_tokens > 0 else 0)

    def needs_cow(self, s: SeqState) -> int:
        """Copies writing s's next token takes first: one per group whose last block is partial
        and shared (a plain cache: 0 or 1)."""
        if s.num_tokens % self.block_size == 0:
            return 0
        return sum(1 for r in s.tables if r.blocks[-1].ref_cnt > 1)

    # --- lifecycle ----------------------------------------------------------------------------

    def create(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int] | int | HashChain,
        *,
        extra_key: object = None,
        computed: bool = True,
        reserve: int = 0,
    ) -> int:
        """Add a sequence holding `token_ids`: ids (the cache keeps them in its own HashChain),
        a count of unknown tokens (never hashed), or the owner's HashChain (the sequence holds
        all its ids; its extra key is the chain's, and the owner appends to it first, then
        grows the sequence by a count).

        `reserve`: fail unless this many free blocks remain afterwards (a scheduler's headroom
        for the sequences already running).

        Reuses cached blocks of the longest cached prefix (capped at len - 1 tokens, so the last
        token is always computed for its logits) and allocates the rest. The first block to
        compute may be a partial hit: a cached block (per group) under the same parent
        whose leading ids it repeats is copied into it, and those tokens count as cached (as
        llama.cpp's slots and SGLang's radix tree reuse tokens, not blocks). With a KV tier
        attached, the blocks that follow the device hits are asked from the tier, in order, and
        every hit is loaded into the first freshly allocated blocks. Returns the number of
        tokens served from the prefix cache (device + tier; `seq(id).tier_tokens` says how many
        came from the tier). All-or-nothing: OutOfBlocksError changes nothing.
        """
        out = self.try_create(seq_id, token_ids, extra_key=extra_key, computed=computed,
                              reserve=reserve)
        if isinstance(out, OutOfBlocksError):
            raise out
        return out

    def try_create(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int] | int | HashChain,
        *,
        extra_key: object = None,
        computed: bool = True,
        reserve: int = 0,
        tier_read: object = None,
    ) -> int | OutOfBlocksError:
        """`create`, except that not fitting is an expected outcome: it returns the
        OutOfBlocksError (nothing changed) instead of raising it. Bad arguments still raise.
        `tier_read` (from `read_ahead`): the tier blocks are taken from what it has fetched
        (none of the I/O happens here)."""
        self.check_new_id(seq_id)
        chain, n = self._chain_of(token_ids, extra_key)
        if not self._plain:
            return self._try_create_groups(seq_id, chain, n, computed, reserve, tier_read)
        hits, limit = self._find_cached(chain, n)
        needed = _cdiv(n, self.block_size) - len(hits)
        revived = sum(1 for b in hits if b.ref_cnt == 0)  # touching them takes them off the queue
        available = self._pool.num_free - revived - reserve
        if needed > available:
            return OutOfBlocksError(needed, available, f"sequence {seq_id!r}")
        ask = chain.hashes[len(hits) : limit] if chain is not None and self.tier else []
        loaded = self.tier.fetch(ask, chain.extra_key, tier_read) if ask else []  # type: ignore[union-attr]
        i = len(hits) + len(loaded)  # the first block to compute
        srcs, k = self._partial(chain, n, i)
        s = SeqState(seq_id, self.table.open(hits, needed), chain, n)
        if k:  # copied before the tier blocks land: the allocation may have handed srcs to s
            self._copy_partial(srcs, s.tables, i, k)
        links = [chain.link(j) for j in range(len(hits), i)]  # type: ignore[union-attr]
        self._load(s.blocks[len(hits) : i], ask, loaded, chain, len(hits), links)
        s.num_hashed = i
        s.num_written = cached = i * self.block_size + k
        s.tier_tokens = len(loaded) * self.block_size
        self.seqs[seq_id] = s
        if chain is not None and self.enable_prefix_caching:
            self.prefix_queries += n
            self.prefix_hits += len(hits) * self.block_size + k
        if computed:
            self.mark_computed(seq_id, n)
        return cached

    def _partial(self, chain: HashChain | None, n: int, i: int) -> tuple[list[Block], int]:
        """A partial hit for block i, the first a new sequence of chain's first n ids must
        compute: (per group, a cached block under block i's parent key (the group's) whose
        leading ids repeat block i's; how many, in every group: at most n - 1 - i * block_size,
        so the last token is computed), else ([], 0)."""
        bs = self.block_size
        if chain is None or not chain.hashed or not self.enable_prefix_caching:
            return [], 0
        most = min(bs - 1, n - 1 - i * bs)
        if most < 1:
            return [], 0
        ids, key = array("q", chain.ids[i * bs : i * bs + most]).tobytes(), chain.parent_key(i)
        out = []
        for g in range(self.num_groups):
            b, most = self._pool.best_partial(self.group_key(key, g), ids[: 8 * most])
            if b is None:
                return [], 0
            out.append(b)
        return out, most

    def _copy_partial(self, srcs: list[Block], rows: list[TableRow], i: int, k: int) -> None:
        """Each group's block i (fresh, this sequence's) gets its source's K/V whole (one
        copy: every source read before any block is written); its first k slots are the hit,
        the rest are overwritten as the sequence computes them."""
        if self.table.copy_blocks is not None:
            self.table.copy_blocks([b.block_id for b in srcs], [r.blocks[i].block_id for r in rows])
        self.partial_hits += k

    def _link(self, chain: HashChain, i: int, g: int, w: int | None = None
              ) -> tuple[bytes, bytes]:
        """Group g's link of chain's block i (its first w ids): the parent key is the group's."""
        key, ids = chain.link(i, w)
        return self.group_key(key, g), ids

    def _try_create_groups(self, seq_id: SeqId, chain: HashChain | None, n: int, computed: bool,
                           reserve: int, tier_read: object) -> int | OutOfBlocksError:
        """try_create over several groups (or a window group): the hit is the longest prefix
        every group can serve (`_prefix_len`); each group's table lists its hits (a window
        group: NULL_BLOCK before the window, never allocated) then fresh blocks; tier blocks
        are asked block-major over the groups and taken for whole blocks of every group."""
        bs, ng = self.block_size, self.num_groups
        m, limit = 0, 0
        if chain is not None and self.enable_prefix_caching and n >= 2:
            limit = min((n - 1) // bs, len(chain.hashes))
            m = self._prefix_len(chain.hashes, limit)
        hits = self._hits(chain.hashes, m) if m else [[] for _ in range(ng)]  # type: ignore[union-attr]
        fresh = _cdiv(n, bs) - m
        needed = fresh * ng
        revived = sum(1 for h in hits for b in h if b is not NULL_BLOCK and b.ref_cnt == 0)
        available = self._pool.num_free - revived - reserve
        if needed > available:
            return OutOfBlocksError(needed, available, f"sequence {seq_id!r}")
        ask = self._tier_ask(chain.hashes, m, limit) if chain is not None and self.tier else []
        loaded = self.tier.fetch(ask, chain.extra_key, tier_read) if ask else []  # type: ignore[union-attr]
        t = len(loaded) // ng  # whole blocks: every group's part arrived
        i = m + t  # the first block to compute
        srcs, k = self._partial(chain, n, i)
        # every group's hits are revived before any group allocates: an allocation evicts
        # from the free queue, where another group's hits may still be
        rows = [table.open(h) for table, h in zip(self.tables, hits, strict=True)]
        for table, r in zip(self.tables, rows, strict=True):
            table.grow(r, fresh)
        assert len({r.index for r in rows}) == 1, "group tables out of step"
        s = SeqState(seq_id, rows[0], chain, n, tables=rows)
        if k:  # before the tier blocks land (as in try_create)
            self._copy_partial(srcs, rows, i, k)
        links = [self._link(chain, m + j, g) for j in range(t) for g in range(ng)]  # type: ignore[arg-type]
        self._load([rows[g].blocks[m + j] for j in range(t) for g in range(ng)], ask,
                   loaded[: t * ng], links=links)
        s.num_hashed = i
        s.num_written = cached = i * bs + k
        s.tier_tokens = t * bs
        self.seqs[seq_id] = s
        if chain is not None and self.enable_prefix_caching:
            self.prefix_queries += n
            self.prefix_hits += m * bs + k
        if computed:
            self.mark_computed(seq_id, n)
        else:
            self._release_window(s)
        return cached

    def _chain_of(self, token_ids: object, extra_key: object) -> tuple[HashChain | None, int]:
        """(the new sequence's chain, its token count); validates only."""
        if isinstance(token_ids, HashChain):
            if token_ids.block_size != self.block_size:
                raise CacheConfigError(f"a chain of {token_ids.block_size}-token blocks for a "
                                       f"cache of {self.block_size}")
            if extra_key is not None and extra_key != token_ids.extra_key:
                raise CacheConfigError("a chain carries its own extra key")
            _check_ids(token_ids.ids)
            return token_ids, len(token_ids)
        ids = self._as_ids(token_ids)
        if ids is None:
            return None, _as_int(token_ids)
        return HashChain(self.block_size, ids, extra_key, hashed=self.enable_prefix_caching), len(ids)

    def _load(self, blocks: list[Block], hashes: Sequence[bytes], parts: Sequence,
              chain: HashChain | None = None, first: int = 0, links: Sequence | None = None
              ) -> None:
        """Copy tier/snapshot block contents into `blocks` and register them under `hashes`
        (the one path by which K/V from outside the pool become prefix blocks). `chain`:
        the sequence whose blocks `first`, `first + 1`... these are (for the stored events'
        parent and token ids; a snapshot import has none). `links`: the blocks' links, for
        partial hits (a snapshot import has none: its blocks are found whole only)."""
        storage = self.storage
        events = self.events
        for i, (b, h, p) in enumerate(zip(blocks, hashes, parts, strict=False)):
            if storage is not None:
                storage.import_blocks([b.block_id], {k: t.unsqueeze(0) for k, t in p.items()})
            if self._pool.set_hash(b, h, links[i] if links else None) and events is not None:
                if chain is None:
                    events.stored((h,), None, None)
                else:
                    self._record_stored(chain, first + i, first + i + 1)

    def attach_events(self, recorder: object | None) -> None:
        """Record, from now on, every block that becomes findable or stops being findable (a
        KVEventRecorder; None stops recording)."""
        self.events = recorder
        self._pool.events = recorder

    def _record_stored(self, chain: HashChain, start: int, stop: int) -> None:
        """One stored event for chain's blocks [start, stop) (just registered, in order)."""
        bs = self.block_size
        parent = chain.hashes[start - 1] if start else None
        ids = None if chain.extra_key is not None else chain.ids[start * bs : stop * bs]
        self.events.stored(chain.hashes[start:stop], parent, ids)  # type: ignore[union-attr]

    def append(self, seq_id: SeqId, token_ids: Sequence[int] | int, *, computed: bool = True) -> None:
        """Append tokens, allocating blocks as needed; a shared last block is copied first.

        A count grows the sequence into ids its chain holds already (its owner appended them);
        ids extend the chain (which must hold no more ids than the sequence).
        All-or-nothing: OutOfBlocksError changes nothing.
        """
        s = self.seq(seq_id)
        ids = self._as_ids(token_ids)
        k = len(ids) if ids is not None else _as_int(token_ids)
        if k == 0:
            return
        self._check_growth(s, ids, k)
        grow = _cdiv(s.num_tokens + k, self.block_size) - len(s.blocks)
        need = grow * self.num_groups + self.needs_cow(s)
        if need > self._pool.num_free:
            raise OutOfBlocksError(need, self._pool.num_free, f"append to {seq_id!r}")
        for table, r in zip(self.tables, s.tables, strict=True):
            if s.num_tokens % self.block_size:
                table.before_write(r, len(r.blocks) - 1)
            table.grow(r, grow)
        if ids is not None and s.chain is not None:
            s.chain.extend(ids)
        s.num_tokens += k
        if computed:
            self.mark_computed(seq_id, s.num_tokens)

    @staticmethod
    def _check_growth(s: SeqState, ids: list[int] | None, k: int) -> None:
        """Ids need a chain holding exactly the sequence's ids; a count needs a chain holding
        k ids ahead of it, or no chain (a bare count)."""
        if s.chain is None:
            if ids is not None:
                raise CacheConfigError("mixing known token ids and bare counts in one sequence")
            return
        ahead = len(s.chain) - s.num_tokens
        if ids is not None and ahead:
            raise CacheConfigError(f"{s.seq_id!r}: its owner appends its ids; grow it by a count")
        if ids is None and not ahead:
            raise CacheConfigError("mixing known token ids and bare counts in one sequence")
        if ids is None and ahead < k:
            raise PositionError(f"{s.seq_id!r}: its chain holds only {ahead} ids ahead")

    def append_one_each(
        self,
        seq_ids: Sequence[SeqId],
        token_ids: Sequence[int] | None = None,
        *,
        computed: bool = True,
    ) -> None:
        """Decode fast path: append one token to each sequence (all-or-nothing).

        `token_ids` None: every sequence grows by one into its chain (its owner appended the
        id already) or is a bare count. `computed=False` (the engine): the new tokens' K/V are
        not written yet; the caller calls `mark_computed` after the forward pass, so no hash
        ever names unwritten K/V. Every argument is checked before anything changes: each id
        known and listed once, one token per sequence.
        """
        bs = self.block_size
        seqs = self._seqs_of(seq_ids)
        if len(set(seq_ids)) != len(seqs):
            raise CacheConfigError("a sequence is listed twice in one decode step")
        if token_ids is None:
            for s in seqs:
                if s.chain is not None and len(s.chain.ids) <= s.num_tokens:
                    raise CacheConfigError("append_one_each without ids needs chains one id ahead")
        else:
            token_ids = _check_ids(_as_list(token_ids))
            if len(token_ids) != len(seqs):
                raise CacheConfigError(f"{len(token_ids)} tokens for {len(seqs)} sequences")
            for s in seqs:
                if s.chain is None or len(s.chain.ids) != s.num_tokens:
                    raise CacheConfigError("append_one_each with ids needs sequences holding theirs")
        need = self._one_each_need(seqs)
        if need > self._pool.num_free:
            raise OutOfBlocksError(need, self._pool.num_free, "decode step")
        table, plain = self.table, self._plain
        for i, s in enumerate(seqs):
            n = s.num_tokens
            blocks = s.blocks
            if not plain:
                self._grow_one_groups(s)
            elif n % bs == 0:
                table.grow(s.table, 1)
            elif blocks[-1].ref_cnt > 1 or blocks[-1].hash is not None:
                table.before_write(s.table, len(blocks) - 1)
            c = s.chain
            if token_ids is not None and c is not None:  # (checked above: ids need a chain)
                ids = c.ids
                ids.append(token_ids[i])
                if len(ids) % bs == 0:
                    c.rehash()  # before _register reads the new block's hash
            s.num_tokens = n = n + 1
            if computed:
                s.num_written = n
                if n % bs == 0:
                    self._register(s)
                if not plain:
                    self._release_window(s)

    def _grow_one_groups(self, s: SeqState) -> None:
        """append_one_each's growth of one sequence in every group."""
        at_boundary = s.num_tokens % self.block_size == 0
        for table, r in zip(self.tables, s.tables, strict=True):
            last = r.blocks[-1] if r.blocks else None
            if at_boundary:
                table.grow(r, 1)
            elif last.ref_cnt > 1 or last.hash is not None:  # type: ignore[union-attr]
                table.before_write(r, len(r.blocks) - 1)

    def blocks_needed_one_each(self, seq_ids: Sequence[SeqId]) -> int:
        """Free blocks `append_one_each(seq_ids)` takes: a new block for each sequence at a block
        boundary, and a copy for each writer of a shared partial block except the last holder
        (when every holder of the block is in the batch, the last writes it in place)."""
        return self._one_each_need(self._seqs_of(seq_ids))

    def _one_each_need(self, seqs: list[SeqState]) -> int:
        bs, ng = self.block_size, self.num_groups
        need = 0
        sharers: dict[int, list] = {}  # shared partial block id -> [block, holders in batch]
        for s in seqs:
            if s.num_tokens % bs == 0:
                need += ng
                continue
            for r in s.tables:
                b = r.blocks[-1]
                if b.ref_cnt > 1:
                    got = sharers.setdefault(b.block_id, [b, 0])
                    got[1] += 1
        for b, k in sharers.values():
            need += k - (k == b.ref_cnt)
        return need

    # --- lookahead slots (speculative decoding) ------------------------------------------------

    def try_lookahead(self, seq_id: SeqId, k: int) -> bool:
        """Reserve slots for `k` draft tokens after the sequence's last token (vLLM's lookahead
        slots) in every KV group: the verifying forward pass writes their K/V there. Not
        fitting is a value: False, nothing changed. The slots hold no token of the sequence:
        no hash, no prefix hit, never shared; `accept_lookahead` turns the accepted ones into
        tokens and gives the rest back. Needs private last blocks (the decode append copied
        shared ones)."""
        s = self.seq(seq_id)
        k = _as_int(k)
        if k < 0 or s.lookahead:
            raise PositionError(f"{seq_id!r}: lookahead of {k} over {s.lookahead} reserved")
        bs = self.block_size
        if s.num_tokens % bs and any(r.blocks[-1].ref_cnt > 1 or r.blocks[-1].hash is not None
                                     for r in s.tables):
            raise CacheConfigError(f"{seq_id!r}: lookahead slots after a shared or hashed block")
        grow = _cdiv(s.num_tokens + k, bs) - len(s.blocks)  # the same in every group
        if grow * self.num_groups > self._pool.num_free:
            return False
        for table, r in zip(self.tables, s.tables, strict=True):
            table.grow(r, grow)
        s.lookahead = k
        return True

    def accept_lookahead(self, seq_id: SeqId, m: int) -> None:
        """The first `m` reserved slots were accepted: they become the sequence's next tokens
        (ids its owner appended to the chain already, or a bare count without a chain; K/V
        written by the verifying pass, so full blocks are registered now, and window groups
        give back what the accepted positions moved out of their window); the other slots'
        blocks go back in every group. m = 0 only releases."""
        s = self.seq(seq_id)
        m = _as_int(m)
        if not 0 <= m <= s.lookahead:
            raise PositionError(f"{seq_id!r}: {m} accepted of {s.lookahead} lookahead slots")
        if m and s.chain is not None and len(s.chain) - s.num_tokens < m:
            raise PositionError(f"{seq_id!r}: its chain holds fewer than {m} ids ahead")
        s.num_tokens += m
        s.lookahead = 0
        keep = _cdiv(s.num_tokens, self.block_size)
        for table, r in zip(self.tables, s.tables, strict=True):
            table.cut(r, keep)
        if m:  # the verifying pass wrote every token up to here
            s.num_written = s.num_tokens
            self._register(s)
            if self._windows:
                self._release_window(s)

    def mark_computed(self, seq_id: SeqId, num_tokens: int) -> None:
        """Record that the first `num_tokens` tokens' K/V are written; register the full blocks
        under their chain hashes (and offer them to the tier)."""
        s = self.seq(seq_id)
        num_tokens = _as_int(num_tokens)
        if not 0 <= num_tokens <= s.num_tokens:
            raise PositionError(f"{num_tokens} computed tokens outside 0..{s.num_tokens}")
        if num_tokens > s.num_written:
            s.num_written = num_tokens
        self._register(s)
        if self._windows:
            self._release_window(s)

    def _register(self, s: SeqState) -> None:
        """Register s's full written blocks not registered yet under their chain hashes (each
        group's under its group key)."""
        if not self.enable_prefix_caching or s.chain is None:
            return
        hashes = s.chain.hashes
        stop = min(s.num_written // self.block_size, len(hashes))
        if s.hash_limit is not None:
            stop = min(stop, s.hash_limit)
        if not self._plain:
            self._register_groups(s, stop)
            return
        blocks = s.blocks
        run = s.num_hashed  # start of the run of blocks registered here (one stored event)
        for i in range(s.num_hashed, stop):
            if not self._pool.set_hash(blocks[i], hashes[i], s.chain.link(i)):
                if self.events is not None and run < i:
                    self._record_stored(s.chain, run, i)
                run = i + 1  # an identical block holds the hash already: not stored again
            if self.tier is not None:
                self.tier.offer(hashes[i], blocks[i], s.chain.extra_key)
        if self.events is not None and run < stop:
            self._record_stored(s.chain, run, stop)
        s.num_hashed = max(s.num_hashed, stop)

    def _register_groups(self, s: SeqState, stop: int) -> None:
        hashes, key, tier = s.chain.hashes, self.group_key, self.tier  # type: ignore[union-attr]
        for i in range(s.num_hashed, stop):
            for g, r in enumerate(s.tables):
                b = r.blocks[i]
                if b is NULL_BLOCK:
                    continue
                k = key(hashes[i], g)
                if self._pool.set_hash(b, k, self._link(s.chain, i, g)) and self.events is not None:
                    self._record_group_stored(s.chain, i, g)
                if tier is not None:
                    tier.offer(k, b, s.chain.extra_key)  # type: ignore[union-attr]
        s.num_hashed = max(s.num_hashed, stop)

    def _record_group_stored(self, chain: HashChain, i: int, g: int) -> None:
        """Block i of group g was registered under its group key (parent: block i - 1's)."""
        bs, key = self.block_size, self.group_key
        parent = key(chain.hashes[i - 1], g) if i else None
        ids = None if chain.extra_key is not None else chain.ids[i * bs : (i + 1) * bs]
        self.events.stored((key(chain.hashes[i], g),), parent, ids)  # type: ignore[union-attr]

    def _release_window(self, s: SeqState) -> None:
        """Window groups give back the blocks wholly before what the next computed position
        (num_written) attends to: p - window < j. Hashed ones stay cached (still hits)."""
        bs = self.block_size
        for g, w in self._windows:
            first = max(0, s.num_written - w + 1) // bs
            r = s.tables[g]
            if first > r.start:
                self.tables[g].release_before(r, first)

    def fork(self, src: SeqId, dst: SeqId, chain: HashChain | None = None) -> None:
        """`dst` shares every block of `src` (ref counts + 1); writes copy on demand.

        `chain`: dst's owner's chain (starting with src's ids, taken as with `create`);
        otherwise dst gets a copy of src's ids and hashes.
        """
        s = self.seq(src)
        self.check_new_id(dst)
        if chain is not None and (not isinstance(chain, HashChain) or len(chain) < s.num_tokens
                                  or chain.block_size != self.block_size):
            raise CacheConfigError(f"fork {dst!r}: the owner's chain must hold src's tokens")
        if chain is None and s.chain is not None:
            chain = s.chain.prefix(s.num_tokens)
        rows = [table.open(r.blocks) for table, r in zip(self.tables, s.tables, strict=True)]
        t = SeqState(dst, rows[0], chain, s.num_tokens, s.num_written, s.num_hashed,
                     s.hash_limit, tables=rows)
        self.seqs[dst] = t

    def free(self, seq_id: SeqId) -> None:
        """Release a sequence: its blocks lose one reference, tail first (evicted first). Its
        partial last block, if written and held by it alone, stays cached for partial hits
        (`_keep_partial`), named by the ids its chain holds there: a chain another cache
        shares (a draft model's) must not have been edited through that one first."""
        s = self.seq(seq_id)
        self._keep_partial(s)
        for table, r in zip(self.tables, s.tables, strict=True):
            table.close(r)
        del self.seqs[seq_id]

    def _keep_partial(self, s: SeqState) -> None:
        """Index the written part of s's last block, partly written and s's alone, as a
        partial block (as llama.cpp's slot keeps a finished conversation: the next turn, or
        the same prompt again, reuses it token by token). Not for edited blocks (hash_limit),
        bare counts, or with prefix caching off. A hybrid cache keeps each group's."""
        c = s.chain
        if c is None or not c.hashed or not self.enable_prefix_caching:
            return
        i, w = divmod(s.num_written, self.block_size)
        if w == 0 or (s.hash_limit is not None and i >= s.hash_limit):
            return
        if len(c) < s.num_written or len(c.hashes) < i:
            return  # not the chain the K/V were computed from (its owner edited it): keep none
        key = c.partial_key(i, w)
        for g, r in enumerate(s.tables):
            b = r.blocks[i]
            if b is not NULL_BLOCK and b.ref_cnt == 1 and b.hash is None:
                self._pool.set_hash(b, self.group_key(key, g), self._link(c, i, g, w), partial=True)

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (context trimming); later blocks go back.
        The chain loses the same ids (ids its owner appended ahead are kept)."""
        s = self.seq(seq_id)
        num_tokens = _as_int(num_tokens)
        if not 0 <= num_tokens <= s.num_tokens:
            raise PositionError(f"cannot truncate {seq_id!r} of {s.num_tokens} to {num_tokens}")
        bs = self.block_size
        for g, w in self._windows:  # the next position (num_tokens) attends p - window < j
            if s.tables[g].start > max(0, num_tokens - w + 1) // bs:
                raise SlidingWindowError(
                    f"cannot truncate {seq_id!r} to {num_tokens}: its window of {w} tokens "
                    f"reaches back before position {self.seq_pos_min(seq_id)}, given back")
        for table, r in zip(self.tables, s.tables, strict=True):
            table.cut(r, _cdiv(num_tokens, bs))
        if s.chain is not None:
            s.chain.delete(num_tokens, s.num_tokens)
        s.num_tokens = num_tokens
        s.num_written = min(s.num_written, num_tokens)
        s.num_hashed = min(s.num_hashed, num_tokens // bs)
        if num_tokens % bs:
            for table, r in zip(self.tables, s.tables, strict=True):
                if r.blocks[-1].ref_cnt == 1:
                    table.forget_hash(r.blocks[-1])  # partial again: it will be overwritten

    def reset_prefix_cache(self) -> None:
        """Empty the prefix index; blocks in use keep serving their sequences."""
        self._pool.reset_hashes()

    def evict(self, n: int | None = None) -> int:
        """Evict up to n cached free blocks (all if None), least recently freed first."""
        return self._pool.evict(n)

    # --- sequence range operations (seq_ops.py) -----------------------------------------------

    def register_rotation(self, fn: seq_ops.RotateK | None) -> None:
        """Set the model's K re-rotation (RoPE by an angle difference); None removes it."""
        if fn is not None and not callable(fn):
            raise InvalidArgumentError(f"a callable expected, got {fn!r:.80}")
        self.rotate_k = fn

    def remove(self, seq_id: SeqId, start: int, end: int) -> None:
        """Drop positions [start, end); later positions move down (see `seq_ops.remove`).
        With groups, only a removal of the tail (a truncate) is possible."""
        s = self.seq(seq_id)
        if not self._plain and not (isinstance(end, int) and end == s.num_tokens):
            self._refuse_range_op("remove", seq_id)
        seq_ops.remove(self, seq_id, start, end)

    def copy(self, src: SeqId, dst: SeqId, start: int, end: int) -> None:
        """Append src's positions [start, end) to `dst` (see `seq_ops.copy`)."""
        if not self._plain:
            self._refuse_range_op("copy", src)
        seq_ops.copy(self, src, dst, start, end)

    def shift(self, seq_id: SeqId, start: int, end: int, delta: int) -> None:
        """Re-rotate K of positions [start, end) by `delta` (see `seq_ops.shift`)."""
        if not self._plain:
            self._refuse_range_op("shift", seq_id)
        seq_ops.shift(self, seq_id, start, end, delta)

    def _refuse_range_op(self, op: str, seq_id: SeqId) -> None:
        """Range operations rewrite positions in place; a window group has given blocks back
        (or will), and the storage layers of a block belong to a different layer per group, so
        with groups they are refused, before anything changes (llama.cpp refuses seq_rm in
        an SWA cache below seq_pos_min the same way)."""
        self.seq(seq_id)
        raise SlidingWindowError(
            f"{op} on {seq_id!r}: range operations need one full-attention KV group; this cache "
            f"has {self.groups.describe()} (--disable-hybrid-kv-cache-manager keeps every layer "
            f"whole)")

    # --- prefix lookup, cached blocks, tiers --------------------------------------------------

    def lookup(self, token_ids: Sequence[int], extra_key: object = None) -> int:
        """Tokens of `token_ids` a new sequence would get from the cache (no state change)."""
        ids = _check_ids(_as_list(token_ids))
        if not self.enable_prefix_caching or len(ids) < 2:
            return 0
        chain = HashChain(self.block_size, ids, extra_key)
        m = self.cached_prefix_len(chain.hashes, (len(ids) - 1) // self.block_size)
        return m * self.block_size + self._partial(chain, len(ids), m)[1]

    def cached_prefix_len(self, hashes: Sequence[bytes], limit: int | None = None) -> int:
        """How many leading blocks of a chain (at most `limit`) a new sequence would get from
        the device (in use or cached free); no state change. With groups: the longest prefix
        every full group holds whole and every window group holds the window of."""
        n = len(hashes) if limit is None else min(limit, len(hashes))
        if not self._plain:
            return self._prefix_len(hashes, n)
        lookup = self._pool.hash_to_block.get
        i = 0
        while i < n and lookup(hashes[i]) is not None:
            i += 1
        return i

    def _prefix_len(self, hashes: Sequence[bytes], limit: int) -> int:
        """The hit in blocks over groups: full groups left to right (each must hold every
        block), then window groups right to left (vLLM's rule): a candidate m needs, in each
        window group, the blocks from the window's first one, max(0, m*bs - w + 1) // bs, to
        m - 1; a miss at block i moves the candidate down to i."""
        lookup, key, bs = self._pool.hash_to_block.get, self.group_key, self.block_size
        m = limit
        for g in self._full:
            i = 0
            while i < m and lookup(key(hashes[i], g)) is not None:
                i += 1
            m = i
        while m > 0:
            miss = None
            for g, w in self._windows:
                for i in range(m - 1, max(0, m * bs - w + 1) // bs - 1, -1):
                    if lookup(key(hashes[i], g)) is None:
                        miss = i
                        break
                if miss is not None:
                    break
            if miss is None:
                return m
            m = miss
        return 0

    def _hits(self, hashes: Sequence[bytes], m: int) -> list[list[Block]]:
        """Per group, the table entries of an m-block hit (`_prefix_len` found them all)."""
        lookup, key, bs = self._pool.hash_to_block.__getitem__, self.group_key, self.block_size
        out = []
        for g, w in enumerate(self.groups.windows):
            lo = 0 if w is None else max(0, m * bs - w + 1) // bs
            out.append([NULL_BLOCK] * lo + [lookup(key(hashes[i], g)) for i in range(lo, m)])
        return out

    def _tier_ask(self, hashes: Sequence[bytes], first: int, limit: int) -> list[bytes]:
        """Tier keys of blocks [first, limit): block-major over the groups (a plain cache:
        the chain hashes themselves), so a run of k arrived parts is k // groups whole blocks."""
        if self._plain:
            return list(hashes[first:limit])
        key, ng = self.group_key, self.num_groups
        return [key(h, g) for h in hashes[first:limit] for g in range(ng)]

    def _find_cached(self, chain: HashChain | None, n: int) -> tuple[list[Block], int]:
        """(the blocks of the longest cached prefix of chain's first n ids, capped at n - 1
        tokens; that cap in blocks)."""
        if chain is None or not self.enable_prefix_caching or n < 2:
            return [], 0
        limit = min((n - 1) // self.block_size, len(chain.hashes))
        hits = []
        lookup = self._pool.hash_to_block.get
        for h in chain.hashes[:limit]:
            b = lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits, limit

    def cached_blocks(self) -> list[tuple[bytes, int]]:
        """(hash, block id) of every block under a prefix hash, in use or cached free (not
        the partial blocks kept for partial hits)."""
        return [(h, b.block_id) for h, b in self._pool.hash_to_block.items() if not b.partial]

    def import_cached(self, hashes: Sequence[bytes], parts: Sequence[dict[str, torch.Tensor]]) -> int:
        """Load blocks' contents (`KVStorage.block_layout` parts, one dict per block) into free
        device blocks as cached, evictable prefix blocks under `hashes` (warm restart).

        Hashes already cached (or repeated) are skipped; evicted first among them: the last.
        All-or-nothing: a part that does not fit the storage's layout (StorageMismatchError) or
        too few free blocks (OutOfBlocksError) changes nothing. Returns the blocks imported.
        """
        if self.storage is None or not self.enable_prefix_caching:
            raise CacheConfigError("import_cached needs storage and prefix caching")
        if len(hashes) != len(parts):
            raise InvalidArgumentError(f"{len(hashes)} hashes for {len(parts)} blocks")
        todo: dict[bytes, dict[str, torch.Tensor]] = {}
        for h, p in zip(hashes, parts, strict=True):
            if not isinstance(h, bytes):
                raise InvalidArgumentError(f"a block hash is bytes, got {h!r:.80}")
            self._check_parts(p)
            if h not in self._pool.hash_to_block:
                todo.setdefault(h, p)
        if len(todo) > self._pool.num_free:
            raise OutOfBlocksError(len(todo), self._pool.num_free, "import_cached")
        blocks = self._pool.allocate(len(todo))
        self._load(blocks, list(todo), list(todo.values()))
        self._pool.free(reversed(blocks))
        return len(blocks)

    def _check_parts(self, p: dict[str, torch.Tensor]) -> None:
        assert self.storage is not None
        layout = self.storage.block_layout()
        if not isinstance(p, dict) or set(p) != set(layout):
            raise StorageMismatchError(f"block parts {sorted(p) if isinstance(p, dict) else p!r:.80}"
                                       f" != {sorted(layout)}")
        for name, (dt, shape) in layout.items():
            t = p[name]
            if not isinstance(t, torch.Tensor) or t.dtype != dt or tuple(t.shape) != shape:
                raise StorageMismatchError(f"part {name!r}: {getattr(t, 'dtype', t)!r:.40} "
                                           f"{tuple(getattr(t, 'shape', ()))}, want {dt} {shape}")

    def read_ahead(self, chain: HashChain, timeout: float) -> object | None:
        """Start fetching, off this thread, the tier blocks that would follow chain's device
        hits (a TierRead to pass to `try_create`); None without a read-ahead tier or when
        there is nothing to ask. No state change here."""
        if self.tier is None or not self.enable_prefix_caching:
            return None
        limit = min((len(chain) - 1) // self.block_size, len(chain.hashes))
        i = self.cached_prefix_len(chain.hashes, limit)
        if i >= limit:
            return None
        return self.tier.read_ahead(self._tier_ask(chain.hashes, i, limit), chain.extra_key, timeout)

    def wait_reads(self, reads: Sequence[object], timeout: float) -> None:
        """Block until one of the read-aheads is done or `timeout` passes."""
        if self.tier is not None:
            self.tier.wait(reads, timeout)

    def attach_tier(self, connector: object | None) -> None:
        """The KV tier under the pool (a TierConnector), or None to detach it. With groups,
        each token block is one record per group (keyed by `group_key`)."""
        self.tier = connector
        if connector is not None and hasattr(connector, "parts_per_block"):
            connector.parts_per_block = self.num_groups

    # --- batched tensors for a step -----------------------------------------------------------

    def slot_mapping(
        self, seq_ids: Sequence[SeqId], num_new: Sequence[int] | int = 1, group: int = 0
    ) -> torch.Tensor:
        """int64 [sum(num_new)]: group `group`'s slots of each sequence's last num_new tokens."""
        seqs = self._seqs_of(seq_ids)
        table = self._table_of(group)
        if isinstance(num_new, int) and not isinstance(num_new, bool):
            num_new = [num_new] * len(seqs)
        num_new = _check_ids(_as_list(num_new))
        if len(num_new) != len(seqs):
            raise InvalidArgumentError(f"{len(num_new)} counts for {len(seqs)} sequences")
        for s, k in zip(seqs, num_new, strict=True):
            if not 0 <= k <= s.num_tokens:
                raise PositionError(f"{k} new tokens outside sequence {s.seq_id!r} of {s.num_tokens}")
        for s, k in zip(seqs, num_new, strict=True):
            if k and s.num_tokens - k < self._first_held(s, group):
                raise SlidingWindowError(f"{s.seq_id!r}: group {group} gave those blocks back")
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        ends = np.fromiter((s.num_tokens for s in seqs), np.int64, len(seqs))
        return torch.from_numpy(self._slots(rows, ends, np.asarray(num_new, dtype=np.int64), table))

    def slots(self, seq_id: SeqId, start: int, end: int, group: int = 0) -> torch.Tensor:
        """int64 [end - start]: group `group`'s slots of positions start..end-1 of one sequence
        (prefill chunks)."""
        s = self.seq(seq_id)
        table = self._table_of(group)
        start, end = _as_int(start), _as_int(end)
        if not 0 <= start <= end <= s.num_tokens:
            raise PositionError(f"range {start}..{end} outside sequence {seq_id!r} of {s.num_tokens}")
        if start < end and start < self._first_held(s, group):
            raise SlidingWindowError(f"{seq_id!r}: group {group} gave position {start}'s block back")
        pos = np.arange(start, end, dtype=np.int64)
        return torch.from_numpy(table.slots(s.row, pos))

    def _table_of(self, group: int) -> BlockTable:
        if isinstance(group, bool) or not isinstance(group, int) or not 0 <= group < self.num_groups:
            raise InvalidArgumentError(f"group must be an int in [0, {self.num_groups}), got "
                                       f"{group!r:.40}")
        return self.tables[group]

    def _first_held(self, s: SeqState, group: int) -> int:
        return s.tables[group].start * self.block_size

    def _slots(self, rows: np.ndarray, ends: np.ndarray, counts: np.ndarray,
               table: BlockTable | None = None) -> np.ndarray:
        if counts.size and (counts == 1).all():  # decode: one token each
            pos = ends - 1
        else:
            seq_idx = np.repeat(np.arange(len(counts)), counts)
            starts = np.cumsum(counts) - counts
            pos = (ends - counts)[seq_idx] + np.arange(len(seq_idx)) - starts[seq_idx]
            rows = rows[seq_idx]
        return (table or self.table).slots(rows, pos)

    def block_tables(self, seq_ids: Sequence[SeqId], group: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 [B, max_blocks] group `group`'s block tables padded with 0 (a window group's
        given-back entries are 0 too, never read), int32 [B] context lengths)."""
        seqs = self._seqs_of(seq_ids)
        table = self._table_of(group)
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        lens = np.fromiter((s.num_tokens for s in seqs), np.int32, len(seqs))
        return self._tables_of(rows, lens, table), torch.from_numpy(lens)

    def _tables_of(self, rows: np.ndarray, lens: np.ndarray,
                   table: BlockTable | None = None) -> torch.Tensor:
        width = max(1, -(-int(lens.max()) // self.block_size)) if lens.size else 1
        return (table or self.table).tables(rows, width)

    def decode_tensors(
        self, seq_ids: Sequence[SeqId], group: int = 0, drafts: Sequence[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step's (slot_mapping int64 [B], block_tables int32 [B, W], seq_lens int32 [B])
        in group `group`, for sequences whose newest token is the one being computed; built in
        one pass. `drafts` (speculative decoding): sequence i also verifies drafts[i] tokens in
        its lookahead slots, as drafts[i] more rows (its table repeated, one more token each),
        so the rows are sum(1 + drafts[i])."""
        table = self._table_of(group)
        rows, lens = self._decode_rows(seq_ids, drafts)
        return self._decode_group(rows, lens, torch.from_numpy(lens.astype(np.int32)), table)

    def decode_tensors_groups(self, seq_ids: Sequence[SeqId], drafts: Sequence[int] | None = None
                              ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """decode_tensors for every group, in group order: the sequences' rows and lengths built
        once for all of them (a hybrid model's groups share them; the lengths tensor is shared
        too), each group's slots and tables from its own block table."""
        rows, lens = self._decode_rows(seq_ids, drafts)
        lens32 = torch.from_numpy(lens.astype(np.int32))
        return [self._decode_group(rows, lens, lens32, t) for t in self.tables]

    def _decode_rows(self, seq_ids: Sequence[SeqId], drafts: Sequence[int] | None
                     ) -> tuple[np.ndarray, np.ndarray]:
        """(table rows, lengths) of a decode step's rows (decode_tensors)."""
        seqs = self._seqs_of(seq_ids)
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        lens = np.fromiter((s.num_tokens for s in seqs), np.int64, len(seqs))
        if lens.size and lens.min() < 1:
            raise PositionError("decode_tensors needs sequences holding at least one token")
        if drafts is not None:
            ks = np.asarray(drafts, dtype=np.int64)
            if ks.shape != lens.shape or (ks < 0).any() or any(
                    k > s.lookahead for k, s in zip(drafts, seqs, strict=True)):
                raise PositionError("drafts need as many lookahead slots reserved")
            n = ks + 1
            starts = np.cumsum(n) - n
            rows = np.repeat(rows, n)
            lens = np.repeat(lens, n) + np.arange(int(n.sum())) - np.repeat(starts, n)
        return rows, lens

    def _decode_group(self, rows: np.ndarray, lens: np.ndarray, lens32: torch.Tensor, table: BlockTable
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One group's (slots, tables, lens32): lens32 is returned as given (shared by the groups)."""
        slots = table.slots(rows, lens - 1)
        return torch.from_numpy(slots), self._tables_of(rows, lens32.numpy(), table), lens32

    def check_new_id(self, seq_id: SeqId) -> None:
        try:
            hash(seq_id)
        except TypeError:
            raise InvalidArgumentError(f"sequence id {seq_id!r:.80} is not hashable") from None
        if seq_id in self.seqs:
            raise DuplicateSequenceError(f"sequence {seq_id!r} already exists")

    @staticmethod
    def _as_ids(token_ids: Sequence[int] | int) -> list[int] | None:
        """Token ids as a list of int64 values, or None for a bare count; validates only."""
        if isinstance(token_ids, int) and not isinstance(token_ids, bool):
            if token_ids < 0:
                raise PositionError(f"negative token count {token_ids}")
            return None
        return _check_ids(_as_list(token_ids))

    # --- statistics ---------------------------------------------------------------------------

    def stats(self) -> CacheStats:
        bs = self.block_size
        fill: dict[int, int] = {}
        for s in self.seqs.values():
            for r in s.tables:
                for i in range(r.start, len(r.blocks)):
                    b, n = r.blocks[i], min(bs, s.num_tokens - i * bs)
                    if n > fill.get(b.block_id, 0):
                        fill[b.block_id] = n
        used = self.num_blocks - self._pool.num_free
        live = sum(fill.values())
        free_flags = [b.ref_cnt == 0 for b in self._pool.blocks]
        top = max((i for i, f in enumerate(free_flags) if not f), default=-1)
        holes = sum(free_flags[: top + 1])
        run = best = 0
        for f in free_flags:
            run = run + 1 if f else 0
            best = max(best, run)
        free = self._pool.num_free
        return CacheStats(
            num_blocks=self.num_blocks,
            block_size=bs,
            used_blocks=used,
            free_blocks=free,
            cached_blocks=self._pool.num_cached_free,
            active_sequences=len(self.seqs),
            live_tokens=live,
            utilization=live / (used * bs) if used else 1.0,
            usage=used / self.num_blocks,
            internal_waste=used * bs - live,
            holes=holes,
            largest_free_run=best,
            external_fragmentation=1.0 - best / free if free else 0.0,
            allocations=self._pool.allocations,
            frees=self._pool.frees,
            cow_copies=self.cow_copies,
            evictions=self._pool.evictions,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            prefix_hit_rate=self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
            partial_hits=self.partial_hits,
            memory_used_bytes=used * self.bytes_per_block,
            memory_total_bytes=self.num_blocks * self.bytes_per_block,
        )

    # --- defragmentation ----------------------------------------------------------------------

    def should_defragment(self, min_holes_fraction: float = 0.25) -> bool:
        """Worth compacting when free holes make up a large part of the used id range.

        With paged attention any free block is usable, so this never gains capacity: it gains
        locality (block tables read nearby memory) and lets a budget-resized pool shrink.
        """
        st = self.stats()
        span = st.used_blocks + st.holes
        return st.holes > 0 and span > 0 and st.holes / span >= min_holes_fraction

    def defragment(self) -> int:
        """Move used blocks to the lowest ids (cached free blocks right after), keeping data.

        Updates the storage, every block table and the hash index (which maps to Block objects,
        so it follows them). Returns the number of blocks whose data moved.
        """
        moves = self._pool.compact()
        if self.storage is not None and moves:
            src, dst = zip(*moves, strict=True)
            self.storage.copy_blocks(list(src), list(dst))
        for s in self.seqs.values():
            for table, r in zip(self.tables, s.tables, strict=True):
                table.refresh(r)
        return len(moves)

    # --- invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the whole state is consistent (tests call this after every operation)."""
        pool = self._pool
        pool.check_invariants()
        refs = [0] * self.num_blocks
        for g, table in enumerate(self.tables):
            table.check([s.tables[g] for s in self.seqs.values()], refs)
        pool.check_refs(refs)
        owner: dict[int, int] = {}  # a block serves one group (its layers' K/V), never two
        for s in self.seqs.values():
            for g, r in enumerate(s.tables):
                for b in r.blocks[r.start :]:
                    assert owner.setdefault(b.block_id, g) == g, f"block {b.block_id} in two groups"
        bs = self.block_size
        for s in self.seqs.values():
            assert len(s.tables) == self.num_groups and s.table is s.tables[0]
            assert len({r.index for r in s.tables}) == 1, f"{s.seq_id!r}: rows out of step"
            for g, r in enumerate(s.tables):
                assert len(r.blocks) == _cdiv(s.num_tokens + s.lookahead, bs), f"{s.seq_id!r}: block count"
                w = self.groups.windows[g]
                if w is None:
                    assert r.start == 0, f"{s.seq_id!r}: a full group gave a block back"
                else:  # never a block the next computed position still reads
                    assert r.start <= max(0, s.num_written - w + 1) // bs, f"{s.seq_id!r}: window"
            assert 0 <= s.num_written <= s.num_tokens
            assert 0 <= s.num_hashed <= s.num_written // bs
            if s.chain is None:
                assert s.num_hashed == 0
                continue
            c = s.chain
            assert len(c) >= s.num_tokens, f"{s.seq_id!r}: chain shorter than the sequence"
            assert len(c.hashes) == (len(c) // bs if c.hashed else 0), f"{s.seq_id!r}: chain"
            for g, r in enumerate(s.tables):
                for i, b in enumerate(r.blocks[: s.num_hashed]):
                    assert b.hash is None or b.hash == self.group_key(c.hashes[i], g), (
                        f"{s.seq_id!r}: group {g} block {i} hash")
        used = self.num_blocks - pool.num_free
        assert sum(1 for b in pool.blocks if b.ref_cnt) == used, "free + used != total"
