"""Chained block hashes for automatic prefix caching.

A full block's hash covers its parent's hash, its token ids and an optional extra key, so equal
hashes mean equal whole prefixes. sha256 makes a collision (which would serve one prompt another
prompt's KV) practically impossible; the root seed is fixed so that processes agree.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = hashlib.sha256(b"pagedkv-root").digest()


def block_hash(parent: bytes, token_ids: Sequence[int], extra_key: object = None) -> bytes:
    """sha256(parent || int64 token ids || repr(extra_key)), 32 bytes."""
    h = hashlib.sha256(parent)
    h.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        h.update(b"\x00extra:" + repr(extra_key).encode())
    return h.digest()


def chain_hashes(
    token_ids: Sequence[int], block_size: int, extra_key: object = None, max_blocks: int | None = None
) -> list[bytes]:
    """Hashes of the full blocks of `token_ids` (at most `max_blocks`).

    The extra key (a tenant salt, a LoRA name) is folded into the first block only: every later
    hash chains from it, so the whole prefix is salted.
    """
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    out: list[bytes] = []
    parent = ROOT_HASH
    for i in range(n):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size],
                            extra_key if i == 0 else None)
        out.append(parent)
    return out


class HashChain:
    """A sequence's token ids and the chained hashes of their full blocks, grown as ids are
    appended (vLLM's `Request.block_hashes`): each block is hashed once, when it fills.

    Invariant: `hashes[i]` is `block_hash` of block i of `ids` chained from `hashes[i - 1]`
    (the extra key folded into block 0), for every full block: `len(hashes) == len(ids) //
    block_size`. Edits (`delete`) rehash from the first block they change. With `hashed=False`
    (prefix caching off) only the ids are kept and `hashes` stays empty.

    The engine's `Sequence` owns one over its context; a `PagedKVCache` sequence created from it
    reads it (lookups, and the hash each block gets once its K/V are written) and applies to it
    the edits it makes to the context (truncate, remove, copy), so the chain always holds the
    context the cache holds, plus any ids the owner appended ahead of the cache.
    """

    __slots__ = ("block_size", "extra_key", "hashed", "hashes", "ids")

    def __init__(self, block_size: int, ids: Sequence[int] = (), extra_key: object = None,
                 *, hashed: bool = True) -> None:
        self.block_size = block_size
        self.extra_key = extra_key
        self.hashed = hashed
        self.ids: list[int] = []
        self.hashes: list[bytes] = []
        self.extend(ids)

    def __len__(self) -> int:
        return len(self.ids)

    def append(self, token_id: int) -> None:
        ids = self.ids
        ids.append(token_id)
        if len(ids) % self.block_size == 0:
            self.rehash()

    def extend(self, token_ids: Sequence[int]) -> None:
        self.ids.extend(token_ids)
        self.rehash()

    def delete(self, start: int, end: int) -> None:
        """Drop ids [start, end); the hashes of the blocks from `start`'s on are recomputed."""
        del self.ids[start:end]
        del self.hashes[start // self.block_size :]
        self.rehash()

    def parent_key(self, i: int) -> bytes:
        """The key block i is indexed under for partial matches: block i - 1's hash, or for
        block 0 a hash of the root and the extra key (so a salt keeps tenants apart here too)."""
        return self.hashes[i - 1] if i else block_hash(ROOT_HASH, (), self.extra_key)

    def partial_key(self, i: int, w: int) -> bytes:
        """The pool key of block i's first w ids kept as a partial block (a freed sequence's
        last block): in its own domain, never equal to a chain hash."""
        bs = self.block_size
        h = hashlib.sha256(b"pagedkv-partial" + self.parent_key(i))
        h.update(array("q", self.ids[i * bs : i * bs + w]).tobytes())
        return h.digest()

    def link(self, i: int, w: int | None = None) -> tuple[bytes, bytes]:
        """(parent key, ids as int64 bytes) of block i (its first w ids; default: all): what
        the pool indexes it under for partial hits (bytes: ~160 bytes a block, not a tuple's
        ~630)."""
        bs = self.block_size
        return self.parent_key(i), array("q", self.ids[i * bs : i * bs + (bs if w is None else w)]).tobytes()

    def prefix(self, n: int) -> HashChain:
        """A new chain of the first `n` ids (their hashes copied, not recomputed)."""
        out = HashChain(self.block_size, (), self.extra_key, hashed=self.hashed)
        out.ids = self.ids[:n]
        out.hashes = self.hashes[: n // self.block_size] if self.hashed else []
        return out

    def rehash(self) -> None:
        """Hash every full block not hashed yet. The decode fast paths (`Sequence.append`,
        `PagedKVCache.append_one_each`) append to `ids` directly, saving a call per token, and
        call this when a block fills, so the invariant holds again before anything reads it."""
        if not self.hashed:
            return
        bs, ids, out = self.block_size, self.ids, self.hashes
        for i in range(len(out), len(ids) // bs):
            parent = out[-1] if out else ROOT_HASH
            out.append(block_hash(parent, ids[i * bs : (i + 1) * bs],
                                  self.extra_key if i == 0 else None))
