"""Full-state snapshots of a PagedKVCache, to assert that a failed operation changed nothing."""

from __future__ import annotations

import torch

from pagedkv.cache import PagedKVCache


def snapshot(cache: PagedKVCache) -> tuple:
    """Everything an operation could change: pool, free queue, hash index, tables, storage."""
    pool = cache._pool
    seqs = {
        sid: ([(r.index, r.start, [b.block_id for b in r.blocks]) for r in s.tables],
              s.token_ids, s.num_tokens,
              s.num_written, s.block_hashes, s.extra_key, s.hash_limit,
              None if s.chain is None else (list(s.chain.ids), list(s.chain.hashes)))
        for sid, s in cache.seqs.items()
    }
    return (
        [(b.block_id, b.ref_cnt, b.hash, b.in_free_queue) for b in pool.blocks],
        [b.block_id for b in pool.free_queue],
        {h: b.block_id for h, b in pool.hash_to_block.items()},
        {k: [b.block_id for b in kids] for k, kids in pool.children.items()},
        [b.link for b in pool.blocks],
        (pool.num_cached_free, pool.allocations, pool.frees, pool.evictions),
        seqs,
        [t.buf.tolist() for t in cache.tables],
        [list(t._free_rows) for t in cache.tables],
        (cache.cow_copies, cache.prefix_queries, cache.prefix_hits, cache.partial_hits),
        None if cache.storage is None else _storage_bytes(cache.storage),
    )


def _storage_bytes(storage) -> torch.Tensor:  # noqa: ANN001
    """K/V and scales (quantized storages) as one uint8 tensor (fp8 has no torch.equal)."""
    parts = [storage.kv.reshape(-1).view(torch.uint8)]
    if storage.scales is not None:
        parts.append(storage.scales.reshape(-1).view(torch.uint8))
    return torch.cat(parts)


def same_state(a: tuple, b: tuple) -> bool:
    return a[:-1] == b[:-1] and (a[-1] is None or torch.equal(a[-1], b[-1]))


def brute_partial(cache: PagedKVCache, prompt: list[int], extra: object, m: int) -> int:
    """The partial hit a prompt whose first m blocks are hits must get, by brute force over
    every indexed block's link: in each group, the longest leading run of block m's ids any
    block under that group's parent key holds; the hit is the shortest of those (at most
    len - 1 - m * bs tokens, and under a block)."""
    from array import array

    from pagedkv.cache.hashing import HashChain

    bs = cache.block_size
    most = min(bs - 1, len(prompt) - 1 - m * bs)
    if not cache.enable_prefix_caching or most < 1:
        return 0
    key = HashChain(bs, prompt, extra).parent_key(m)
    want = prompt[m * bs : m * bs + most]
    for g in range(cache.num_groups):
        gk = cache.group_key(key, g)
        runs = [0]
        for b in cache._pool.blocks:
            if b.hash is not None and b.link is not None and b.link[0] == gk:
                have = array("q", b.link[1]).tolist()
                run = 0
                while run < len(want) and run < len(have) and have[run] == want[run]:
                    run += 1
                runs.append(run)
        most = min(most, max(runs))
    return most
