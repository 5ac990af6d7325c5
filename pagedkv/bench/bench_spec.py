"""`pagedkv bench spec`: speculative decoding (prompt lookup) on vs off, greedy, SmolLM2.

Three workloads, each as chat requests through the default model's template:
- `edit`: a 59-line Python function (`data/spec_edit_function.txt`) with "rename variable X to
  Y, reply with the whole function" (each client renames another variable);
- `quote`: the first 2,500 characters of the Declaration of Independence
  (`data/public_domain_text.txt`) and "quote the sentence that begins with ..." (each client
  asks for another sentence);
- `chat`: open chat: one story request for one client, the held-out prompts of
  `data/chat_prompts.json` for more.
For each client count (`--clients`, default 1,8,40: that many requests at once, in the engine,
no HTTP) the two modes alternate `--repeats` times on fresh engines over one loaded model, and
the medians are reported: output tok/s over the whole run (prefill included) and decode tok/s
(from each request's first token to its last, summed over requests / the run's decode span),
whether every output is token-for-token the same, drafts and accepted drafts.
Targets (issue 27): >= 2x decode tok/s on edit and quote with one client, >= 0.95x on chat,
and never below 0.95x at 8 and 40 clients.

`--peer PATH` (llama.cpp's llama-server binary) instead runs one client, each workload's first
request, through the same HTTP client against `pagedkv serve` with and without
`--speculative-config` and llama-server on the same GGUF file, without speculation and with
`--spec-type ngram-simple` (its defaults, and sized as SPEC: 4-token lookup, 5 drafts), all
with `--threads` threads, one server at a time; tok/s is completion tokens over the request's
wall time (prefill included, the prompt cached by a warm-up request first).

A draft model is measured the same way: `--speculative-config '{"method": "draft_model",
"model": "smollm2", "num_speculative_tokens": 3}'` (the shipped model drafting for itself, its
weights shared: the upper bound on acceptance, at a full forward pass per draft).
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

from pagedkv.bench import DATA
from pagedkv.bench.bench_throughput import load_prompts

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
RENAMES = [("amount", "subtotal"), ("totals", "sums"), ("counts", "tallies"),
           ("report", "rows"), ("customer", "client"), ("skipped", "ignored"),
           ("summary", "overview"), ("grand_total", "overall")]
SENTENCES = ["We hold these truths", "Prudence, indeed", "But when a long train",
             "Such has been the patient", "The history of the present King",
             "He has refused his Assent", "He has forbidden his Governors", "When in the Course"]
OPEN_CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
TARGETS = {"edit": 2.0, "quote": 2.0, "chat": 0.95}
MULTI_TARGET = 0.95


def add_args(ap) -> None:  # noqa: ANN001
    ap.add_argument("--clients", default="1,8,40", help="comma-separated request counts")
    ap.add_argument("--workloads", default="edit,quote,chat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="per request (default: edit 320, quote 96, chat 128; 96 above 1 client)")
    ap.add_argument("--speculative-config", default=json.dumps(SPEC))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer", default=None, help="llama-server binary: the HTTP comparison")


def _log(msg: str) -> None:
    print(f"[bench spec] {msg}", file=sys.stderr, flush=True)


def workload(name: str, n: int) -> list[list[dict]]:
    """n chat requests of a workload (variants cycled)."""
    if name == "edit":
        code = (DATA / "spec_edit_function.txt").read_text()
        return [[{"role": "user", "content": f"Rename the variable `{a}` to `{b}` in this Python "
                  f"function. Reply with the complete updated function only.\n\n```python\n"
                  f"{code}```"}] for a, b in (RENAMES * n)[:n]]
    if name == "quote":
        doc = (DATA / "public_domain_text.txt").read_text()[:2500]
        return [[{"role": "user", "content": f"{doc}\n\nQuote, word for word, the sentence of "
                  f"the document above that begins with \"{s}\"."}] for s in (SENTENCES * n)[:n]]
    if name == "chat":
        if n == 1:  # one stream: an open question with a long answer
            return [[{"role": "user", "content": OPEN_CHAT}]]
        chats = load_prompts("chat_prompts.json")
        return (chats * (n // len(chats) + 1))[:n]
    raise SystemExit(f"unknown workload {name!r} (edit, quote, chat)")


def _max_tokens(args, name: str, n: int) -> int:  # noqa: ANN001
    if args.max_tokens:
        return args.max_tokens
    if args.quick:
        return 24
    if n > 1:
        return 96
    return {"edit": 320, "quote": 96, "chat": 128}[name]


def _one_run(loaded: Any, chats: list, max_tokens: int, spec: Any) -> dict[str, Any]:
    from pagedkv.engine import LLMEngine, SamplingParams

    eng = LLMEngine(loaded, num_blocks=2048, max_num_seqs=64, speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    for i, chat in enumerate(chats):
        eng.add_request(f"r{i}", chat, params)
    outs: dict[str, Any] = {}
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outs[out.request_id] = out
    t1 = time.perf_counter()
    done = [outs[f"r{i}"] for i in range(len(chats))]
    tokens = sum(len(o.token_ids) for o in done)
    first = min(o.first_token_time for o in done)
    last = max(o.finish_time for o in done)
    st = eng.stats()
    return {"tok_s": tokens / (t1 - t0), "decode_tok_s": (tokens - len(done)) / (last - first),
            "seconds": t1 - t0, "tokens": tokens,
            "draft_tokens": st.spec_decode_num_draft_tokens,
            "accepted_tokens": st.spec_decode_num_accepted_tokens,
            "ids": [o.token_ids for o in done]}


def _median(runs: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "ids"}


def _engine_runs(args, loaded: Any) -> dict[str, Any]:  # noqa: ANN001
    counts = [int(c) for c in str(args.clients).split(",") if c]
    repeats = 1 if args.quick else args.repeats
    out: dict[str, Any] = {}
    for name in str(args.workloads).split(","):
        out[name] = {}
        for n in counts:
            chats = workload(name, n)
            mt = _max_tokens(args, name, n)
            runs: dict[str, list[dict]] = {"off": [], "on": []}
            for r in range(repeats):
                for mode in ("off", "on"):
                    runs[mode].append(_one_run(loaded, chats, mt, args.speculative_config
                                               if mode == "on" else None))
                    _log(f"{name}, {n} clients, {mode}, repeat {r + 1}: "
                         f"{runs[mode][-1]['decode_tok_s']:.1f} decode tok/s")
            med = {m: _median(rs) for m, rs in runs.items()}
            on = med["on"]
            out[name][str(n)] = {
                "max_tokens": mt, **med,
                "ratio": on["tok_s"] / med["off"]["tok_s"],
                "decode_ratio": on["decode_tok_s"] / med["off"]["decode_tok_s"],
                "decode_ratios": [a["decode_tok_s"] / b["decode_tok_s"]
                                  for a, b in zip(runs["on"], runs["off"], strict=True)],
                "acceptance": on["accepted_tokens"] / on["draft_tokens"]
                if on["draft_tokens"] else 0.0,
                "outputs_equal": all(a["ids"] == b["ids"] for a, b in
                                     zip(runs["on"], runs["off"], strict=True)),
            }
    return out


def _targets(res: dict[str, Any]) -> dict[str, Any]:
    rows = []
    for name, by_n in res.items():
        for n, row in by_n.items():
            goal = TARGETS[name] if n == "1" else MULTI_TARGET
            rows.append({"workload": name, "clients": int(n), "goal": goal,
                         "decode_ratio": round(row["decode_ratio"], 3),
                         "met": row["decode_ratio"] >= goal})
    return {"rows": rows, "met": all(r["met"] for r in rows)}


# --- the HTTP comparison with llama-server ---------------------------------------------------


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(cmd: list[str], url: str) -> subprocess.Popen:
    import httpx

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            httpx.get(url + "/health", timeout=2).raise_for_status()
            return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"did not start: {' '.join(cmd)}")


def _chat(url: str, messages: list[dict], max_tokens: int,
          model: str = "m") -> tuple[float, int, str]:
    import httpx

    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    j = r.json()
    return dt, j["usage"]["completion_tokens"], j["choices"][0]["message"]["content"]


def _peer_runs(args) -> dict[str, Any]:  # noqa: ANN001
    from pagedkv.model import default_model_path

    gguf = str(default_model_path())
    t = str(args.threads)
    servers = {
        "pagedkv": [sys.executable, "-m", "pagedkv.cli", "serve", "--threads", t,
                    "--log-level", "warning"],
        "pagedkv_spec": [sys.executable, "-m", "pagedkv.cli", "serve", "--threads", t,
                         "--log-level", "warning", "--speculative-config",
                         args.speculative_config],
        "llama_server": [args.peer, "-m", gguf, "-t", t, "-c", "4096", "--jinja"],
        "llama_server_ngram": [args.peer, "-m", gguf, "-t", t, "-c", "4096", "--jinja",
                               "--spec-type", "ngram-simple"],
        # llama.cpp's ngram-simple looks up 12 tokens and drafts up to 48 by default; this one
        # looks up 4 and drafts 5, as SPEC does
        "llama_server_ngram_4_5": [args.peer, "-m", gguf, "-t", t, "-c", "4096", "--jinja",
                                   "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n",
                                   "4", "--spec-ngram-simple-size-m", "5"],
    }
    repeats = 1 if args.quick else args.repeats
    res: dict[str, Any] = {"gguf": gguf, "threads": args.threads, "servers": {}}
    for key, cmd in servers.items():
        port = _port()
        cmd = cmd + ["--port", str(port)] + (["--host", "127.0.0.1"] if "pagedkv" in key else [])
        url = f"http://127.0.0.1:{port}"
        proc = _start(cmd, url)
        try:
            import httpx

            model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            rows = {}
            for name in str(args.workloads).split(","):
                msgs = workload(name, 1)[0]
                mt = _max_tokens(args, name, 1)
                _chat(url, msgs, 4, model)  # warm: the prompt is cached by every server alike
                runs = [_chat(url, msgs, mt, model) for _ in range(repeats)]
                dt = statistics.median(r[0] for r in runs)
                rows[name] = {"tok_s": runs[0][1] / dt, "seconds": dt, "tokens": runs[0][1],
                              "text_head": runs[0][2][:80], "text": runs[0][2]}
                _log(f"{key} {name}: {rows[name]['tok_s']:.1f} tok/s")
            res["servers"][key] = rows
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    res["same_text_as_without"] = _same_text(res["servers"])
    return res


def _same_text(servers: dict[str, dict]) -> dict[str, dict[str, bool]]:
    """Per workload: does each speculating server answer what the same server does without?"""
    base = {"pagedkv_spec": "pagedkv", "llama_server_ngram": "llama_server",
            "llama_server_ngram_4_5": "llama_server"}
    out: dict[str, dict[str, bool]] = {}
    for key, ref in base.items():
        if key in servers and ref in servers:
            for name, row in servers[key].items():
                out.setdefault(name, {})[key] = row["text"] == servers[ref][name]["text"]
    return out


def run(args) -> dict:  # noqa: ANN001
    import torch

    from pagedkv.engine.spec_config import SpeculativeConfig
    from pagedkv.model.loader import load_model

    SpeculativeConfig.parse(args.speculative_config)  # a bad config fails before any work
    if args.peer:
        return _peer_runs(args)
    torch.set_num_threads(args.threads)
    loaded = load_model(None, dtype=torch.float32)
    res = _engine_runs(args, loaded)
    return {"model": loaded.name, "threads": torch.get_num_threads(),
            "speculative_config": json.loads(args.speculative_config), "workloads": res,
            "targets": _targets(res)}
