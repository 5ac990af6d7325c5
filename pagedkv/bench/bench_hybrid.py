"""The hybrid KV cache on Gemma 3 270M (15 of 18 layers with a 512-token window): memory, and
prefix reuse across chat turns past the window, against llama-server on the same file.

1. KV bytes per token at 2k, 8k and 32k context: one sequence created (computed) in the cache's
   own bookkeeping with the engine's block sizes, hybrid (6 groups of 3 layers, window groups
   giving back their blocks) vs every layer full (--disable-hybrid-kv-cache-manager): the bytes
   of the blocks it holds after its prefill / its tokens. The ideal ratio at 32k is
   18 x 32768 / (3 x 32768 + 15 x 512) = 5.5x (6x less the windows).
2. Concurrent 8k-token sequences in 1 GiB of KV (the engine's float32 KV): sequences admitted
   one at a time (each allocates its whole prompt, then the window groups give theirs back as
   the engine does after a prefill) until the pool refuses one.
3. A 6-turn conversation through `pagedkv serve` and `llama-server` (default settings, the same
   threads): plain-text completion prompts (the file is a base model without a chat template),
   each turn the previous prompt plus a fixed reply and a new question (~350 tokens), past
   2,000 tokens by the last turn, through /v1/completions, streamed: prompt tokens computed per
   turn (pagedkv: prompt_tokens - cached_tokens; llama-server: its timings.prompt_n) and TTFT.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

LLAMA_SERVER = "/work/llama/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server"
GEMMA = Path.home() / ".cache" / "pagedkv" / "models" / "gemma-3-270m-q4_k_m.gguf"
CONTEXTS = (2048, 8192, 32768)

TOPICS = ["lighthouses", "bread baking", "glaciers", "chess openings", "beekeeping", "tides"]


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=str(GEMMA), help="the Gemma 3 GGUF file")
    ap.add_argument("--threads", type=int, default=2, help="threads of both servers")
    ap.add_argument("--llama-server", default=LLAMA_SERVER, help="llama-server binary ('' skips it)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--budget", default="1GiB", help="KV memory for the concurrency figure")
    ap.add_argument("--repeats", type=int, default=3,
                    help="conversations per server (each on a fresh server): TTFT medians")


# --- 1 and 2: memory, from the cache's own bookkeeping ----------------------------------------


def _config(model: str):  # noqa: ANN202
    from pagedkv.model.config import ModelConfig
    from pagedkv.model.gguf_file import GGUFFile

    f = GGUFFile(model)
    return ModelConfig.from_gguf(f.metadata, f.tensors)


def _cache(cfg, hybrid: bool, num_blocks: int, block_size: int = 16):  # noqa: ANN001, ANN202
    from pagedkv.cache import PagedKVCache
    from pagedkv.cache.groups import kv_groups
    from pagedkv.cache.storage import bytes_per_block

    groups = kv_groups([cfg.layer_window(i) for i in range(cfg.num_layers)], hybrid=hybrid)
    per = bytes_per_block(groups.layers_per_group, block_size, cfg.num_kv_heads, cfg.head_dim,
                          "float32")
    cache = PagedKVCache(num_blocks, block_size, groups=groups, bytes_per_block=per,
                         max_seq_len=max(CONTEXTS))
    return cache, per


def bytes_per_token(cfg) -> dict[str, Any]:  # noqa: ANN001
    out: dict[str, Any] = {}
    for n in CONTEXTS:
        row = {}
        for name, hybrid in (("hybrid", True), ("full", False)):
            cache, per = _cache(cfg, hybrid, num_blocks=6 * (n // 16 + 2))
            cache.create("s", list(range(n)))  # computed: the window groups give blocks back
            held = cache.held_blocks("s")
            row[name] = {"blocks": held, "bytes_per_token": round(held * per / n, 1)}
        row["ratio"] = round(row["full"]["bytes_per_token"] / row["hybrid"]["bytes_per_token"], 2)
        out[str(n)] = row
    return out


def concurrent_8k(cfg, budget: int, n: int = 8192) -> dict[str, Any]:  # noqa: ANN001
    from pagedkv.errors import OutOfBlocksError

    out: dict[str, Any] = {}
    for name, hybrid in (("hybrid", True), ("full", False)):
        _, per = _cache(cfg, hybrid, 1)
        cache, _ = _cache(cfg, hybrid, budget // per)
        k = 0
        while True:
            try:
                cache.create(k, [k] + list(range(n - 1)), extra_key=k)  # no shared prefix
            except OutOfBlocksError:
                break
            k += 1
        out[name] = {"sequences": k, "num_blocks": cache.num_blocks, "bytes_per_block": per}
    out["ratio"] = round(out["hybrid"]["sequences"] / max(1, out["full"]["sequences"]), 2)
    return out


# --- 3: the conversation through both servers ---------------------------------------------------


def turn_text(i: int) -> tuple[str, str]:
    """(a fixed reply to the previous question, the next question) of about 350 tokens."""
    t = TOPICS[i % len(TOPICS)]
    reply = (f"Answer: here is what I know about {t}. " + " ".join(
        f"Point {j + 1} about {t}: it is a subject with a long history, many practitioners, and "
        f"a vocabulary of its own that takes years to learn well." for j in range(11)))
    question = (f"\n\nQuestion {i + 1}: tell me about {t}, in detail, with examples, and "
                f"compare it with what we discussed before. " * 2 + "\nAnswer:")
    return reply, question


def conversation(turns: int) -> list[str]:
    prompts, text = [], "A conversation between a curious student and a teacher.\n"
    for i in range(turns):
        reply, question = turn_text(i)
        text += (reply if i else "") + question
        prompts.append(text)
    return prompts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, proc: subprocess.Popen, what: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{what} did not start")


def _stream(url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    last: dict[str, Any] = {}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if ttft is None and any(c.get("text") for c in obj.get("choices", [])):
                ttft = time.perf_counter() - t0
            if obj.get("usage"):
                last = obj
    usage = last.get("usage", {})
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    timings = last.get("timings")
    computed = timings["prompt_n"] if timings else usage.get("prompt_tokens", 0) - cached
    return {"prompt_tokens": usage.get("prompt_tokens"), "cached_tokens": cached,
            "computed_tokens": computed, "ttft_ms": round(1e3 * (ttft or 0.0), 1)}


def run_chat(url: str, prompts: list[str], max_tokens: int = 16) -> list[dict[str, Any]]:
    return [_stream(url, p, max_tokens) for p in prompts]


def start_pagedkv(model: str, threads: int, *extra: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--model", model, "--port", str(port),
           "--threads", str(threads), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, "pagedkv serve")
    return proc, url


def start_llama_server(binary: str, model: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([binary, "-m", model, "-t", str(threads), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    _wait(url, proc, "llama-server")
    return proc, url


def chat_both(args: argparse.Namespace) -> dict[str, Any]:
    """Per server and turn: prompt/cached/computed tokens (the same every repeat) and the
    median TTFT over the repeats, servers interleaved repeat by repeat."""
    prompts = conversation(2 if args.quick else args.turns)
    repeats = 1 if args.quick else args.repeats
    out: dict[str, Any] = {"turns": len(prompts), "repeats": repeats,
                           "context_tokens_last_turn": None}
    servers = [("pagedkv", lambda: start_pagedkv(args.model, args.threads)),
               ("pagedkv_full", lambda: start_pagedkv(args.model, args.threads,
                                                      "--disable-hybrid-kv-cache-manager"))]
    if args.llama_server:
        servers.append(("llama_server", lambda: start_llama_server(args.llama_server, args.model,
                                                                   args.threads)))
    runs: dict[str, list[list[dict[str, Any]]]] = {name: [] for name, _ in servers}
    for _ in range(repeats):
        for name, start in servers:
            proc, url = start()
            try:
                runs[name].append(run_chat(url, prompts))
            finally:
                proc.terminate()
                proc.wait(timeout=60)
            print(f"[bench hybrid] {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    for name, rs in runs.items():
        rows = []
        for t in range(len(prompts)):
            row = {k: v for k, v in rs[0][t].items() if k != "ttft_ms"}
            row["ttft_ms"] = statistics.median(r[t]["ttft_ms"] for r in rs)
            row["ttft_ms_runs"] = [r[t]["ttft_ms"] for r in rs]
            rows.append(row)
        out[name] = rows
    out["context_tokens_last_turn"] = out["pagedkv"][-1]["prompt_tokens"]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pagedkv.cache.sizing import parse_size

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = _config(args.model)
    result: dict[str, Any] = {
        "model": Path(args.model).name,
        "kv_dtype": "float32",
        "bytes_per_token": bytes_per_token(cfg),
        "concurrent_8k_in_" + args.budget: concurrent_8k(cfg, parse_size(args.budget)),
    }
    result["chat"] = chat_both(args)
    return result
