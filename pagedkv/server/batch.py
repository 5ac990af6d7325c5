"""One /v1/completions request with several prompts: one engine request per prompt, read as
a single stream of updates.

Choice i of prompt p is reported as choice p * n + i (vLLM's numbering). A merged update is a
delta like each part's: the new choices of the prompts that moved on, with usage summed over
every prompt heard from so far, finished once every prompt is.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

from pagedkv.server.async_engine import RequestStream, Update


class MergedStream:
    """RequestStream's reading interface (`get`, `finished`) over several streams."""

    def __init__(self, request_id: str, parts: Sequence[RequestStream], n: int) -> None:
        self.request_id = request_id
        self.parts = list(parts)
        self.n = n
        self.latest: list[Update | None] = [None] * len(self.parts)
        self._pending: dict[asyncio.Task, int] = {}
        self._ready: list[int] = []  # parts whose newest delta is not yet returned

    @property
    def finished(self) -> bool:
        """Every part finished and every delta returned."""
        return not self._ready and all(u is not None and u.finished for u in self.latest)

    async def get(self) -> Update:
        """Waits for at least one part to move on; returns the merged delta.

        Cancellation (a disconnect, or a caller's timeout around this call) loses nothing: a
        part's delta already taken is kept for the next call, and the waits still pending are
        cancelled before they take anything (a part's get() takes its item only after its wait).
        """
        if not self._ready:
            for i, part in enumerate(self.parts):
                if not part.finished and i not in self._pending.values():
                    self._pending[asyncio.ensure_future(part.get())] = i
            try:
                await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
            finally:
                self._harvest()
        moved, self._ready = sorted(self._ready), []
        return self._merged(moved)

    def _harvest(self) -> None:
        """Take the finished waits' results; cancel the rest (they have taken nothing)."""
        error = None
        for task, i in list(self._pending.items()):
            if task.done() and not task.cancelled():
                if task.exception() is not None:
                    error = error or task.exception()
                else:
                    self.latest[i] = task.result()
                    self._ready.append(i)
            else:
                task.cancel()
        self._pending.clear()
        if error is not None:
            raise error

    def cancel(self) -> None:
        for task in self._pending:
            task.cancel()
        self._pending.clear()

    def _merged(self, moved: list[int]) -> Update:
        seen = [(p, u) for p, u in enumerate(self.latest) if u is not None]
        choices = tuple(dataclasses.replace(c, index=p * self.n + c.index)
                        for p in moved for c in self.latest[p].choices)  # type: ignore[union-attr]
        return Update(
            choices=choices,
            finished=self.finished,
            prompt_tokens=sum(u.prompt_tokens for _, u in seen),
            cached_tokens=sum(u.cached_tokens for _, u in seen),
            tier_cached_tokens=sum(u.tier_cached_tokens for _, u in seen),
            draft_tokens=sum(u.draft_tokens for _, u in seen),
            accepted_tokens=sum(u.accepted_tokens for _, u in seen),
        )
