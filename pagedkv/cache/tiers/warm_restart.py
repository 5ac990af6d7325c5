"""Warm restart: every prefix-cached block of the device pool to a DiskTier, and back.

`save` writes the blocks the cache holds under a hash (in use or cached-free) that the snapshot
does not hold yet, synchronously (SIGTERM) or through a BackgroundWriter (periodic snapshots).
Each block is its own atomically renamed file, so a `kill -9` in the middle of a snapshot
leaves every earlier file whole: the previous snapshot stays usable, plus whatever of the new
one completed. `restore` loads the snapshot's most recently written blocks into free device
blocks as cached (evictable) prefix blocks through `PagedKVCache.import_cached` (the cache's one
path for K/V from outside the pool), never more than the pool has free.
"""

from __future__ import annotations

from pagedkv.cache.manager import PagedKVCache
from pagedkv.cache.tiers.disk import DiskTier
from pagedkv.cache.tiers.writer import BackgroundWriter

CHUNK = 64


def save(cache: PagedKVCache, tier: DiskTier, known: set[bytes],
         writer: BackgroundWriter | None = None) -> int:
    """Write the pool's hashed blocks not in `known` (updated); returns how many were queued."""
    todo = [(h, i) for h, i in cache.cached_blocks() if h not in known]
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


def restore(cache: PagedKVCache, tier: DiskTier) -> tuple[set[bytes], int]:
    """Load snapshot blocks into free device blocks as cached prefix blocks (the most recent
    evicted last); returns the keys the snapshot holds (valid ones) and the blocks loaded."""
    assert cache.storage is not None, "a snapshot needs the cache's storage"
    keys = tier.keys()[::-1]  # most recent first
    keys = keys[: cache.num_free_blocks]
    layout = cache.storage.block_layout()
    chunks = [keys[j : j + CHUNK] for j in range(0, len(keys), CHUNK)]
    loaded = 0
    for chunk in reversed(chunks):  # oldest first: import_cached frees them to be evicted first
        got = [(k, p) for k, p in zip(chunk, tier.get_many(chunk, layout), strict=True)
               if p is not None]
        if got:
            loaded += cache.import_cached([k for k, _ in got], [p for _, p in got])
    return set(tier.keys()), loaded
