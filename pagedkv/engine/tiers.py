"""EngineTiers: the engine's KV tier (`kv_tier=`) and warm-restart snapshots (`kv_snapshot=`).

Built once per engine: computes the model fingerprint, opens the tier (a tier that cannot be
used logs a warning and the engine serves without it), attaches a TierConnector to the cache
and, with a snapshot directory, reloads the previous snapshot into the device pool. After every
step (`after_step`) the blocks that became full during the step are handed to the tier's
background writer; with `snapshot_interval`, new cached blocks also go to the snapshot in the
background. `snapshot_now` writes synchronously (on SIGTERM, after the server drained).
With a TierKey (`key=`) the tier and the snapshot hold only records authenticated and encrypted
with it. The options come validated from EngineConfig (a tier or snapshot only with prefix caching on,
a positive interval only with a snapshot); nothing here checks them again.
"""

from __future__ import annotations

import logging
import time

from pagedkv.cache.manager import PagedKVCache
from pagedkv.cache.tiers import TierConnector, TierKey, model_fingerprint, open_tier
from pagedkv.cache.tiers import warm_restart as snap
from pagedkv.cache.tiers.disk import DiskTier
from pagedkv.cache.tiers.writer import BackgroundWriter
from pagedkv.errors import TierUnavailableError

log = logging.getLogger("pagedkv.tier")


class EngineTiers:
    def __init__(self, loaded: object, cache: PagedKVCache, *, kv_tier: str | None,
                 queue: int = 256, snapshot: str | None = None,
                 snapshot_interval: float | None = None, key: TierKey | None = None,
                 attention: str = "torch") -> None:
        self.cache = cache
        self.key = key
        self.connector: TierConnector | None = None
        self.snap: DiskTier | None = None
        self.snap_writer: BackgroundWriter | None = None
        self.snap_known: set[bytes] = set()
        self.interval = snapshot_interval
        self.restored = 0
        self._last_snap = time.monotonic()
        if not kv_tier and not snapshot:
            return
        storage = cache.storage
        assert storage is not None
        self.fp = model_fingerprint(loaded, storage.block_layout(), cache.block_size,
                                    str(storage.device), attention)
        if kv_tier:
            tier = open_tier(kv_tier, self.fp, key=key)
            if tier is not None:
                self.connector = TierConnector(tier, storage, max_queue=queue, read_ahead=True)
                cache.attach_tier(self.connector)
        if snapshot:
            self._open_snapshot(snapshot)

    def _open_snapshot(self, path: str) -> None:
        cap = 2 * self.cache.num_blocks * self.cache.storage.bytes_per_block  # type: ignore[union-attr]
        try:
            self.snap = DiskTier(path, self.fp, max_bytes=cap, key=self.key)
        except TierUnavailableError as exc:
            log.warning("%s; no KV snapshot will be written or restored", exc)
            return
        self.snap_known, self.restored = snap.restore(self.cache, self.snap)
        log.info("restored %d KV blocks from the snapshot in %s", self.restored, path)
        if self.interval:
            self.snap_writer = BackgroundWriter(self.snap)

    # --- per step -----------------------------------------------------------------------------

    def after_step(self) -> None:
        if self.connector is not None:
            self.connector.flush()
        if self.snap_writer is not None and time.monotonic() - self._last_snap >= self.interval:
            self._last_snap = time.monotonic()
            snap.save(self.cache, self.snap, self.snap_known, self.snap_writer)  # type: ignore[arg-type]

    # --- admin --------------------------------------------------------------------------------

    def stats(self) -> dict[str, float] | None:
        if self.connector is None:
            return None
        out = self.connector.tier.stats.as_dict()
        out["hit_tokens"] = self.connector.hit_tokens
        out["miss_tokens"] = self.connector.miss_tokens
        return out

    def clear(self) -> int:
        return self.connector.tier.clear() if self.connector is not None else 0

    def snapshot_now(self) -> int:
        if self.snap is None:
            return 0
        if self.snap_writer is not None:
            self.snap_writer.flush(timeout=60)
        return snap.save(self.cache, self.snap, self.snap_known)

    def close(self) -> None:
        if self.snap_writer is not None:
            self.snap_writer.close()
            self.snap_writer = None
        if self.connector is not None:
            self.connector.close()
            self.cache.attach_tier(None)
            self.connector = None
