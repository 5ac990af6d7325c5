"""Server surface of the KV tier: POST /v1/cache/reset behind the API key, tier metrics,
usage cached_tokens from the tier, and `pagedkv serve --kv-snapshot` across a SIGTERM restart."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedkv.engine import LLMEngine
from pagedkv.server import ServerThread, build_app

pytestmark = pytest.mark.slow

DOC = ("Every morning the baker lit the oven at four, weighed the flour for twelve loaves, and "
       "set the starter on the warm shelf above the stove while the town still slept. ") * 6
PROMPT = f"{DOC}\nQuestion: when did the baker light the oven?\nAnswer:"
AUTH = {"Authorization": "Bearer k"}


def complete(url: str, headers: dict | None = None) -> dict:
    r = httpx.post(url + "/v1/completions", headers=headers or AUTH, timeout=300,
                   json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
    r.raise_for_status()
    return r.json()


def cached(body: dict) -> int:
    return body["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def test_reset_endpoint_metrics_and_tier_hits(smollm2, tmp_path: Path) -> None:  # noqa: ANN001
    engine = LLMEngine(smollm2, kv_tier=f"disk:{tmp_path}", num_blocks=128, kv_tier_read_timeout=10.0)
    with ServerThread(build_app(engine, api_key=["k", "tenant2"])) as srv:
        url = srv.url
        assert httpx.post(url + "/v1/cache/reset").status_code == 401
        other = {"Authorization": "Bearer tenant2"}
        assert httpx.post(url + "/v1/cache/reset", headers=other).status_code == 403
        first = complete(url)
        assert cached(first) == 0
        engine.tiers.connector.writer.flush()
        r = httpx.post(url + "/v1/cache/reset", headers=AUTH)
        assert r.status_code == 200 and r.json()["device_blocks"] > 0
        second = complete(url)  # the device cache is empty: the prefix comes from the tier
        assert cached(second) >= 64
        assert second["usage"]["prompt_tokens_details"]["tier_cached_tokens"] == cached(second)
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        metrics = httpx.get(url + "/metrics", headers=AUTH).text
        hit = [ln for ln in metrics.splitlines() if ln.startswith("pagedkv:kv_tier_hit_tokens_total")]
        assert hit and float(hit[0].split()[1]) == cached(second)
        assert "pagedkv:kv_tier_checksum_failures_total{" in metrics
        for bad in (b"{", b"[1]", b'{"tier": 1}', b'{"other": true}', b"x" * 5000):
            assert httpx.post(url + "/v1/cache/reset", headers=AUTH, content=bad).status_code in (400, 413)
        r = httpx.post(url + "/v1/cache/reset", headers=AUTH, json={"tier": True})
        assert r.status_code == 200 and r.json()["tier_blocks"] > 0
        assert cached(complete(url)) == 0  # both levels empty: computed again
    engine.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(snapshot: Path) -> tuple[subprocess.Popen, str]:
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--num-blocks", "128",
         "--threads", "1", "--kv-snapshot", str(snapshot), "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
        time.sleep(0.2)


def test_serve_snapshot_on_sigterm_and_warm_restart(tmp_path: Path) -> None:
    proc, url = _serve(tmp_path)
    try:
        first = complete(url, {})
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-2000:]
    assert "KV snapshot: wrote" in err
    assert len(list(tmp_path.rglob("*.kvb"))) >= 5
    proc, url = _serve(tmp_path)
    try:
        again = complete(url, {})
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)
    assert cached(again) >= 64 and again["choices"][0]["text"] == first["choices"][0]["text"]
    assert "tier_cached_tokens" not in again["usage"]["prompt_tokens_details"]  # device hits
