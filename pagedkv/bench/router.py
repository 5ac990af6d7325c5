"""A real sglang-router process in front of pagedkv replicas (for `bench route` and the tests).

`RouterProcess(workers, policy)` starts `python -m sglang_router.launch_router` on loopback
(its HTTP port and its Prometheus exporter on free ports), waits until /readiness counts every
worker healthy, and stops it (SIGTERM, then SIGKILL) on `close`. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_available() -> bool:
    """sglang-router is installed (its package carries the router binary)."""
    import importlib.util

    return importlib.util.find_spec("sglang_router") is not None


class RouterProcess:
    def __init__(self, workers: Sequence[str], policy: str = "cache_aware", *,
                 extra: Sequence[str] = (), timeout: float = 60.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="sglang-router-", suffix=".log",
                                               delete=False)
        cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
               "--port", str(self.port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port()), "--policy", policy,
               "--log-level", "warn", "--worker-urls", *workers, *extra]
        env = {**os.environ, "NO_COLOR": "1"}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_ready(len(workers), timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, n: int, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited ({self.proc.returncode}): "
                                   f"{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = httpx.get(self.url + "/readiness", timeout=2)
                if r.status_code == 200 and r.json().get("healthy_workers") == n:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"sglang-router not ready after {timeout} s: {self.log_tail()}")

    def log_tail(self, n: int = 2000) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()[-n:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()
        with contextlib.suppress(OSError):
            os.unlink(self.log.name)

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
