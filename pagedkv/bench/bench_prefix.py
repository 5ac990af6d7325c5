"""`pagedkv bench prefix`: eight questions about one ~2,000-token document, sent at once.

The document is the terms of the Apache License 2.0 (pagedkv/bench/data/apache-2.0-terms.txt;
the license text may be copied verbatim). Eight chat requests (document first, then a question)
go to an in-process OpenAI-compatible server at concurrency 8, greedy, 64 new tokens each
(ignore_eos), with in-flight prefix dedup on and off (a fresh engine for every run, the model
loaded once). Reported per mode: median and max time to first token, total seconds, and the
prompt tokens the engine actually computed (prompt tokens minus prefix-cache hits). Target:
median TTFT at least 4x lower with dedup on; computed tokens close to one document plus the
questions. Medians over `--repeats` runs, the modes alternating.

Measured on the idle 2-core machine (benchmarks/results/prefix*.json): dedup never triggered
here, on or off, with a budget of 2,048 or 8,192 tokens per step. The eight requests reach the
scheduler one by one (tokenized on the server's preprocessing thread), the first request's
document prefill (~2,050 tokens, seconds) starts with the first arrival, and the others are
admitted after its step commits, as plain prefix hits: both modes compute one document plus the
questions. Dedup matters when sharers wait together at one admission (tests/test_scheduler.py,
tests/test_engine.py show that case).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from typing import Any

import httpx

from pagedkv.bench import DATA
from pagedkv.bench.bench_serve import _one_request, _served_model

QUESTIONS = [
    "What does the license say a 'Contribution' is?",
    "Which rights does section 2 grant?",
    "When does the patent license in section 3 terminate?",
    "What must a redistribution carry, according to section 4?",
    "What does section 6 say about trademarks?",
    "Is the work provided with any warranty?",
    "Who is liable for damages under section 8?",
    "May someone offer support for a fee, and on what condition?",
]


def _log(msg: str) -> None:
    print(f"[bench prefix] {msg}", file=sys.stderr, flush=True)


def _messages(doc: str, question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{doc}\n\nAnswer briefly: {question}"}]


async def _burst(url: str, prompts: list, max_tokens: int) -> tuple[list, float]:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(base_url=url, limits=limits,
                                 timeout=httpx.Timeout(600.0)) as client:
        model = await _served_model(client)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(_one_request(client, p, model, max_tokens) for p in prompts))
        return list(res), time.perf_counter() - t0


def _one_run(loaded, dedup: bool, prompts: list, max_tokens: int,  # noqa: ANN001
            budget: int) -> dict[str, Any]:
    from pagedkv.engine import LLMEngine
    from pagedkv.server import ServerThread, build_app

    engine = LLMEngine(loaded, dedup_inflight_prefixes=dedup, max_num_batched_tokens=budget)
    with ServerThread(build_app(engine)) as server:
        asyncio.run(_burst(server.url, [[{"role": "user", "content": "Hi"}]], 2))  # warm-up
        before = engine.stats()
        results, total = asyncio.run(_burst(server.url, prompts, max_tokens))
        st = engine.stats()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed: {failed[:2]}")
    ttft = [r.ttft for r in results]
    prompt = st.prompt_tokens_total - before.prompt_tokens_total
    hits = st.prefix_cache_hits - before.prefix_cache_hits
    return {"median_ttft_s": statistics.median(ttft), "max_ttft_s": max(ttft),
            "total_s": total, "prompt_tokens": prompt, "prompt_tokens_computed": prompt - hits,
            "requests_held": st.dedup_requests_held - before.dedup_requests_held,
            "tokens_saved": st.dedup_tokens_saved - before.dedup_tokens_saved,
            "outputs": [r.output_tokens for r in results]}


def _median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {}
    for k in ("median_ttft_s", "max_ttft_s", "total_s", "prompt_tokens",
              "prompt_tokens_computed", "requests_held", "tokens_saved"):
        v = statistics.median(r[k] for r in runs)
        out[k] = round(v, 3) if isinstance(v, float) else v
    return out


def run_prefix_bench(repeats: int = 3, max_tokens: int = 64, quick: bool = False,
                     budget: int = 2048) -> dict:
    import torch

    from pagedkv.model.loader import load_model

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(os.cpu_count() or 1)
    doc = (DATA / "apache-2.0-terms.txt").read_text()
    questions = QUESTIONS
    if quick:
        doc, questions, repeats, max_tokens = doc[: len(doc) // 4], QUESTIONS[:4], 1, 8
    loaded = load_model(None, dtype=torch.float32)
    prompts = [_messages(doc, q) for q in questions]
    tok = loaded.tokenizer
    doc_tokens = len(tok(doc, add_special_tokens=False).input_ids)
    runs: dict[str, list] = {"on": [], "off": []}
    for i in range(repeats):
        for mode in ("on", "off"):
            _log(f"repeat {i + 1}/{repeats}: dedup {mode}")
            runs[mode].append(_one_run(loaded, mode == "on", prompts, max_tokens, budget))
    on, off = _median_of(runs["on"]), _median_of(runs["off"])
    return {
        "model": loaded.name, "threads": torch.get_num_threads(), "requests": len(prompts),
        "concurrency": len(prompts), "max_tokens": max_tokens, "repeats": repeats,
        "max_num_batched_tokens": budget,
        "document_tokens": doc_tokens, "on": on, "off": off,
        "median_ttft_speedup": round(off["median_ttft_s"] / on["median_ttft_s"], 2),
        "total_speedup": round(off["total_s"] / on["total_s"], 2),
        "target_median_ttft_speedup": 4.0,
    }


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="the engine's token budget per step (its default: 2048)")


def run(args: argparse.Namespace) -> dict:
    return run_prefix_bench(args.repeats, args.max_tokens, args.quick, args.max_num_batched_tokens)
