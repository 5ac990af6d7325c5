"""The thread that builds the AsyncEngine (the one that loaded the model) releases its OpenMP
worker team, so the engine thread's team is the only one while serving (see server/openmp.py).

Run in a fresh interpreter: the worker threads of this test process's own teams are not ours
to end, and the check counts the process's OS threads.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="Linux /proc")

SCRIPT = r"""
import json, os, time, torch
torch.set_num_threads(2)

def threads():
    return len(os.listdir("/proc/self/task"))

def settle(pred):
    deadline = time.monotonic() + 10
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.01)

x = torch.ones(1 << 22)
x.add_(1)  # a parallel region: this thread gets a team of 2 (itself and one worker)
with_team = threads()
from pagedkv.server.async_engine import AsyncEngine
AsyncEngine(None)  # built on this thread: the team goes
settle(lambda: threads() < with_team)
released = threads()
x.add_(1)  # parallel work on this thread again: a new team, same results
settle(lambda: threads() >= with_team)
print(json.dumps({"with_team": with_team, "released": released, "again": threads(),
                  "sum": float(x.sum())}))
"""


def test_building_the_async_engine_releases_the_builders_openmp_team() -> None:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         env=env, timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["released"] == got["with_team"] - 1  # the one worker thread ended
    assert got["again"] == got["with_team"]
    assert got["sum"] == 3.0 * (1 << 22)
