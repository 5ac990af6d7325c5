"""The thread-count decision on given /proc/stat samples (cpu_load.py), and on this machine."""

from __future__ import annotations

import os
import subprocess
import sys

from pagedkv import cpu_load
from pagedkv.cpu_load import CoreWatch, CpuSample, decide, other_load, parse_proc_stat

# two samples 100 ms apart (10 jiffies per CPU at USER_HZ 100): cpu1 fully busy in between
STAT_A = """cpu  2000 0 1000 8000 100 0 0 0 0 0
cpu0 1000 0 500 4000 50 0 0 0 0 0
cpu1 1000 0 500 4000 50 0 0 0 0 0
intr 12345
ctxt 999
"""
STAT_B = """cpu  2010 0 1002 8008 100 0 0 0 0 0
cpu0 1000 0 502 4008 50 0 0 0 0 0
cpu1 1010 0 500 4000 50 0 0 0 0 0
intr 12399
"""


def _sample(text: str, own: int = 0, cpus: set[int] | None = None) -> CpuSample:
    busy, total = parse_proc_stat(text, cpus)
    return CpuSample(busy, total, own, len(cpus) if cpus else 2)


def test_parse_proc_stat_sums_the_watched_cpus() -> None:
    assert parse_proc_stat(STAT_A) == (3000, 11100)  # busy: user + system; idle + iowait not
    assert parse_proc_stat(STAT_A, {1}) == (1500, 5550)
    a, b = _sample(STAT_A), _sample(STAT_B)
    assert other_load(a, b) == 1.2  # cpu1: 10 of 10 jiffies, cpu0: 2 of 10
    assert other_load(_sample(STAT_A, own=0), _sample(STAT_B, own=10)) == 0.2  # our own time


def test_decide_fewer_threads_when_a_core_is_held() -> None:
    assert decide(2, None, 0.1).threads == 2
    held = decide(2, None, 1.2)
    assert held.threads == 1 and "1.2 of 2 cores" in held.reason
    assert decide(2, None, 0.4).threads == 2  # below HELD_FRACTION of a core: not held
    assert decide(2, None, 0.6).threads == 1
    assert decide(2, None, 5.0).threads == 1  # never below one
    assert decide(8, None, 2.5).threads == 5
    assert decide(4, None, 2.0, per_core=2.0).threads == 3  # 2 busy hyperthreads = 1 core
    assert decide(2, None, None).threads == 2  # not measurable: one per core


def test_explicit_threads_win_with_a_warning() -> None:
    c = decide(2, 2, 1.2)
    assert c.threads == 2 and c.reason.startswith("--threads; warning") and "1 would be faster" in c.reason
    assert decide(2, 1, 1.2).reason == "--threads"
    assert decide(2, 2, 0.0).reason == "--threads"


def test_core_watch_adapts_while_serving_and_says_so_once() -> None:
    watch = CoreWatch(decide(2, None, 0.0), 2, explicit=False, cpus={0, 1})
    quiet = [f"cpu0 {i * 10} 0 0 {i * 10} 0\ncpu1 0 0 0 {i * 20} 0\n" for i in range(3)]
    busy = [f"cpu0 {i * 10} 0 0 {i * 10} 0\ncpu1 {i * 20} 0 0 0 0\n" for i in range(3, 6)]
    watch._last = _sample(quiet[0], cpus={0, 1})
    # own 10 jiffies per interval on cpu0 (our process), nothing else: stays at 2
    assert watch.check(_sample(quiet[1], own=10, cpus={0, 1})) == (None, None)
    watch._last = _sample(quiet[2], own=10, cpus={0, 1})
    msg, n = watch.check(_sample(busy[0], own=20, cpus={0, 1}))
    assert n == 1 and "2 -> 1 threads" in msg
    assert watch.check(_sample(busy[1], own=30, cpus={0, 1})) == (None, None)  # said once
    msg, n = watch.check(_sample(
        f"cpu0 {5 * 10} 0 0 {5 * 10} 0\ncpu1 {4 * 20} 0 0 20 0\n", own=40, cpus={0, 1}))
    assert n == 2 and "1 -> 2" in msg  # the other program left: back to the start count


def test_core_watch_explicit_only_warns() -> None:
    watch = CoreWatch(decide(2, 2, 0.0), 2, explicit=True, cpus={0, 1})
    watch._last = _sample("cpu0 0 0 0 0 0\ncpu1 0 0 0 0 0\n", cpus={0, 1})
    msg, n = watch.check(_sample("cpu0 0 0 0 10 0\ncpu1 10 0 0 0 0\n", cpus={0, 1}))
    assert n is None and "--threads" in msg and "1 would be faster" in msg


def test_choose_threads_sees_a_busy_core() -> None:
    """A real spinning process pinned to one of our CPUs: the start-up choice leaves it out."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(spin.pid, {cpus[-1]})
        cpu_load.choose_threads(len(cpus), sample_s=0.05)  # let it start spinning
        choice = cpu_load.choose_threads(len(cpus), sample_s=0.3)
        assert choice.load is not None and choice.load >= 0.8
        assert choice.threads <= len(cpus) - 1
    finally:
        spin.kill()
        spin.wait()
