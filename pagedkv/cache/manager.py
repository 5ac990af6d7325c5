"""PagedKVCache: per-sequence block tables over a shared BlockPool.

Ownership: a sequence owns one reference to each block in its table; a block shared by a fork or
a prefix hit has one reference per table that holds it. Only the last block of a table can be
partly filled, and only it is ever written by an append; if it is shared, the writer first gets
a private copy (copy-on-write), so no sequence ever sees another's later writes.

Hashes: a sequence's full block gets its chained hash once its K/V are computed (`computed=True`
on create/append, or `mark_computed` after the forward pass that wrote them): a block is never
findable by a prefix lookup before its K/V exist. A full block never changes again unless
`truncate` makes it a partial last block again: then, if no one else holds it, its hash is
dropped before it can be overwritten.

Token ids: by default the cache keeps its own copy of a sequence's ids (direct users). With
`share_ids=True` (the engine) it keeps a reference to the caller's list instead: the caller owns
it, only ever appends to it, and grows the cache by counts; the cache reads the first
`num_tokens` ids for hashing and never writes the list.

Block tables live in a persistent int32 buffer [rows, max_blocks] (one row per live sequence),
updated in place when a block is added, copied or moved; the batched tensors of a step are
built from it with a few vectorized ops.

Validation: every public method checks its arguments (sequence ids hashable, token ids ints
within int64, paired lists of equal length) before it changes anything, and reports bad input
as a PagedKVError (InvalidArgumentError, PositionError, UnknownSequenceError...).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from operator import index

import numpy as np
import torch

from pagedkv.cache.block_pool import Block, BlockPool
from pagedkv.cache.hashing import ROOT_HASH, block_hash, chain_hashes
from pagedkv.cache.seq_ops import SeqOpsMixin
from pagedkv.cache.storage import KVStorage
from pagedkv.errors import (
    CacheConfigError,
    DuplicateSequenceError,
    InvalidArgumentError,
    OutOfBlocksError,
    PositionError,
    StorageMismatchError,
    UnknownSequenceError,
)

SeqId = Hashable
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@dataclass(slots=True, eq=False)
class SeqState:
    seq_id: SeqId
    row: int  # row of this sequence in the block-table buffer
    blocks: list[Block] = field(default_factory=list)
    token_ids: list[int] | None = field(default_factory=list)  # None: ids unknown, no caching
    num_tokens: int = 0
    num_computed: int = 0  # tokens whose K/V are written; full blocks below are hashed
    block_hashes: list[bytes] = field(default_factory=list)  # chain of its full, computed blocks
    extra_key: object = None
    hash_limit: int | None = None  # blocks from here on were edited (seq_ops): never hashed
    tier_tokens: int = 0  # prompt tokens whose K/V were loaded from the KV tier at creation
    shared_ids: bool = False  # token_ids is the owner's list (read only here, may run ahead)


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
    memory_used_bytes: int
    memory_total_bytes: int


def _as_list(values: object) -> list:
    if isinstance(values, str | bytes | dict | set) or not hasattr(values, "__iter__"):
        raise InvalidArgumentError(f"a list of ints expected, got {values!r:.80}")
    return list(values)  # type: ignore[call-overload]


def _check_ids(ids: list) -> list[int]:
    """`ids` as plain ints, each within int64 (what the hashes and tensors store)."""
    if not all(type(t) is int for t in ids):
        ids = [_as_int(t) for t in ids]
    if ids and (min(ids) < INT64_MIN or max(ids) > INT64_MAX):
        raise InvalidArgumentError("token ids must fit in int64")
    return ids


def _as_int(value: object) -> int:
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise InvalidArgumentError(f"an int expected, got {value!r:.80}")
    return index(value)  # type: ignore[arg-type]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedKVCache(SeqOpsMixin):
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
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.storage = storage
        self.enable_prefix_caching = enable_prefix_caching
        self.bytes_per_block = bytes_per_block or (storage.bytes_per_block if storage else 0)
        self.pool = BlockPool(num_blocks)
        self.seqs: dict[SeqId, SeqState] = {}
        cols = _cdiv(max_seq_len, block_size) if max_seq_len else min(num_blocks, 64)
        self._tables = torch.zeros((16, max(1, cols)), dtype=torch.int32)  # [rows, max_blocks]
        self._np = self._tables.numpy()  # same memory: scalar writes without torch overhead
        self._free_rows = list(range(15, -1, -1))
        self.cow_copies = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.tier = None  # a TierConnector (pagedkv.cache.tiers): the second level under the pool

    # --- queries ------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

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
        free = self.pool.num_free
        return (f"PagedKVCache({self.num_blocks} blocks x {self.block_size} tokens: "
                f"{self.num_blocks - free} used, {self.pool.num_cached_free} cached, {free} free; "
                f"{len(self.seqs)} sequences; prefix caching "
                f"{'on' if self.enable_prefix_caching else 'off'})")

    def __contains__(self, seq_id: SeqId) -> bool:
        return seq_id in self.seqs

    def num_tokens(self, seq_id: SeqId) -> int:
        return self.seq(seq_id).num_tokens

    def block_ids(self, seq_id: SeqId) -> list[int]:
        return [b.block_id for b in self.seq(seq_id).blocks]

    def block_token_counts(self, seq_id: SeqId) -> list[int]:
        """Tokens this sequence holds in each of its blocks (all full but maybe the last)."""
        s = self.seq(seq_id)
        bs = self.block_size
        return [min(bs, s.num_tokens - i * bs) for i in range(len(s.blocks))]

    def slot(self, seq_id: SeqId, pos: int) -> int:
        """Cache slot of token `pos`: block_id * block_size + offset."""
        s = self.seq(seq_id)
        pos = _as_int(pos)
        if not 0 <= pos < s.num_tokens:
            raise PositionError(f"position {pos} outside sequence {seq_id!r} of {s.num_tokens}")
        b, o = divmod(pos, self.block_size)
        return s.blocks[b].block_id * self.block_size + o

    def blocks_needed(self, num_tokens: int, seq_id: SeqId | None = None) -> int:
        """New blocks to hold `num_tokens` more tokens (for `seq_id`, or a new sequence)."""
        num_tokens = _as_int(num_tokens)
        if seq_id is None:
            return _cdiv(num_tokens, self.block_size)
        s = self.seq(seq_id)
        grow = _cdiv(s.num_tokens + num_tokens, self.block_size) - len(s.blocks)
        return grow + int(num_tokens > 0 and self._needs_cow(s))

    def _needs_cow(self, s: SeqState) -> bool:
        return s.num_tokens % self.block_size != 0 and s.blocks[-1].ref_cnt > 1

    # --- lifecycle ----------------------------------------------------------------------------

    def create(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int] | int,
        *,
        extra_key: object = None,
        computed: bool = True,
        reserve: int = 0,
        share_ids: bool = False,
    ) -> int:
        """Add a sequence holding `token_ids` (or a count of unknown tokens).

        `reserve`: fail unless this many free blocks remain afterwards (a scheduler's headroom
        for the sequences already running). `share_ids`: keep a reference to `token_ids` (a
        list the caller owns) instead of a copy.

        Reuses cached blocks of the longest cached prefix (capped at len - 1 tokens, so the last
        token is always computed for its logits) and allocates the rest. With a KV tier
        attached, the blocks that follow the device hits are asked from the tier, in order, and
        every hit is loaded into the first freshly allocated blocks. Returns the number of
        tokens served from the prefix cache (device + tier; `seq(id).tier_tokens` says how many
        came from the tier). All-or-nothing: OutOfBlocksError changes nothing.
        """
        out = self.try_create(seq_id, token_ids, extra_key=extra_key, computed=computed,
                              reserve=reserve, share_ids=share_ids)
        if isinstance(out, OutOfBlocksError):
            raise out
        return out

    def try_create(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int] | int,
        *,
        extra_key: object = None,
        computed: bool = True,
        reserve: int = 0,
        share_ids: bool = False,
    ) -> int | OutOfBlocksError:
        """`create`, except that not fitting is an expected outcome: it returns the
        OutOfBlocksError (nothing changed) instead of raising it. Bad arguments still raise."""
        self._check_new(seq_id)
        if share_ids:
            if not isinstance(token_ids, list):
                raise CacheConfigError("share_ids needs the owner's list of token ids")
            _check_ids(token_ids)  # validates only: the owner's list is kept as it is
            ids: list[int] | None = token_ids
        else:
            ids = self._as_ids(token_ids)
        n = len(ids) if ids is not None else int(token_ids)  # type: ignore[arg-type]
        hits, hashes = self._find_cached(ids, n, extra_key)
        needed = _cdiv(n, self.block_size) - len(hits)
        revived = sum(1 for b in hits if b.ref_cnt == 0)  # touching them takes them off the queue
        available = self.pool.num_free - revived - reserve
        if needed > available:
            return OutOfBlocksError(needed, available, f"sequence {seq_id!r}")
        loaded = self.tier.fetch(hashes[len(hits):]) if self.tier and hashes[len(hits):] else []
        for b in hits:
            self.pool.touch(b)
        fresh = self.pool.allocate(needed)
        if loaded:
            self.tier.load([b.block_id for b in fresh[: len(loaded)]], loaded)
            for b, h in zip(fresh, hashes[len(hits) : len(hits) + len(loaded)], strict=False):
                self.pool.set_hash(b, h)
        s = SeqState(seq_id, self._take_row(), hits + fresh, ids, n)
        s.extra_key = extra_key
        s.shared_ids = share_ids
        s.block_hashes = hashes[: len(hits) + len(loaded)]
        s.num_computed = cached = (len(hits) + len(loaded)) * self.block_size
        s.tier_tokens = len(loaded) * self.block_size
        self.seqs[seq_id] = s
        self._write_row(s, 0)
        if ids is not None and self.enable_prefix_caching:
            self.prefix_queries += n
            self.prefix_hits += len(hits) * self.block_size
        if computed:
            self.mark_computed(seq_id, n)
        return cached

    def append(self, seq_id: SeqId, token_ids: Sequence[int] | int, *, computed: bool = True) -> None:
        """Append tokens, allocating blocks as needed; a shared last block is copied first.

        A sequence created with `share_ids` grows by a count: its owner appended the ids already.
        All-or-nothing: OutOfBlocksError changes nothing.
        """
        s = self.seq(seq_id)
        ids = self._as_ids(token_ids)
        k = len(ids) if ids is not None else int(token_ids)  # type: ignore[arg-type]
        if k == 0:
            return
        if s.shared_ids:
            if ids is not None:
                raise CacheConfigError("a sequence sharing its owner's ids grows by a count")
            if s.num_tokens + k > len(s.token_ids):  # type: ignore[arg-type]
                raise PositionError(f"{seq_id!r}: the owner holds only {len(s.token_ids)} ids")
        elif (ids is None) != (s.token_ids is None):
            raise CacheConfigError("mixing known token ids and bare counts in one sequence")
        grow = _cdiv(s.num_tokens + k, self.block_size) - len(s.blocks)
        cow = self._needs_cow(s)
        if grow + cow > self.pool.num_free:
            raise OutOfBlocksError(grow + cow, self.pool.num_free, f"append to {seq_id!r}")
        if cow:
            self._copy_on_write(s)
        else:
            self._drop_stale_tail_hash(s)
        if grow:
            first = len(s.blocks)
            s.blocks.extend(self.pool.allocate(grow))
            self._write_row(s, first)
        if ids is not None and not s.shared_ids:
            s.token_ids.extend(ids)  # type: ignore[union-attr]
        s.num_tokens += k
        if computed:
            self.mark_computed(seq_id, s.num_tokens)

    def append_one_each(
        self,
        seq_ids: Sequence[SeqId],
        token_ids: Sequence[int] | None = None,
        *,
        computed: bool = True,
    ) -> None:
        """Decode fast path: append one token to each sequence (all-or-nothing).

        `token_ids` None: every sequence shares its owner's ids, which already hold the token.
        `computed=False` (the engine): the new tokens' K/V are not written yet; the caller calls
        `mark_computed` after the forward pass, so no hash ever names unwritten K/V.
        Every argument is checked before anything changes: each id known and listed once, one
        token per sequence, and only sequences that track their token ids.
        """
        bs = self.block_size
        seqs = self._seqs_of(seq_ids)
        if len(set(seq_ids)) != len(seqs):
            raise CacheConfigError("a sequence is listed twice in one decode step")
        if token_ids is None:
            if not all(s.shared_ids and len(s.token_ids) > s.num_tokens for s in seqs):  # type: ignore[arg-type]
                raise CacheConfigError("append_one_each without ids needs owners one id ahead")
        else:
            token_ids = _check_ids(_as_list(token_ids))
            if len(token_ids) != len(seqs):
                raise CacheConfigError(f"{len(token_ids)} tokens for {len(seqs)} sequences")
            if any(s.token_ids is None or s.shared_ids for s in seqs):
                raise CacheConfigError("append_one_each needs sequences with known token ids")
        need = self._one_each_need(seqs)
        if need > self.pool.num_free:
            raise OutOfBlocksError(need, self.pool.num_free, "decode step")
        for i, s in enumerate(seqs):
            if s.num_tokens % bs == 0:
                s.blocks.append(self.pool.allocate(1)[0])
                self._write_row(s, len(s.blocks) - 1)
            elif s.blocks[-1].ref_cnt > 1:
                self._copy_on_write(s)
            elif s.blocks[-1].hash is not None:
                self.pool.drop_hash(s.blocks[-1])  # see _drop_stale_tail_hash
            if token_ids is not None:
                s.token_ids.append(token_ids[i])  # type: ignore[union-attr]
            s.num_tokens += 1
            if not computed:
                continue
            if s.num_tokens % bs == 0:
                self.mark_computed(s.seq_id, s.num_tokens)
            else:
                s.num_computed = s.num_tokens

    def blocks_needed_one_each(self, seq_ids: Sequence[SeqId]) -> int:
        """Free blocks `append_one_each(seq_ids)` takes: a new block for each sequence at a block
        boundary, and a copy for each writer of a shared partial block except the last holder
        (when every holder of the block is in the batch, the last writes it in place)."""
        return self._one_each_need(self._seqs_of(seq_ids))

    def _one_each_need(self, seqs: list[SeqState]) -> int:
        bs = self.block_size
        need = 0
        sharers: dict[int, int] = {}  # shared partial block id -> holders in this batch
        for s in seqs:
            if s.num_tokens % bs == 0:
                need += 1
            elif s.blocks[-1].ref_cnt > 1:
                bid = s.blocks[-1].block_id
                sharers[bid] = sharers.get(bid, 0) + 1
        for bid, k in sharers.items():
            need += k - (k == self.pool.blocks[bid].ref_cnt)
        return need

    def mark_computed(self, seq_id: SeqId, num_tokens: int) -> None:
        """Record that the first `num_tokens` tokens' K/V are written; hash the full blocks."""
        s = self.seq(seq_id)
        num_tokens = _as_int(num_tokens)
        if not 0 <= num_tokens <= s.num_tokens:
            raise PositionError(f"{num_tokens} computed tokens outside 0..{s.num_tokens}")
        s.num_computed = max(s.num_computed, num_tokens)
        if not self.enable_prefix_caching or s.token_ids is None:
            return
        bs = self.block_size
        stop = s.num_computed // bs if s.hash_limit is None else min(s.hash_limit, s.num_computed // bs)
        for i in range(len(s.block_hashes), stop):
            parent = s.block_hashes[-1] if s.block_hashes else ROOT_HASH
            h = block_hash(parent, s.token_ids[i * bs : (i + 1) * bs], s.extra_key if i == 0 else None)
            s.block_hashes.append(h)
            self.pool.set_hash(s.blocks[i], h)
            if self.tier is not None:
                self.tier.offer(h, s.blocks[i])

    def fork(self, src: SeqId, dst: SeqId, token_ids: list[int] | None = None) -> None:
        """`dst` shares every block of `src` (ref counts + 1); writes copy on demand.

        `token_ids`: the owner's list for `dst` (starting with src's tokens), referenced as with
        `share_ids`; otherwise dst gets a copy of src's ids.
        """
        s = self.seq(src)
        self._check_new(dst)
        if token_ids is not None and (not isinstance(token_ids, list)
                                      or len(token_ids) < s.num_tokens):
            raise CacheConfigError(f"fork {dst!r}: the owner's ids must hold src's tokens")
        for b in s.blocks:
            self.pool.touch(b)
        if token_ids is None:
            ids = None if s.token_ids is None else list(s.token_ids[: s.num_tokens])
        else:
            ids = token_ids
        t = SeqState(dst, self._take_row(), list(s.blocks), ids, s.num_tokens,
                     s.num_computed, list(s.block_hashes), s.extra_key, hash_limit=s.hash_limit,
                     shared_ids=token_ids is not None)
        self.seqs[dst] = t
        self._write_row(t, 0)

    def free(self, seq_id: SeqId) -> None:
        """Release a sequence: its blocks lose one reference, tail first (evicted first)."""
        s = self.seq(seq_id)
        self.pool.free(reversed(s.blocks))
        del self.seqs[seq_id]
        self._tables[s.row].zero_()
        self._free_rows.append(s.row)

    def truncate(self, seq_id: SeqId, num_tokens: int) -> None:
        """Keep only the first `num_tokens` tokens (context trimming); later blocks go back."""
        s = self.seq(seq_id)
        num_tokens = _as_int(num_tokens)
        if not 0 <= num_tokens <= s.num_tokens:
            raise PositionError(f"cannot truncate {seq_id!r} of {s.num_tokens} to {num_tokens}")
        keep = _cdiv(num_tokens, self.block_size)
        dropped = s.blocks[keep:]
        self.pool.free(reversed(dropped))
        del s.blocks[keep:]
        self._tables[s.row, keep:].zero_()
        if s.token_ids is not None and not s.shared_ids:
            del s.token_ids[num_tokens:]
        s.num_tokens = num_tokens
        s.num_computed = min(s.num_computed, num_tokens)
        del s.block_hashes[num_tokens // self.block_size :]
        if num_tokens % self.block_size and s.blocks[-1].ref_cnt == 1:
            self.pool.drop_hash(s.blocks[-1])  # partial again: it will be overwritten

    def reset_prefix_cache(self) -> None:
        """Empty the prefix index; blocks in use keep serving their sequences."""
        self.pool.reset_hashes()

    def evict(self, n: int | None = None) -> int:
        """Evict up to n cached free blocks (all if None), least recently freed first."""
        return self.pool.evict(n)

    # --- prefix lookup ------------------------------------------------------------------------

    def lookup(self, token_ids: Sequence[int], extra_key: object = None) -> int:
        """Tokens of `token_ids` a new sequence would get from the cache (no state change)."""
        ids = _check_ids(_as_list(token_ids))
        return len(self._find_cached(ids, len(ids), extra_key)[0]) * self.block_size

    def _find_cached(
        self, ids: list[int] | None, n: int, extra_key: object
    ) -> tuple[list[Block], list[bytes]]:
        if ids is None or not self.enable_prefix_caching or n < 2:
            return [], []
        hashes = chain_hashes(ids, self.block_size, extra_key, max_blocks=(n - 1) // self.block_size)
        hits: list[Block] = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits, hashes

    # --- batched tensors for a step -----------------------------------------------------------

    def slot_mapping(
        self, seq_ids: Sequence[SeqId], num_new: Sequence[int] | int = 1
    ) -> torch.Tensor:
        """int64 [sum(num_new)]: slots of each sequence's last num_new tokens, in order."""
        seqs = self._seqs_of(seq_ids)
        if isinstance(num_new, int) and not isinstance(num_new, bool):
            num_new = [num_new] * len(seqs)
        num_new = _check_ids(_as_list(num_new))
        if len(num_new) != len(seqs):
            raise InvalidArgumentError(f"{len(num_new)} counts for {len(seqs)} sequences")
        for s, k in zip(seqs, num_new, strict=True):
            if not 0 <= k <= s.num_tokens:
                raise PositionError(f"{k} new tokens outside sequence {s.seq_id!r} of {s.num_tokens}")
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        ends = np.fromiter((s.num_tokens for s in seqs), np.int64, len(seqs))
        return torch.from_numpy(self._slots(rows, ends, np.asarray(num_new, dtype=np.int64)))

    def slots(self, seq_id: SeqId, start: int, end: int) -> torch.Tensor:
        """int64 [end - start]: slots of positions start..end-1 of one sequence (prefill chunks)."""
        s = self.seq(seq_id)
        start, end = _as_int(start), _as_int(end)
        if not 0 <= start <= end <= s.num_tokens:
            raise PositionError(f"range {start}..{end} outside sequence {seq_id!r} of {s.num_tokens}")
        pos = np.arange(start, end, dtype=np.int64)
        bs = self.block_size
        return torch.from_numpy(self._np[s.row, pos // bs].astype(np.int64) * bs + pos % bs)

    def _slots(self, rows: np.ndarray, ends: np.ndarray, counts: np.ndarray) -> np.ndarray:
        bs = self.block_size
        if counts.size and (counts == 1).all():  # decode: one token each
            pos = ends - 1
        else:
            seq_idx = np.repeat(np.arange(len(counts)), counts)
            starts = np.cumsum(counts) - counts
            pos = (ends - counts)[seq_idx] + np.arange(len(seq_idx)) - starts[seq_idx]
            rows = rows[seq_idx]
        return self._np[rows, pos // bs].astype(np.int64) * bs + pos % bs

    def block_tables(self, seq_ids: Sequence[SeqId]) -> tuple[torch.Tensor, torch.Tensor]:
        """(int32 [B, max_blocks] block tables padded with 0, int32 [B] context lengths)."""
        seqs = self._seqs_of(seq_ids)
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        lens = np.fromiter((s.num_tokens for s in seqs), np.int32, len(seqs))
        return self._tables_of(rows, lens), torch.from_numpy(lens)

    def _tables_of(self, rows: np.ndarray, lens: np.ndarray) -> torch.Tensor:
        width = max(1, -(-int(lens.max()) // self.block_size)) if lens.size else 1
        return torch.from_numpy(self._np[rows, :width])

    def decode_tensors(
        self, seq_ids: Sequence[SeqId]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One decode step's (slot_mapping int64 [B], block_tables int32 [B, W], seq_lens int32 [B])
        for sequences whose newest token is the one being computed; built in one pass."""
        seqs = self._seqs_of(seq_ids)
        rows = np.fromiter((s.row for s in seqs), np.int64, len(seqs))
        lens = np.fromiter((s.num_tokens for s in seqs), np.int64, len(seqs))
        if lens.size and lens.min() < 1:
            raise PositionError("decode_tensors needs sequences holding at least one token")
        slots = self._slots(rows, lens, np.ones(len(seqs), np.int64))
        lens32 = lens.astype(np.int32)
        return torch.from_numpy(slots), self._tables_of(rows, lens32), torch.from_numpy(lens32)

    def _take_row(self) -> int:
        if not self._free_rows:
            old = self._tables.shape[0]
            grown = torch.zeros((2 * old, self._tables.shape[1]), dtype=torch.int32)
            grown[:old] = self._tables
            self._tables, self._np = grown, grown.numpy()
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def _write_row(self, s: SeqState, first: int) -> None:
        """Write s.blocks[first:] into its buffer row, growing the buffer's width if needed."""
        n = len(s.blocks)
        if n > self._tables.shape[1]:
            grown = torch.zeros((self._tables.shape[0], max(n, 2 * self._tables.shape[1])),
                                dtype=torch.int32)
            grown[:, : self._tables.shape[1]] = self._tables
            self._tables, self._np = grown, grown.numpy()
        row = self._np[s.row]
        for i in range(first, n):
            row[i] = s.blocks[i].block_id

    def _drop_stale_tail_hash(self, s: SeqState) -> None:
        """Before an in-place write into s's partial, unshared last block, forget its hash.

        Such a block can still hold a hash: it was full and shared when `truncate` cut into it,
        and the other holders have freed it since. Its hash names contents about to be
        overwritten, so it must not serve a prefix hit any more.
        """
        if s.num_tokens % self.block_size and s.blocks[-1].hash is not None:
            self.pool.drop_hash(s.blocks[-1])

    def _copy_on_write(self, s: SeqState) -> None:
        old = s.blocks[-1]
        new = self.pool.allocate(1)[0]
        if self.storage is not None:
            self.storage.copy_blocks([old.block_id], [new.block_id])
        self.pool.free([old])
        s.blocks[-1] = new
        self._np[s.row, len(s.blocks) - 1] = new.block_id
        self.cow_copies += 1

    def _check_new(self, seq_id: SeqId) -> None:
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
            for i, b in enumerate(s.blocks):
                n = min(bs, s.num_tokens - i * bs)
                if n > fill.get(b.block_id, 0):
                    fill[b.block_id] = n
        used = self.num_blocks - self.pool.num_free
        live = sum(fill.values())
        free_flags = [b.ref_cnt == 0 for b in self.pool.blocks]
        top = max((i for i, f in enumerate(free_flags) if not f), default=-1)
        holes = sum(free_flags[: top + 1])
        run = best = 0
        for f in free_flags:
            run = run + 1 if f else 0
            best = max(best, run)
        free = self.pool.num_free
        return CacheStats(
            num_blocks=self.num_blocks,
            block_size=bs,
            used_blocks=used,
            free_blocks=free,
            cached_blocks=self.pool.num_cached_free,
            active_sequences=len(self.seqs),
            live_tokens=live,
            utilization=live / (used * bs) if used else 1.0,
            usage=used / self.num_blocks,
            internal_waste=used * bs - live,
            holes=holes,
            largest_free_run=best,
            external_fragmentation=1.0 - best / free if free else 0.0,
            allocations=self.pool.allocations,
            frees=self.pool.frees,
            cow_copies=self.cow_copies,
            evictions=self.pool.evictions,
            prefix_queries=self.prefix_queries,
            prefix_hits=self.prefix_hits,
            prefix_hit_rate=self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0,
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
        pool = self.pool
        used = [b for b in pool.blocks if b.ref_cnt > 0]
        cached = [b for b in pool.free_queue if b.hash is not None]
        plain = [b for b in pool.blocks if b.ref_cnt == 0 and b.hash is None]
        order = used + cached + plain
        moves = [(b.block_id, new) for new, b in enumerate(order[: len(used) + len(cached)])
                 if b.block_id != new]
        if self.storage is not None and moves:
            src, dst = zip(*moves, strict=True)
            self.storage.copy_blocks(list(src), list(dst))
        for new, b in enumerate(order):
            b.block_id = new
        pool.blocks = order
        # free queue: plain blocks first in id order (fill low ids), cached ones keep LRU order
        for b in list(pool.free_queue):
            pool.free_queue.remove(b)
        for b in plain + cached:
            pool.free_queue.push_back(b)
        for s in self.seqs.values():
            self._write_row(s, 0)
        return len(moves)

    # --- invariants ---------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Assert the whole state is consistent (tests call this after every operation)."""
        pool = self.pool
        pool.check_invariants()
        bs = self.block_size
        refs = [0] * self.num_blocks
        rows = set()
        for s in self.seqs.values():
            assert s.row not in rows, f"row {s.row} shared"
            rows.add(s.row)
            assert len(s.blocks) == _cdiv(s.num_tokens, bs), f"{s.seq_id!r}: block count"
            if s.shared_ids:  # the owner may hold ids the cache has not grown to yet
                assert len(s.token_ids) >= s.num_tokens  # type: ignore[arg-type]
            else:
                assert s.token_ids is None or len(s.token_ids) == s.num_tokens
            assert 0 <= s.num_computed <= s.num_tokens
            assert len(s.block_hashes) <= s.num_tokens // bs
            row = self._tables[s.row, : len(s.blocks)].tolist()
            assert row == [b.block_id for b in s.blocks], f"{s.seq_id!r}: stale table row"
            for i, b in enumerate(s.blocks):
                assert pool.blocks[b.block_id] is b
                refs[b.block_id] += 1
                if i < len(s.block_hashes) and b.hash is not None:
                    assert b.hash == s.block_hashes[i], f"{s.seq_id!r}: block {i} hash mismatch"
        for b in pool.blocks:
            assert b.ref_cnt == refs[b.block_id], (
                f"block {b.block_id}: ref_cnt {b.ref_cnt} != {refs[b.block_id]} table references"
            )
        used = sum(1 for r in refs if r > 0)
        assert used + pool.num_free == self.num_blocks, "free + used != total"
