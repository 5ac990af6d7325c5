"""TierReader: KV tier reads on a daemon thread, so a slow store never stalls an engine step.

The scheduler asks for a waiting sequence's blocks ahead of its admission
(`PagedKVCache.read_ahead` -> `TierConnector.read_ahead` -> `submit`); the thread reads them in
pipelined batches, in order, stopping at the first miss or when it is cancelled, and appends
each block's parts to the `TierRead` as they arrive. The read's deadline is `timeout` seconds
after the last progress (the ask, then each batch that arrived): a store that keeps answering
is waited for (reading a block is far cheaper than computing it), one that stalls costs at most
`timeout`. Records are decoded
and verified here (`BlockTier.get_many`: a corrupt or forged entry is counted, dropped and read
as a miss), but nothing touches the device pool: the engine thread copies what has arrived into
fresh blocks at admission (`PagedKVCache.try_create`), so the pool stays single-threaded and
the cache's all-or-nothing contract holds. A read is one sequence's; reads run one after the
other (one store, one connection's worth of pipelining), in batches of 4 blocks, so progress
is seen every few MB. The thread keeps the normal CPU priority (unlike the writer): at nice
19 a busy machine starved it and every read ran into its deadline.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence

from pagedkv.cache.tiers.base import BlockTier, log
from pagedkv.cache.tiers.record import Layout, Parts

_STOP = object()


class TierRead:
    """One sequence's read-ahead. `parts` grows (reader thread only) with the parts of
    `hashes[0..k)`, in order; `done` once the thread has stopped reading it."""

    __slots__ = ("hashes", "tenant", "timeout", "deadline", "parts", "done", "cancelled")

    def __init__(self, hashes: Sequence[bytes], tenant: object, timeout: float) -> None:
        self.hashes = list(hashes)
        self.tenant = tenant
        self.timeout = timeout
        self.deadline = time.monotonic() + timeout  # moved on by each batch that arrives
        self.parts: list[Parts] = []
        self.done = False
        self.cancelled = False

    @property
    def waiting(self) -> bool:
        """Still worth waiting for: not done and before the deadline."""
        return not self.done and time.monotonic() < self.deadline

    def arrived(self) -> dict[bytes, Parts]:
        """hash -> parts of what has arrived so far (a consistent snapshot)."""
        got = list(self.parts)
        return dict(zip(self.hashes[: len(got)], got, strict=True))

    def cancel(self) -> None:
        """The sequence was admitted or left: stop reading, drop what arrived."""
        self.cancelled = True
        self.parts = []


class TierReader:
    """A daemon thread serving TierReads in submission order."""

    def __init__(self, tier: BlockTier, layout: Layout, *, batch: int = 4) -> None:
        self.tier = tier
        self.layout = layout
        self.batch = batch
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="pagedkv-tier-reader", daemon=True)
        self._thread.start()

    def submit(self, hashes: Sequence[bytes], tenant: object, timeout: float) -> TierRead:
        read = TierRead(hashes, tenant, timeout)
        self._q.put(read)
        return read

    def wait(self, reads: Sequence[TierRead], timeout: float) -> None:
        """Block until one of `reads` is done or `timeout` seconds pass."""
        end = time.monotonic() + max(timeout, 0.0)
        with self._cond:
            while not any(r.done for r in reads):
                left = end - time.monotonic()
                if left <= 0:
                    return
                self._cond.wait(left)

    def close(self, timeout: float = 5.0) -> None:
        if self._thread.is_alive():
            self._q.put(_STOP)
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            read = self._q.get()
            if read is _STOP:
                return
            try:
                self._read(read)
            except Exception:  # noqa: BLE001 - get_many already counts I/O errors
                log.exception("KV tier reader failed")
            finally:
                with self._cond:
                    read.done = True
                    self._cond.notify_all()

    def _read(self, read: TierRead) -> None:
        hashes, n = read.hashes, self.batch
        for i in range(0, len(hashes), n):
            if read.cancelled or time.monotonic() >= read.deadline:
                return  # admitted (or about to be) without the rest
            got = self.tier.get_many(hashes[i : i + n], self.layout, read.tenant)
            if got and got[0] is not None:
                read.deadline = time.monotonic() + read.timeout  # progress: worth waiting on
            for parts in got:
                if parts is None or read.cancelled:
                    return
                read.parts.append(parts)
