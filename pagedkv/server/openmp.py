"""Hands the process's OpenMP work over to one thread: the engine thread.

The OpenMP runtime torch ships on Linux (libgomp) gives every thread that starts a parallel
region its own team of worker threads and keeps that team for the thread's life. Once it
manages more threads than there are CPUs (the loading thread's team plus the engine thread's,
on 2 cores), libgomp stops spinning between parallel regions, so each of the hundreds of
parallel ops in a decode step first waits for a sleeping worker to wake up. Measured on a
2-core machine with SmolLM2: a batch-1 step took 20.7 ms on a thread other than the one that
loaded the model, and 11.1 ms on the loading thread, or on another thread once the loading
thread had released its team.
"""

from __future__ import annotations

import ctypes

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime initialized


def release_team() -> bool:
    """Releases the calling thread's OpenMP worker team (OpenMP 5.0 `omp_pause_resource_all`;
    the runtime builds a new one if this thread runs parallel work again). Call it from the
    thread that loaded the model before another thread takes over the stepping; never from
    inside a parallel region. False when no loaded OpenMP runtime offers the call."""
    try:
        pause = ctypes.CDLL(None).omp_pause_resource_all
    except (AttributeError, OSError):
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
