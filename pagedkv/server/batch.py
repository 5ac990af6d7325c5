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

    @property
    def finished(self) -> bool:
        return all(u is not None and u.finished for u in self.latest)

    async def get(self) -> Update:
        """Waits for at least one part to move on; returns the merged state."""
        for i, part in enumerate(self.parts):
            if not part.finished and i not in self._pending.values():
                self._pending[asyncio.ensure_future(part.get())] = i
        try:
            done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            self.cancel()
            raise
        moved = []
        for task in done:
            i = self._pending.pop(task)
            try:
                self.latest[i] = task.result()
            except BaseException:
                self.cancel()
                raise
            moved.append(i)
        return self._merged(sorted(moved))

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
        )
