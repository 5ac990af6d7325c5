"""BackgroundWriter: hands blocks to a tier from a daemon thread, never blocking the caller.

`submit` enqueues without waiting; when the bounded queue is full the block is dropped and
counted (`write_drops`): the block stays computable, only the tier misses it. The thread takes
up to `batch` blocks at a time, so a Redis tier sends them in one pipeline.
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Sequence

from pagedkv.cache.tiers.base import BlockTier, background_priority, log
from pagedkv.cache.tiers.record import Parts

_STOP = object()


class BackgroundWriter:
    def __init__(self, tier: BlockTier, *, max_queue: int = 256, batch: int = 32) -> None:
        self.tier = tier
        self.batch = batch
        self._q: queue.Queue = queue.Queue(maxsize=max_queue)
        self._thread = threading.Thread(target=self._run, name="pagedkv-tier-writer", daemon=True)
        self._thread.start()
        ref = weakref.ref(self)  # at exit, queued blocks still reach the tier (bounded wait)
        atexit.register(lambda: (w := ref()) is not None and w.close(timeout=10))

    def submit(self, items: Sequence[tuple[bytes, Parts]]) -> int:
        """Queue blocks; returns how many were dropped because the queue was full."""
        dropped = 0
        for item in items:
            try:
                self._q.put_nowait(item)
            except queue.Full:
                dropped += 1
        if dropped:
            self.tier.count("write_drops", dropped)
        return dropped

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued block has been handed to the tier."""
        if timeout is None:
            self._q.join()
            return
        done = threading.Event()
        threading.Thread(target=lambda: (self._q.join(), done.set()), daemon=True).start()
        done.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Write what is queued (up to `timeout` seconds), then stop the thread."""
        if not self._thread.is_alive():
            return
        self._q.put(_STOP)
        self._thread.join(timeout)

    def _run(self) -> None:
        background_priority()
        while True:
            item = self._q.get()
            items = [item]
            while len(items) < self.batch:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            stop = any(i is _STOP for i in items)
            work = [i for i in items if i is not _STOP]
            try:
                self.tier.put_many(work)
            except Exception:  # noqa: BLE001 - put_many already counts I/O errors
                log.exception("KV tier writer failed")
            finally:
                for _ in items:
                    self._q.task_done()
            if stop:
                return
