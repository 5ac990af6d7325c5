"""The preprocessing thread's queue: clients (tenants) take turns.

Tokenizing and chat templates run on one thread (the tokenizer is not shared across threads
beyond the engine thread's decoding). With a single FIFO, one client's burst of large prompts
would queue every other client's request behind all of it; here a request waits at most for one
job of each other client with work queued (each job is bounded by the prompt caps). Used from
the event loop only (no locks): `run` queues a job and returns its result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import heapq
import itertools
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class FairQueue:
    """Fair queuing by rounds: a client's k-th queued job (counting from the round now running)
    runs in round k, and a round runs its jobs in arrival order. So each client's jobs run in its
    order, and a client with one job waits at most for one job of each client ahead of it,
    whatever their bursts. At most one job is on the executor at a time."""

    def __init__(self, executor: concurrent.futures.Executor) -> None:
        self._executor = executor
        self._heap: list[tuple[int, int, Callable[[], Any], asyncio.Future]] = []
        self._last: dict[Any, int] = {}  # key -> round of its latest queued job
        self._round = 0  # round of the job started last
        self._arrivals = itertools.count()
        self._busy = False

    def __len__(self) -> int:
        return len(self._heap)

    async def run(self, key: Any, fn: Callable[[], T]) -> T:
        """fn() on the executor in its turn. RuntimeError if the executor was shut down."""
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        rnd = max(self._round, self._last.get(key, -1) + 1)
        self._last[key] = rnd
        heapq.heappush(self._heap, (rnd, next(self._arrivals), fn, fut))
        self._pump()
        return await fut

    def _next(self) -> tuple[Callable[[], Any], asyncio.Future] | None:
        while self._heap:
            rnd, _, fn, fut = heapq.heappop(self._heap)
            self._round = rnd
            for k in [k for k, r in self._last.items() if r < rnd]:  # their rounds are past
                del self._last[k]
            if not fut.done():  # a client that left cancelled its future
                return fn, fut
        return None

    def _pump(self) -> None:
        if self._busy:
            return
        job = self._next()
        if job is None:
            return
        fn, fut = job
        try:
            done = asyncio.get_running_loop().run_in_executor(self._executor, fn)
        except RuntimeError as exc:  # shut down: this job fails, and the rest as they come
            fut.set_exception(exc)
            self._pump()
            return
        self._busy = True
        done.add_done_callback(lambda d: self._finished(d, fut))

    def _finished(self, done: asyncio.Future, fut: asyncio.Future) -> None:
        self._busy = False
        exc = None if done.cancelled() else done.exception()  # retrieved even if nobody waits
        if not fut.done():
            if done.cancelled():
                fut.cancel()
            elif exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(done.result())
        self._pump()
