"""`pagedkv bench serve`: load an OpenAI-compatible server with concurrent streaming requests.

Reports what `vllm bench serve` reports: request and token throughput, and mean / median /
p99 of TTFT (time to first token), TPOT (time per output token after the first:
(latency - ttft) / (output_tokens - 1)), ITL (gap between successive streamed chunks) and
E2EL (end-to-end latency), in milliseconds.

    pagedkv bench serve --base-url http://127.0.0.1:8000   # a running server
    pagedkv bench serve                                     # starts its own
    pagedkv bench serve --peer http://127.0.0.1:8081        # pagedkv vs another server

With --peer (for example llama.cpp's llama-server on the same GGUF and threads; see the README),
the same client sends the same chat prompts (128 new tokens, greedy, ignore_eos) to pagedkv and
to the peer at each of --peer-concurrency (1, 8, 40 clients), one server at a time, and reports
output tok/s, TTFT and TPOT of both and pagedkv's output-throughput ratio. pagedkv is started as
its own `pagedkv serve --threads N` process unless --base-url names a running one. Before each
level both servers get the same untimed warm-up (`concurrency` requests of WARMUP_TOKENS tokens
at once), as `vllm bench serve` sends a test prompt first: a server's first requests after
start-up (or at a new batch size) pay one-time costs that are not its serving speed.

A level is measured --repeats times (default 3), the two servers' runs alternated in ABBA order
(pagedkv, peer; then peer, pagedkv; ...) so that a drifting machine (on a shared 2-core VM, 10-20%
within minutes) weighs on both alike. The level's `ratio` is the median of the rounds' ratios
(`ratios`, in round order); `pagedkv` and `peer` are each server's run of median output
throughput.

Each --peer round also runs the same requests in this process, right after the servers, through
`LLMEngine.step` with the same threads and `concurrency` requests in flight, no HTTP
(`in_process`): what the server path costs is `tpot_http_over_in_process` (1.0 = nothing), the
median of the rounds' TPOT ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagedkv.options import positive_int

DATA = Path(__file__).parent / "data"
Prompt = str | list[dict[str, str]]


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, served from the server's prompt/prefix cache
    output_tokens: int = 0
    error: str = ""
    retried: bool = False  # sent again after a kept-alive connection closed under it (see _one_request)


def default_prompts() -> list[Prompt]:
    """The chat workload shared with the throughput benchmark."""
    return json.loads((DATA / "chat_prompts.json").read_text())["prompts"]


def _request_body(prompt: Prompt, model: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Fixed output lengths make runs comparable (as vllm's random dataset does);
        # servers that do not know the field ignore it.
        "ignore_eos": True,
    }
    if isinstance(prompt, str):
        return "/v1/completions", {**body, "prompt": prompt}
    return "/v1/chat/completions", {**body, "messages": prompt}


def _cached_tokens(usage: dict[str, Any]) -> int:
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field; pagedkv and llama-server both
    send it): the prompt tokens the server did not compute. 0 when absent or not a count."""
    details = usage.get("prompt_tokens_details")
    n = details.get("cached_tokens") if isinstance(details, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def _chunk_has_text(obj: dict[str, Any]) -> bool:
    for choice in obj.get("choices") or []:
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def _one_request(
    client: httpx.AsyncClient, prompt: Prompt, model: str, max_tokens: int
) -> RequestResult:
    """One streamed request. Sent once more, on a new connection, when the server closed the
    kept-alive connection it went out on before any byte of a response came back (the race
    every HTTP/1.1 client meets: llama-server's cpp-httplib closes connections after a count of
    requests or an idle time); the retry is counted (`retried` in the summary). Any other error,
    or one after the response began, fails the request."""
    result = RequestResult()
    for attempt in range(2):
        try:
            return await _stream(client, prompt, model, max_tokens, result)
        except httpx.RemoteProtocolError as exc:
            if attempt or "without sending a response" not in str(exc):
                result.error = f"{type(exc).__name__}: {exc}"
                return result
            result.retried = True
        except httpx.HTTPError as exc:
            result.error = f"{type(exc).__name__}: {exc}"
            return result
    return result  # (not reached)


async def _stream(
    client: httpx.AsyncClient, prompt: Prompt, model: str, max_tokens: int, result: RequestResult
) -> RequestResult:
    path, body = _request_body(prompt, model, max_tokens)
    chunks = 0
    start = last = time.perf_counter()
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return result
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                result.error = str(obj["error"])
                return result
            now = time.perf_counter()
            if obj.get("usage"):
                result.prompt_tokens = obj["usage"]["prompt_tokens"]
                result.output_tokens = obj["usage"]["completion_tokens"]
                result.cached_tokens = _cached_tokens(obj["usage"])
            if _chunk_has_text(obj):
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itls.append(now - last)
                chunks += 1
                last = now
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks  # no usage: count chunks
    result.ok = chunks > 0
    return result


def _stats_ms(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": 1e3 * statistics.fmean(ordered), "median": 1e3 * statistics.median(ordered),
            "p99": 1e3 * p99}


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    cached = sum(min(r.cached_tokens, r.prompt_tokens) for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "retried": sum(r.retried for r in results),  # resent once after a stale kept-alive connection
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        # prompt tokens the server took from its cache (the rest it computed): a server that
        # kept the warm-up's prompts prefills less, and its TTFT shows that, not its speed
        "total_cached_input_tokens": cached,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, values in [("ttft", [r.ttft for r in ok]), ("tpot", tpots),
                         ("itl", [x for r in ok for x in r.itls]),
                         ("e2el", [r.latency for r in ok])]:
        for stat, value in _stats_ms(values).items():
            summary[f"{stat}_{name}_ms"] = value
    errors = [r.error for r in results if r.error]
    if errors:
        summary["first_errors"] = errors[:3]
    return summary


async def _served_model(client: httpx.AsyncClient) -> str:
    response = await client.get("/v1/models")
    response.raise_for_status()
    return response.json()["data"][0]["id"]


async def arun_serve_bench(
    base_url: str,
    num_requests: int = 64,
    concurrency: int = 16,
    max_tokens: int = 32,
    prompts: list[Prompt] | None = None,
    model: str | None = None,
    api_key: str | None = None,
) -> dict[str, Any]:
    prompts = prompts or default_prompts()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(600.0)) as client:
        model = model or await _served_model(client)
        gate = asyncio.Semaphore(concurrency)

        async def limited(i: int) -> RequestResult:
            async with gate:
                return await _one_request(client, prompts[i % len(prompts)], model, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(num_requests)))
        duration = time.perf_counter() - start
    summary = summarize(list(results), duration)
    summary.update(base_url=base_url, model=model, num_requests=num_requests,
                   concurrency=concurrency, max_tokens=max_tokens)
    return summary


def run_serve_bench(
    base_url: str | None = None,
    num_requests: int = 64,
    concurrency: int = 16,
    max_tokens: int = 32,
    prompts: list[Prompt] | None = None,
    model: str | None = None,
    api_key: str | None = None,
    engine_kwargs: dict[str, Any] | None = None,
    quick: bool = False,
) -> dict[str, Any]:
    """Benchmarks the server at base_url, or (base_url None) a pagedkv server started in this
    process with LLMEngine(**engine_kwargs) (default: the shipped SmolLM2). quick: a
    16-request, 16-token smoke run."""
    if quick:
        num_requests, concurrency, max_tokens = 16, 8, 16
    kwargs = dict(num_requests=num_requests, concurrency=concurrency, max_tokens=max_tokens,
                  prompts=prompts, model=model, api_key=api_key)
    if base_url is not None:
        return asyncio.run(arun_serve_bench(base_url, **kwargs))
    from pagedkv.engine import LLMEngine
    from pagedkv.server import ServerThread, build_app

    engine = LLMEngine(**(engine_kwargs or {}))
    with ServerThread(build_app(engine, api_key=api_key)) as server:
        result = asyncio.run(arun_serve_bench(server.url, **kwargs))
    result["base_url"] = "in-process"
    return result


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", default=None, help="a running server (default: start one)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--model", default=None,
                    help="name to request (default: the server's first model); with no "
                         "--base-url, the model source for the in-process engine")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--prompt", action="append", default=None,
                    help="raw completion prompt (repeatable; default: the chat workload)")
    ap.add_argument("--peer", default=None, help="another OpenAI-compatible server to compare with")
    ap.add_argument("--peer-concurrency", default="1,8,40", help="client counts for --peer")
    ap.add_argument("--peer-max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2, help="threads of the pagedkv server started")
    ap.add_argument("--weights", default=None, choices=["quantized", "float32"],
                    help="weights of the pagedkv server started for --peer")
    ap.add_argument("--activations", default=None, choices=["float32", "int8"],
                    help="activations of the pagedkv server started for --peer and of its "
                         "in-process reference (default: the engine's, float32)")
    ap.add_argument("--batch-weights", default=None, choices=["quantized", "float32", "panel"],
                    help="batch weights of the pagedkv server started for --peer and of its "
                         "in-process reference (default: the engine's, quantized)")
    ap.add_argument("--greedy-head", default=None, choices=["screen", "off"],
                    help="greedy head of the pagedkv server started for --peer and of its "
                         "in-process reference (default: the engine's, screen)")
    ap.add_argument("--kv-cache-dtype", default=None,
                    help="KV cache dtype of the pagedkv server started for --peer and of its in-process "
                         "reference (default: the engine's, auto; llama.cpp's default is float16)")
    ap.add_argument("--no-in-process", action="store_true",
                    help="with --peer: skip the in-process reference (LLMEngine.step, no HTTP)")
    ap.add_argument("--repeats", type=positive_int, default=3,
                    help="with --peer: rounds per level, the servers alternated (ABBA); the "
                         "ratio is the rounds' median")


WARMUP_TOKENS = 4  # per warm-up request (run_peer)


def _requests_for(concurrency: int) -> int:
    """Enough requests that every client is busy for a while, few enough for a ~3 min run."""
    return max(4, 2 * concurrency) if concurrency < 40 else concurrency


def start_pagedkv(threads: int, weights: str | None, model: str | None,
                  activations: str | None = None, batch_weights: str | None = None,
                  kv_cache_dtype: str | None = None, greedy_head: str | None = None
                  ) -> tuple[subprocess.Popen, str]:
    """`pagedkv serve` as its own process (as the peer is); returns it once /health answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--threads", str(threads),
           "--log-level", "warning", "--max-num-seqs", "64"]
    cmd += ["--weights", weights] if weights else []
    cmd += ["--activations", activations] if activations else []
    cmd += ["--batch-weights", batch_weights] if batch_weights else []
    cmd += ["--kv-cache-dtype", kv_cache_dtype] if kv_cache_dtype else []
    cmd += ["--greedy-head", greedy_head] if greedy_head else []
    cmd += ["--model", model] if model else []
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            httpx.get(url + "/health", timeout=2).raise_for_status()
            return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"pagedkv serve did not start: {' '.join(cmd)}")


def in_process_engine(args: argparse.Namespace, prompts: list[Prompt], levels: list[int],
                      max_tokens: int) -> Any:
    """An LLMEngine in this process like the server's (same model, weights, threads), with
    KV blocks for the largest level's requests at once."""
    import torch

    from pagedkv.engine import LLMEngine

    torch.set_num_threads(args.threads)
    modes = {k: v for k, v in (("weights", args.weights), ("activations", args.activations),
                               ("batch_weights", args.batch_weights)) if v}
    engine = LLMEngine(args.model, num_blocks=1, max_num_seqs=64, **modes)
    longest = max(len(engine.tokenize(p)) for p in prompts)
    # (blocks_needed counts each KV group's: a hybrid cache holds a token once per group)
    per_request = engine.cache.blocks_needed(longest + max_tokens + engine.cache.block_size)
    kv = {"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype else {}
    if args.greedy_head:
        kv["greedy_head"] = args.greedy_head
    return LLMEngine(engine.loaded, num_blocks=max(levels) * per_request, max_num_seqs=64, **kv)


def run_in_process(engine: Any, prompts: list[Prompt], concurrency: int, num_requests: int,
                   max_tokens: int) -> dict[str, Any]:
    """The HTTP run's requests (same prompts, greedy, ignore_eos), `concurrency` in flight at a
    time, stepped by LLMEngine in this thread with no server around it. The prompts' prefixes
    are cached first (one token each), so prefill matters less here than over HTTP: compare
    TPOT and steps, not TTFT."""
    from pagedkv.engine import SamplingParams

    warm = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(min(num_requests, len(prompts))):
        engine.add_request(f"warm-{concurrency}-{i}", prompts[i], warm)
    while engine.has_unfinished_requests():
        engine.step()
    added = running = tokens = 0
    steps: list[float] = []
    tpots: list[float] = []
    start = time.perf_counter()
    while added < num_requests or running:
        while running < concurrency and added < num_requests:
            engine.add_request(f"ref-{concurrency}-{added}", prompts[added % len(prompts)], params)
            added, running = added + 1, running + 1
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        for out in (o for o in outs if o.finished):
            running -= 1
            n = len(out.outputs[0].token_ids)
            tokens += n
            if n > 1:
                tpots.append((out.finish_time - out.first_token_time) / (n - 1))
    duration = time.perf_counter() - start
    return {"completed": num_requests, "total_output_tokens": tokens,
            "output_throughput": round(tokens / duration, 2),
            "median_tpot_ms": round(1e3 * statistics.median(tpots), 2) if tpots else 0.0,
            "median_step_ms": round(1e3 * statistics.median(steps), 2),
            "duration_s": round(duration, 2)}


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    keys = ("completed", "failed", "retried", "output_throughput", "median_ttft_ms", "median_tpot_ms", "duration_s",
            "total_input_tokens", "total_cached_input_tokens")
    out = {k: round(r[k], 2) if isinstance(r[k], float) else r[k] for k in keys if k in r}
    if "first_errors" in r:
        out["first_errors"] = r["first_errors"]
    return out


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median output throughput (the lower middle one of an even count)."""
    return sorted(runs, key=lambda r: r["output_throughput"])[(len(runs) - 1) // 2]


def _rounds(ours: str, peer: str, kw: dict[str, Any], repeats: int,
            local: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
    """One level: `repeats` rounds of both servers' runs, ABBA order; the median ratio. With
    `local` (the in-process reference), each round also runs it right after the servers, and
    `tpot_http_over_in_process` is the median of the rounds' TPOT ratios (a ratio of runs
    minutes apart read the machine's drift: 1.16x in one run, 0.96-1.04x back to back)."""
    runs: dict[str, list[dict[str, Any]]] = {ours: [], peer: []}
    refs: list[dict[str, Any]] = []
    for i in range(repeats):
        for url in ((ours, peer) if i % 2 == 0 else (peer, ours)):
            runs[url].append(asyncio.run(arun_serve_bench(url, **kw)))
        if local is not None:
            refs.append(local())
    ratios = [a["output_throughput"] / b["output_throughput"]
              for a, b in zip(runs[ours], runs[peer], strict=True) if b["output_throughput"]]
    row = {"pagedkv": _brief(_median_run(runs[ours])), "peer": _brief(_median_run(runs[peer])),
           "ratio": round(statistics.median(ratios), 2) if ratios else None,
           "ratios": [round(r, 2) for r in ratios]}
    if refs:
        over = [a["median_tpot_ms"] / r["median_tpot_ms"]
                for a, r in zip(runs[ours], refs, strict=True) if r["median_tpot_ms"]]
        row["in_process"] = _median_run(refs)
        row["tpot_http_over_in_process"] = round(statistics.median(over), 2) if over else None
        row["tpot_http_over_in_process_rounds"] = [round(r, 2) for r in over]
    return row


def run_peer(args: argparse.Namespace) -> dict[str, Any]:
    """pagedkv vs args.peer at each client count, same client and prompts."""
    levels = [int(c) for c in str(args.peer_concurrency).split(",") if c.strip()]
    proc, ours = ((None, args.base_url) if args.base_url else
                  start_pagedkv(args.threads, args.weights, args.model, args.activations, args.batch_weights,
                                args.kv_cache_dtype, args.greedy_head))
    max_tokens = 16 if args.quick else args.peer_max_tokens
    rows = {}
    try:  # (from here on the server is stopped whatever fails: the in-process engine's set-up too)
        prompts = args.prompt or default_prompts()
        local = None if args.no_in_process else in_process_engine(args, prompts, levels, max_tokens)
        for c in levels:
            n = c if args.quick else _requests_for(c)
            kw = dict(num_requests=n, concurrency=c, max_tokens=max_tokens, prompts=prompts,
                      api_key=args.api_key)
            for url in (ours, args.peer):  # untimed, the same for both
                asyncio.run(arun_serve_bench(url, num_requests=c, concurrency=c, max_tokens=WARMUP_TOKENS,
                                             prompts=prompts, api_key=args.api_key))
            ref = None if local is None else functools.partial(run_in_process, local, prompts, c, n, max_tokens)
            rows[str(c)] = _rounds(ours, args.peer, kw, 1 if args.quick else args.repeats, ref)
            print(f"[bench serve] {c} clients: {rows[str(c)]}", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=30)
    from pagedkv.model import qkernel

    return {"peer": args.peer, "pagedkv_threads": args.threads, "max_tokens": max_tokens,
            "repeats": 1 if args.quick else args.repeats,
            "warmup": f"each level: its concurrency in requests of {WARMUP_TOKENS} tokens, both servers",
            "weights": args.weights or "default", "activations": args.activations or "default",
            "batch_weights": args.batch_weights or "default",
            "kv_cache_dtype": args.kv_cache_dtype or "default",
            "greedy_head": args.greedy_head or "default",
            "kernels": qkernel.isa() if proc is not None else None,  # the server started here
            "clients": rows}


def run(args: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # as the CLI: weights from local files only
    if args.peer:
        return run_peer(args)
    in_process = args.base_url is None
    return run_serve_bench(
        args.base_url, num_requests=args.num_requests, concurrency=args.concurrency,
        max_tokens=args.max_tokens, prompts=args.prompt,
        model=None if in_process else args.model, api_key=args.api_key,
        engine_kwargs={"model": args.model} if in_process else None, quick=args.quick,
    )
