"""pagedkv: a paged KV cache for LLM inference, and the small engine that puts it to work."""

from pagedkv.cache import KVStorage, PagedKVCache

__all__ = ["KVStorage", "PagedKVCache"]
__version__ = "0.1.0"
