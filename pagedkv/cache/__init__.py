"""The paged KV cache: block pool, per-sequence tables, sharing, prefix caching, storage."""

from pagedkv.cache.block_pool import Block, BlockPool
from pagedkv.cache.manager import CacheStats, PagedKVCache
from pagedkv.cache.storage import KVStorage, bytes_per_block, num_blocks_for_budget

__all__ = [
    "Block",
    "BlockPool",
    "CacheStats",
    "KVStorage",
    "PagedKVCache",
    "bytes_per_block",
    "num_blocks_for_budget",
]
