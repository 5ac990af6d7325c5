"""FairQueue: each key's jobs in order, keys in turns (fair queuing by rounds), one job at a time."""

from __future__ import annotations

import asyncio
import concurrent.futures

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.server.prep_queue import FairQueue


def _order(keys: list[str]) -> list[tuple[str, int]]:
    """Jobs queued in `keys` order while the first one runs; the order they ran in."""
    ran: list[tuple[str, int]] = []

    async def main() -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            q = FairQueue(ex)
            jobs = [asyncio.ensure_future(q.run(k, lambda k=k, i=i: ran.append((k, i)) or i))
                    for i, k in enumerate(keys)]
            assert await asyncio.gather(*jobs) == list(range(len(keys)))
            assert len(q) == 0

    asyncio.run(main())
    return ran


def test_keys_take_turns() -> None:
    assert _order(["a", "a", "a", "b", "c", "b"]) == [
        ("a", 0), ("b", 3), ("c", 4), ("a", 1), ("b", 5), ("a", 2)]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from("abc"), max_size=12))
def test_each_key_in_order_and_keys_in_turns(keys: list[str]) -> None:
    ran = _order(keys)
    assert sorted(ran) == sorted((k, i) for i, k in enumerate(keys))
    for k in set(keys):
        mine = [i for kk, i in ran if kk == k]
        assert mine == sorted(mine)  # FIFO within a key
    # shadow model: job i runs in round (earlier jobs of its key), a round in arrival order
    seen: dict[str, int] = {}
    rounds = []
    for i, k in enumerate(keys):
        rounds.append((seen.get(k, 0), i, k))
        seen[k] = seen.get(k, 0) + 1
    assert ran == [(k, i) for _, i, k in sorted(rounds)]


def test_a_cancelled_job_is_skipped_and_errors_reach_their_caller() -> None:
    async def main() -> None:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            q = FairQueue(ex)
            ran = []
            first = asyncio.ensure_future(q.run("a", lambda: ran.append(1)))
            gone = asyncio.ensure_future(q.run("b", lambda: ran.append(2)))
            bad = asyncio.ensure_future(q.run("c", lambda: 1 / 0))
            await asyncio.sleep(0)
            gone.cancel()
            await first
            try:
                await bad
            except ZeroDivisionError:
                pass
            else:
                raise AssertionError("the job's error was lost")
            assert ran == [1]
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            q = FairQueue(ex)
        try:
            await q.run("a", lambda: 1)  # executor shut down
        except RuntimeError:
            return
        raise AssertionError("a shut-down executor must fail the job")

    asyncio.run(main())
