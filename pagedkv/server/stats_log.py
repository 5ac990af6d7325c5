"""`pagedkv serve`'s periodic log line, as vLLM prints one: while the engine is busy, one line
per interval with the running/waiting requests, KV cache usage, the prefix cache hit rate and
the prompt/generation throughput over that interval. An idle server stays quiet.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

logger = logging.getLogger("pagedkv.server")


def configure_logging(level: str | int = "info") -> None:
    """Send pagedkv.server's records to stderr (uvicorn configures only its own loggers)."""
    if any(getattr(h, "_pagedkv", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(message)s",
                                           datefmt="%H:%M:%S"))
    handler._pagedkv = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    logger.propagate = False


class StatsLine:
    """Turns successive EngineStats into log lines (rates over the time between two)."""

    def __init__(self) -> None:
        self.last: Any = None
        self.last_t = 0.0

    def update(self, stats: Any, now: float) -> str | None:
        """The line for the interval ending now, or None when nothing happened in it."""
        last, dt = self.last, now - self.last_t
        self.last, self.last_t = stats, now
        if last is None or dt <= 0:
            return None
        prompt = stats.prompt_tokens_total - last.prompt_tokens_total
        gen = stats.generation_tokens_total - last.generation_tokens_total
        if not (stats.num_running or stats.num_waiting or prompt or gen):
            return None
        queries = stats.prefix_cache_queries - last.prefix_cache_queries
        hits = stats.prefix_cache_hits - last.prefix_cache_hits
        return (
            f"running: {stats.num_running} reqs, waiting: {stats.num_waiting} reqs, "
            f"KV cache usage: {stats.kv_usage:.1%}, "
            f"prefix cache hit rate: {hits / queries if queries else 0.0:.1%}, "
            f"prompt: {prompt / dt:.1f} tok/s, generation: {gen / dt:.1f} tok/s"
        )


async def log_stats(engine: Any, interval: float) -> None:
    """Runs until cancelled: every `interval` seconds, reads the engine's stats and logs a line
    when it was busy. `engine` is the server's AsyncEngine."""
    line = StatsLine()
    while True:
        try:
            stats = await engine.call(lambda e: e.stats())
        except Exception:  # engine stopped or stopping: nothing to report
            stats = None
        if stats is not None:
            text = line.update(stats, time.monotonic())
            if text:
                logger.info(text)
            await _recheck_threads(engine)
        await asyncio.sleep(interval)


async def _recheck_threads(engine: Any) -> None:
    """Other programs' CPU use since the last line (cpu_load.CoreWatch): log a change, and
    apply an automatic thread count on the engine thread, between two steps."""
    from pagedkv import cpu_load

    if cpu_load.WATCH is None:
        return
    msg, threads = cpu_load.WATCH.check()
    if msg:
        logger.warning(msg)
    if threads is not None:
        import torch

        try:
            await engine.call(lambda e: torch.set_num_threads(threads))
        except Exception:  # engine stopped or stopping
            pass
