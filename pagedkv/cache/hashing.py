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
