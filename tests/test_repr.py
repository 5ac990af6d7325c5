"""Cache and storage objects print what a user wants to see first."""

from __future__ import annotations

from pagedkv import KVStorage, PagedKVCache


def test_cache_and_storage_repr() -> None:
    storage = KVStorage(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    cache = PagedKVCache(8, 4, storage=storage)
    assert repr(storage) == ("KVStorage(2 layers, 8 blocks x 4 tokens, 2 KV heads x 8, float32, "
                             "cpu, 0.0 MiB)")
    assert repr(cache) == ("PagedKVCache(8 blocks x 4 tokens: 0 used, 0 cached, 8 free; "
                           "0 sequences; prefix caching on)")
    cache.create("a", list(range(10)))  # 3 blocks
    cache.fork("a", "b")  # shares them: still 3 used
    assert "3 used, 0 cached, 5 free; 2 sequences" in repr(cache)
    cache.free("a")
    cache.free("b")  # full blocks may keep their prefix hash: cached, still free
    st = cache.stats()
    assert f"0 used, {st.cached_blocks} cached, 8 free; 0 sequences" in repr(cache)


def test_block_size_zero_is_a_config_error_not_a_zero_division() -> None:
    import pytest

    from pagedkv.cache.storage import num_blocks_for_budget
    from pagedkv.errors import CacheConfigError

    with pytest.raises(CacheConfigError, match="block_size"):
        num_blocks_for_budget(2**30, 30, 0, 3, 64, "float32")
