"""Warm restart: every prefix-cached block of the device pool to a DiskTier, and back.

`save` writes the blocks the pool holds under a hash (in use or cached-free) that the snapshot
does not hold yet, synchronously (SIGTERM) or through a BackgroundWriter (periodic snapshots).
Each block is its own atomically renamed file, so a `kill -9` in the middle of a snapshot
leaves every earlier file whole: the previous snapshot stays usable, plus whatever of the new
one completed. `restore` loads the snapshot's most recently written blocks into free device
blocks as cached (evictable) prefix blocks, never more than the pool has free.
"""

from __future__ import annotations

from pagedkv.cache.manager import PagedKVCache
from pagedkv.cache.tiers.disk import DiskTier
from pagedkv.cache.tiers.writer import BackgroundWriter

CHUNK = 64


def cached_blocks(cache: PagedKVCache) -> list[tuple[bytes, int]]:
    return [(h, b.block_id) for h, b in cache.pool.hash_to_block.items()]


def save(cache: PagedKVCache, tier: DiskTier, known: set[bytes],
         writer: BackgroundWriter | None = None) -> int:
    """Write the pool's hashed blocks not in `known` (updated); returns how many were queued."""
    todo = [(h, i) for h, i in cached_blocks(cache) if h not in known]
    storage = cache.storage
    assert storage is not None, "a snapshot needs the cache's storage"
    for j in range(0, len(todo), CHUNK):
        chunk = todo[j : j + CHUNK]
        data = storage.export_blocks([i for _, i in chunk])
        items = [(h, {n: t[k] for n, t in data.items()}) for k, (h, _) in enumerate(chunk)]
        if writer is None:
            tier.put_many(items)
        else:
            writer.submit(items)
        known.update(h for h, _ in chunk)
    return len(todo)


def restore(cache: PagedKVCache, tier: DiskTier) -> set[bytes]:
    """Load snapshot blocks into free device blocks as cached prefix blocks; returns the keys
    the snapshot holds (valid ones)."""
    storage = cache.storage
    assert storage is not None, "a snapshot needs the cache's storage"
    keys = tier.keys()[::-1]  # most recent first
    room = cache.pool.num_free
    loaded = []
    layout = storage.block_layout()
    for j in range(0, min(len(keys), room), CHUNK):
        chunk = keys[j : min(j + CHUNK, room)]
        got = [(k, p) for k, p in zip(chunk, tier.get_many(chunk, layout), strict=True)
               if p is not None and cache.pool.lookup(k) is None]
        if not got:
            continue
        blocks = cache.pool.allocate(len(got))
        storage.import_blocks([b.block_id for b in blocks],
                              {n: _stack([p[n] for _, p in got]) for n in layout})
        for b, (k, _) in zip(blocks, got, strict=True):
            cache.pool.set_hash(b, k)
        loaded += blocks
    cache.pool.free(loaded[::-1])
    return set(tier.keys())


def _stack(ts):  # noqa: ANN001, ANN202
    import torch

    return torch.stack(ts)
