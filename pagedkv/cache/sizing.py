"""Memory sizes as users write them: '2GiB', '512MB', '1e9' or an int, parsed to bytes.

The cache layer's own parser (the KV budget `kv_cache_memory`, a disk tier's `max_size`), so
nothing in the cache depends on the engine. How many blocks a budget holds is
`storage.num_blocks_for_budget` (it needs the block's byte size, hence the dtype). Imports
nothing heavy.
"""

from __future__ import annotations

import math
import re

from pagedkv.errors import CacheConfigError

_SIZE = re.compile(r"\s*([\d.eE+]+)\s*([KMGT]?)(i?)B?\s*")


def parse_size(size: str | int) -> int:
    """'2GiB', '512MB', '1e9' or an int -> bytes: KiB, MiB, GiB, TiB are powers of 1024; K(B),
    M(B), G(B), T(B) powers of 1000. Anything else (a non-finite size included) raises
    CacheConfigError; zero or a negative int is returned as is (the caller decides)."""
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    m = _SIZE.fullmatch(str(size))
    value = _bytes(m) if m else None
    if value is None:
        raise CacheConfigError(f"cannot parse memory size {size!r} (e.g. 2GiB, 512MB)")
    return value


def _bytes(m: re.Match[str]) -> int | None:
    base = 1024 if m.group(3) or not m.group(2) else 1000
    scale = {"": 1, "K": base, "M": base**2, "G": base**3, "T": base**4}[m.group(2)]
    try:
        v = float(m.group(1)) * scale
    except ValueError:
        return None
    return int(v) if math.isfinite(v) else None


__all__ = ["parse_size"]
