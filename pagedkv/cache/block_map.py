"""A block map of the KV pool: one state per block, as numpy arrays, for pictures and dashboards.

`block_map(cache)` reads the pool's block states (`PagedKVCache.block_states`: reference
counts, hashes) and the per-sequence block tables once and returns a `BlockMap`: flat arrays indexed by block id, never one Python object per
block, so a 100k-block pool costs a few milliseconds and its JSON a few kilobytes (run-length).

States (the `State` codes, shared by the PNG renderer and the dashboard page):
- FREE: no reference, no prefix hash: reused first;
- CACHED: no reference, still holding a prefix hash (evictable, a prefix hit revives it);
- OWNED: held by exactly one sequence's block table (`owner` says which);
- SHARED: held by several tables (fork, prefix hit); `refs` is the count.

Invariant: the counts per state equal `cache.stats()` (free + cached = free_blocks, cached =
cached_blocks, owned + shared = used_blocks). The map carries no token ids and no text: only
states, reference counts, fill levels and the labels the caller gives the sequences.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np

from pagedkv.cache.manager import PagedKVCache


class State(IntEnum):
    FREE = 0
    CACHED = 1
    OWNED = 2
    SHARED = 3


STATE_NAMES = tuple(s.name.lower() for s in State)


@dataclass(slots=True)
class BlockMap:
    """The pool at one moment. Arrays have one entry per block id."""

    num_blocks: int
    block_size: int
    state: np.ndarray  # uint8 State codes
    refs: np.ndarray  # int32 reference counts (0 for free/cached)
    owner: np.ndarray  # int32 index into `owners` for OWNED blocks, -1 elsewhere
    fill: np.ndarray  # int16 live tokens in the block (max over its holders), 0 when free
    owners: list[Hashable]  # the labels of the sequences, in table order
    summary: dict[str, float | int]  # utilization, internal waste, hit rate, CoW copies...

    def counts(self) -> dict[str, int]:
        """Blocks per state name."""
        n = np.bincount(self.state, minlength=len(State))
        return {name: int(n[s]) for s, name in zip(State, STATE_NAMES, strict=True)}

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: the arrays run-length encoded as flat [value, run, value, run, ...]."""
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "state_names": list(STATE_NAMES),
            "counts": self.counts(),
            "summary": self.summary,
            "states": rle(self.state),
            "refs": rle(self.refs),
            "owner": rle(self.owner),
            "owners": [str(o) for o in self.owners],
        }


def rle(a: np.ndarray) -> list[int]:
    """Run-length encoding of a 1-D integer array as [value, run, value, run, ...]."""
    if a.size == 0:
        return []
    starts = np.flatnonzero(np.diff(a)) + 1
    starts = np.concatenate(([0], starts))
    runs = np.diff(np.concatenate((starts, [a.size])))
    return np.stack((a[starts].astype(np.int64), runs)).T.ravel().tolist()


def unrle(pairs: list[int]) -> np.ndarray:
    """Inverse of `rle`."""
    p = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
    return np.repeat(p[:, 0], p[:, 1])


def block_map(
    cache: PagedKVCache, label: Callable[[Hashable], Hashable] | None = None
) -> BlockMap:
    """Snapshot `cache`'s pool. `label(seq_id)` names each sequence in `owners` (default: its id).

    Reads the block states once and each sequence's block table; changes nothing.
    """
    n, bs = cache.num_blocks, cache.block_size
    refs, hashed = cache.block_states()
    state = np.full(n, State.FREE, np.uint8)
    state[(refs == 0) & hashed] = State.CACHED
    state[refs == 1] = State.OWNED
    state[refs > 1] = State.SHARED
    owner = np.full(n, -1, np.int32)
    fill = np.zeros(n, np.int16)
    owners: list[Hashable] = []
    for i, (sid, s) in enumerate(cache.seqs.items()):
        owners.append(sid if label is None else label(sid))
        for r in s.tables:  # every KV group's table (a window group's from its first held)
            ids = np.fromiter((b.block_id for b in r.blocks[r.start :]), np.int64,
                              len(r.blocks) - r.start)
            if ids.size == 0:
                continue
            tokens = np.full(ids.size, bs, np.int16)
            tokens[-1] = s.num_tokens - (len(r.blocks) - 1) * bs
            np.maximum.at(fill, ids, tokens)
            mine = ids[refs[ids] == 1]
            owner[mine] = i
    summary = _summary(cache, refs, fill)
    return BlockMap(n, bs, state, refs, owner, fill, owners, summary)


def _summary(cache: PagedKVCache, refs: np.ndarray, fill: np.ndarray) -> dict[str, float | int]:
    """The figures of `stats()` the pictures show, computed from the arrays (stats() walks
    every block in Python; this keeps a snapshot of a 100k-block pool cheap)."""
    bs = cache.block_size
    used_ids = np.flatnonzero(refs)
    used = int(used_ids.size)
    live = int(fill.sum(dtype=np.int64))
    top = int(used_ids[-1]) if used else -1
    queries, hits = cache.prefix_queries, cache.prefix_hits
    return {
        "utilization": live / (used * bs) if used else 1.0,
        "usage": used / cache.num_blocks,
        "internal_waste": used * bs - live,
        "live_tokens": live,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "cow_copies": cache.cow_copies,
        "evictions": cache.num_evictions,
        "holes": top + 1 - used,
        "active_sequences": len(cache.seqs),
    }
