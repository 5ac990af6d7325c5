"""`pagedkv bench structured`: decode throughput with a JSON schema vs unconstrained.

The held-out chats of `data/chat_prompts.json` (the first 40 for 40 clients, the first one for
1 client), SmolLM2,
greedy, in the engine (no HTTP: the figure is the grammar's cost, not the server's). Every
request generates exactly `--max-tokens` tokens either way: unconstrained ones with
`ignore_eos`, constrained ones under a schema whose answer is longer than that (eight notes
and a summary), so they end by length too. Both modes do the same work per request; a run is
timed from the first step to the last, the model loaded once, the modes alternating, medians
over `--repeats`. Also reported: the grammar masks' time per constrained token (computing
them with llguidance plus applying them to the logits, from the sampler's own counters), the
schema's compile time (a fresh compiler, cold; then a cache hit), and the one-off build of
llguidance's tokenizer view, and `validity`: all 64 chats answered under a pydantic model's
schema (bounded fields, up to 128 tokens), each answer validated by that model. Target (issue
26): constrained tok/s >= 0.9x unconstrained at 1 and at 40 clients.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from pagedkv.bench.bench_throughput import load_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "notes": {"type": "array", "items": {"type": "string", "maxLength": 80},
                  "minItems": 8, "maxItems": 8},
        "summary": {"type": "string"},
        "confidence": {"type": "number"},
    },
    "required": ["title", "notes", "summary", "confidence"],
    "additionalProperties": False,
}
TARGET = 0.9


def add_args(ap) -> None:  # noqa: ANN001
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clients", default="1,40", help="comma-separated request counts")


def _log(msg: str) -> None:
    print(f"[bench structured] {msg}", file=sys.stderr, flush=True)


def _one_run(loaded: Any, chats: list, params: Any) -> dict[str, float]:
    from pagedkv.engine import LLMEngine

    eng = LLMEngine(loaded, num_blocks=1024, max_num_seqs=64)
    if params.structured_outputs is not None:
        eng.grammars.compile(params.structured_outputs)  # compiled before timing (as a server does)
    for i, chat in enumerate(chats):
        eng.add_request(f"r{i}", chat, params)
    t0 = time.perf_counter()
    tokens = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                tokens += sum(len(c.token_ids) for c in out.outputs)
    sec = time.perf_counter() - t0
    s = eng.sampler
    return {"tok_s": tokens / sec, "seconds": sec, "tokens": tokens,
            "mask_us_per_token": s.mask_seconds / s.mask_rows * 1e6 if s.mask_rows else 0.0}


def _compile_times(loaded: Any) -> dict[str, float]:
    from pagedkv.engine import StructuredOutputsParams
    from pagedkv.engine.structured import GrammarCompiler, _ll_tokenizer

    tok, vocab = loaded.tokenizer, loaded.config.vocab_size
    eos = sorted(set(loaded.config.eos_token_ids or []) | {tok.eos_token_id})
    t0 = time.perf_counter()
    _ll_tokenizer(tok, vocab, tuple(eos))  # shared by every engine on this tokenizer
    ll_s = time.perf_counter() - t0
    spec = StructuredOutputsParams(json=SCHEMA)
    cold, hit = [], []
    for _ in range(5):
        c = GrammarCompiler(tok, vocab, eos)
        t0 = time.perf_counter()
        c.compile(spec)
        cold.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        c.compile(spec)
        hit.append(time.perf_counter() - t0)
    return {"tokenizer_view_build_ms": ll_s * 1e3,
            "schema_compile_ms": statistics.median(cold) * 1e3,
            "cache_hit_us": statistics.median(hit) * 1e6}


def _validity(loaded: Any, chats: list, max_tokens: int) -> dict[str, Any]:
    """Every chat answered under a pydantic model's schema; how many answers the model accepts."""
    from typing import Literal

    from pydantic import BaseModel, ConfigDict, Field, ValidationError

    from pagedkv.engine import LLM, SamplingParams, StructuredOutputsParams

    class Answer(BaseModel):
        model_config = ConfigDict(extra="forbid")  # additionalProperties: false, as strict mode
        topic: str = Field(max_length=60)
        kind: Literal["question", "request", "chat", "other"]
        words: int = Field(ge=0, le=1000)
        polite: bool

    params = SamplingParams(temperature=0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(json=Answer.model_json_schema()))
    outs = LLM(loaded, num_blocks=1024, max_num_seqs=64).generate(chats, params)
    valid = 0
    for o in outs:
        try:
            Answer.model_validate_json(o.text)
            valid += 1
        except ValidationError:
            pass
    return {"prompts": len(outs), "valid": valid,
            "finished_stop": sum(o.finish_reason == "stop" for o in outs),
            "median_tokens": statistics.median(len(o.token_ids) for o in outs)}


def run(args) -> dict:  # noqa: ANN001
    import torch

    from pagedkv.engine import SamplingParams, StructuredOutputsParams
    from pagedkv.model.loader import load_model

    torch.set_num_threads(2)
    loaded = load_model(None, dtype=torch.float32)
    chats = load_prompts("chat_prompts.json")
    counts = [int(c) for c in str(args.clients).split(",") if c]
    repeats = 1 if args.quick else args.repeats
    max_tokens = 16 if args.quick else args.max_tokens
    modes = {
        "unconstrained": SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        "json_schema": SamplingParams(temperature=0, max_tokens=max_tokens,
                                      structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    }
    res: dict[str, Any] = {"model": loaded.name, "threads": torch.get_num_threads(),
                           "max_tokens": max_tokens, "repeats": repeats,
                           "compile": _compile_times(loaded), "clients": {}}
    for n in counts:
        batch = (chats * (n // len(chats) + 1))[:n]
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(repeats):
            for mode, params in modes.items():
                runs[mode].append(_one_run(loaded, batch, params))
                _log(f"{n} clients, {mode}, repeat {r + 1}: {runs[mode][-1]['tok_s']:.1f} tok/s")
        med = {m: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for m, rs in runs.items()}
        ratio = med["json_schema"]["tok_s"] / med["unconstrained"]["tok_s"]
        res["clients"][str(n)] = {**med, "ratio": ratio,
                                  "ratios": [j["tok_s"] / u["tok_s"] for j, u in
                                             zip(runs["json_schema"], runs["unconstrained"],
                                                 strict=True)]}
    res["validity"] = _validity(loaded, chats[:8] if args.quick else chats, 128)
    ratios = [v["ratio"] for v in res["clients"].values()]
    res["target"] = {"min_ratio": TARGET, "met": all(r >= TARGET for r in ratios)}
    return res
