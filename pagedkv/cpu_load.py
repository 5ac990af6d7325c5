"""How many torch threads to run: one per physical core, minus the cores other programs hold.

A step of the engine is hundreds of OpenMP parallel regions, each ending in a barrier: when one
of its threads shares a core with another busy process, every region waits for that thread's
time slice, and the whole step slows down by far more than the lost core (measured on a 2-core
machine with one core held: 32 tokens in 52 s with 2 threads, 1.0 s with 1). So the thread count
is chosen from what other programs use:

- At start (`choose_threads`): /proc/stat is sampled twice, SAMPLE_S apart, over the CPUs this
  process may run on; their busy time, minus this process's own (/proc/self/stat), is the load
  of other programs in cores. Each whole core of it (rounded at HELD_FRACTION) is one thread
  fewer, never below one. An explicit `--threads` always wins; then only a warning is given.
- While serving (`CoreWatch.check`, called from the server's periodic stats task): the same
  difference over the interval since the last check. When the choice for the current load
  differs from the running count, it says so; with an automatic count it also returns the new
  count for the caller to apply on the engine thread (torch's thread count is per OpenMP
  thread), never above the start-up count.

Nothing here imports torch; the decision functions take samples, so they are tested on given
/proc/stat text.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

SAMPLE_S = 0.1  # start-up sample length
HELD_FRACTION = 0.5  # a core busy at least this much with other programs counts as held
_IDLE_FIELDS = (3, 4)  # idle, iowait in a /proc/stat cpuN line (after the name)


@dataclass(frozen=True, slots=True)
class CpuSample:
    """Jiffies summed over the CPUs watched: busy and total, and this process's own busy."""

    busy: int
    total: int
    own: int
    cpus: int  # how many CPUs were summed


def parse_proc_stat(text: str, cpus: set[int] | None = None) -> tuple[int, int]:
    """(busy, total) jiffies summed over the `cpuN` lines of /proc/stat text for N in `cpus`
    (None: every CPU). Busy is everything but idle and iowait (steal included: a core the
    hypervisor takes is held too)."""
    busy = total = 0
    for line in text.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        values = [int(v) for v in rest.split()[:8]]
        idle = sum(values[i] for i in _IDLE_FIELDS if i < len(values))
        busy += sum(values) - idle
        total += sum(values)
    return busy, total


def own_jiffies(stat_text: str) -> int:
    """utime + stime of a /proc/<pid>/stat line (its threads included)."""
    fields = stat_text.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


def allowed_cpus() -> set[int] | None:
    try:
        return set(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None


def read_sample(cpus: set[int] | None = None) -> CpuSample | None:
    """Now's sample; None where /proc cannot be read (not Linux)."""
    try:
        busy, total = parse_proc_stat(Path("/proc/stat").read_text(), cpus)
        own = own_jiffies(Path("/proc/self/stat").read_text())
    except (OSError, ValueError, IndexError):
        return None
    n = len(cpus) if cpus else os.cpu_count() or 1
    return CpuSample(busy, total, own, n)


def other_load(a: CpuSample, b: CpuSample) -> float:
    """Cores' worth of CPU time other processes used between samples a and b."""
    elapsed = (b.total - a.total) / max(1, b.cpus)  # jiffies of wall time per CPU
    if elapsed <= 0:
        return 0.0
    return max(0.0, ((b.busy - a.busy) - (b.own - a.own)) / elapsed)


def threads_for(physical: int, load: float, threads_per_core: float = 1.0) -> int:
    """Threads for `physical` cores when other programs use `load` logical CPUs."""
    held = int(load / max(1.0, threads_per_core) + (1 - HELD_FRACTION))
    return max(1, physical - held)


@dataclass(frozen=True, slots=True)
class ThreadChoice:
    threads: int
    reason: str  # for the start-up line: "one per physical core; ..." or why fewer
    load: float | None  # other programs' load in cores at start (None: not measured)


def choose_threads(physical: int, explicit: int | None = None, sample_s: float = SAMPLE_S,
                   cpus: set[int] | None = None) -> ThreadChoice:
    """The start-up choice: `explicit` as given (with a warning when busy cores make it slow),
    else one thread per physical core not held by another program."""
    cpus = allowed_cpus() if cpus is None else cpus
    a = read_sample(cpus)
    if a is not None:
        time.sleep(sample_s)
    b = read_sample(cpus)
    load = None if a is None or b is None else other_load(a, b)
    per_core = (len(cpus) / physical) if cpus else 1.0
    return decide(physical, explicit, load, per_core)


def decide(physical: int, explicit: int | None, load: float | None, per_core: float = 1.0) -> ThreadChoice:
    """choose_threads's decision for a measured `load` (None: unknown)."""
    auto = physical if load is None else threads_for(physical, load, per_core)
    busy = "" if load is None or auto == physical else (
        f"other programs keep {load:.1f} of {physical} cores busy")
    if explicit is not None:
        warn = f"; warning: {busy}, so {auto} would be faster" if busy and explicit > auto else ""
        return ThreadChoice(explicit, f"--threads{warn}", load)
    if busy:
        return ThreadChoice(auto, f"{busy}: one per free physical core; --threads N to change", load)
    return ThreadChoice(auto, "one per physical core; --threads N to change", load)


class CoreWatch:
    """Re-checks the choice while serving. `check()` returns (message, new thread count or
    None): a message only when the right count for the load since the last check differs from
    the running one (said once per change); a count only for an automatic choice."""

    def __init__(self, choice: ThreadChoice, physical: int, explicit: bool,
                 cpus: set[int] | None = None) -> None:
        self.start = choice.threads
        self.running = choice.threads
        self.physical = physical
        self.explicit = explicit
        self.cpus = allowed_cpus() if cpus is None else cpus
        self.per_core = (len(self.cpus) / physical) if self.cpus else 1.0
        self._last = read_sample(self.cpus)
        self._said: int | None = None

    def check(self, sample: CpuSample | None = None) -> tuple[str | None, int | None]:
        now = read_sample(self.cpus) if sample is None else sample
        before, self._last = self._last, now
        if before is None or now is None:
            return None, None
        load = other_load(before, now)
        best = min(self.start, threads_for(self.physical, load, self.per_core))
        if self.explicit:
            best = min(self.running, best)
        if best == self.running:
            self._said = None
            return None, None
        if best == self._said:
            return None, None
        self._said = best
        if self.explicit:
            return (f"other programs keep {load:.1f} of {self.physical} cores busy: "
                    f"{self.running} threads (--threads) now wait on each other; {best} would be faster"), None
        msg = (f"other programs keep {load:.1f} of {self.physical} cores busy: {self.running} -> "
               f"{best} threads")
        self.running = best
        return msg, best


WATCH: CoreWatch | None = None  # the process's watch (torch's thread count is process state)
