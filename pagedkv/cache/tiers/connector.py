"""TierConnector: the bridge between the device pool (KVStorage) and a BlockTier.

Reads: `fetch(hashes)` returns the parts of the longest run of consecutive hashes the tier
holds; `PagedKVCache.create` copies them into freshly allocated device blocks and registers
their hashes (the cache's one loading path, shared with `import_cached`). With
`read_ahead=True` (the engine's mode) the I/O happens off the engine thread: the scheduler
starts a waiting sequence's read with `read_ahead(hashes, tenant, timeout)` (reader.py), and
at admission `fetch(hashes, tenant, read)` only takes what has arrived, never waiting; without
a read it returns nothing. Without read-ahead (direct users, tests) `fetch` asks the tier on
the caller's thread, in pipelined batches, stopping at the first miss.

Writes (policy: a block is written once, when it becomes full and computed): the cache calls
`offer(hash, block_id)` when it registers a full block's hash; after the step's forward pass
(when the K/V are in storage) the engine calls `flush()`, which copies the offered blocks out of
the storage in one indexed gather and hands them to the background writer. Blocks loaded from
the tier are not offered again. Eviction writes nothing more: the block is already there.
Both directions carry the sequence's extra key (its cache salt: the tenant) so that, with a
tier key, each record is sealed for and opened by that tenant only.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedkv.cache.block_pool import Block
from pagedkv.cache.storage import KVStorage
from pagedkv.cache.tiers.base import BlockTier
from pagedkv.cache.tiers.reader import TierRead, TierReader
from pagedkv.cache.tiers.record import Parts
from pagedkv.cache.tiers.writer import BackgroundWriter


class TierConnector:
    def __init__(self, tier: BlockTier, storage: KVStorage, *, max_queue: int = 256,
                 read_batch: int = 16, write: bool = True, read_ahead: bool = False) -> None:
        self.tier = tier
        self.storage = storage
        self.layout = storage.block_layout()
        self.read_batch = read_batch
        self.writer = BackgroundWriter(tier, max_queue=max_queue) if write else None
        self.reader = TierReader(tier, self.layout) if read_ahead else None
        self._pending: list[tuple[bytes, Block, object]] = []
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.parts_per_block = 1  # records per token block: the cache's KV groups (attach_tier)

    # --- reads --------------------------------------------------------------------------------

    def read_ahead(self, hashes: Sequence[bytes], tenant: object,
                   timeout: float) -> TierRead | None:
        """Start reading `hashes` on the reader thread (None without read-ahead); its deadline
        is `timeout` seconds after the last progress."""
        return None if self.reader is None else self.reader.submit(hashes, tenant, timeout)

    def wait(self, reads: Sequence[TierRead], timeout: float) -> None:
        """Block until one of `reads` is done or `timeout` passes (nothing else to do)."""
        if self.reader is not None and reads:
            self.reader.wait(reads, timeout)

    def fetch(self, hashes: Sequence[bytes], tenant: object = None,
              read: TierRead | None = None) -> list[Parts]:
        """Parts of hashes[0..k) for the largest k the tier holds without a gap. With a
        read-ahead `read`: the largest k whose parts have arrived (no I/O, no wait)."""
        if read is not None:
            got = read.arrived()
            out = []
            for h in hashes:
                if h not in got:
                    break
                out.append(got[h])
            return self._count(out, len(hashes))
        if self.reader is not None:
            return []  # read-ahead mode: the caller's thread never waits on the tier
        out = []
        for i in range(0, len(hashes), self.read_batch):
            got = self.tier.get_many(hashes[i : i + self.read_batch], self.layout, tenant)
            for parts in got:
                if parts is None:
                    return self._count(out, len(hashes))
                out.append(parts)
        return self._count(out, len(hashes))

    def _count(self, out: list[Parts], asked: int) -> list[Parts]:
        bs, parts = self.storage.block_size, self.parts_per_block
        self.hit_tokens += len(out) // parts * bs
        self.miss_tokens += (asked // parts - len(out) // parts) * bs
        self.tier.count("hit_blocks", len(out))
        self.tier.count("miss_blocks", asked - len(out))
        return out

    # --- writes -------------------------------------------------------------------------------

    def offer(self, h: bytes, block: Block, tenant: object = None) -> None:
        """A block was just registered under hash `h` (its K/V written by the end of the step)."""
        if self.writer is not None:
            self._pending.append((h, block, tenant))

    def flush(self) -> None:
        """Copy the offered blocks out (one gather) and queue them; never waits on I/O.

        Only blocks that still hold their hash are copied: the pool drops a block's hash before
        its contents can change (eviction, truncation, an in-place write), so `hash == h` at
        this moment means the data read now is h's, whenever the cache registered it.
        """
        if not self._pending:
            return
        pending = [(h, b, t) for h, b, t in self._pending if b.hash == h]
        self._pending = []
        if not pending:
            return
        data = self.storage.export_blocks([b.block_id for _, b, _ in pending])
        self.writer.submit([(h, {n: x[i] for n, x in data.items()}, t)  # type: ignore[union-attr]
                            for i, (h, _, t) in enumerate(pending)])

    def drop_pending(self) -> None:
        self._pending.clear()

    def close(self, timeout: float = 30.0) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.writer is not None:
            self.writer.close(timeout)
        self.tier.close()
