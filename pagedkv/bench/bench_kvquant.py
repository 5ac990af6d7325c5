"""`pagedkv bench kvquant`: quantized KV cache (int8, fp8_e4m3) against float32, SmolLM2.

One JSON object with:
- capacity: bytes per token and tokens per GiB of each kv_cache_dtype, ratio to float32
  (target int8 >= 3.5x).
- decode_attention: the decode attention of one layer (SmolLM2 shape: 9 query heads, 3 kv heads
  of 64), batch 32, contexts 512 and 2048, per dtype, ms median over interleaved repeats, and
  the ratio to float32 (target int8 no slower).
- fidelity: per-layer decode attention error on real activations of the shipped text
  (quantized cache vs float32 cache), for the shipped per-(token, head) scales and, as the
  granularity study, one scale per 32 or 16 head_dim values; perplexity of the shipped
  public-domain text with the cache filled in chunks (target int8 within 0.5% of float32);
  greedy agreement of the chat prompts against float32 KV (reported, not a target).
- end_to_end: requests whose KV does not fit a float32 cache of a fixed size (default 256 MiB,
  64 requests x 256 prompt + 128 output tokens), float32 and int8 in the same memory:
  preemptions, recomputed tokens, decode batch over time, output tok/s, and whether the
  model-free scheduler replay (replay.py) made the same decisions.
- end_to_end_prefill_heavy: the first workload (128 MiB, 48 x 320 + 48: 15k prompt tokens, 2.3k
  out), replayed without the model (timed too with --time-prefill-heavy): its preemptions are
  equal for both dtypes, see benchmarks/results/NOTES.md.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from pagedkv.bench import DATA
from pagedkv.cache.quant import QUANT_DTYPES, resolve_kv_cache_dtype
from pagedkv.cache.storage import bytes_per_block, num_blocks_for_budget

FLOATS = ["float32", "bfloat16", "float16"]
QUANTS = list(QUANT_DTYPES)


def _log(msg: str) -> None:
    print(f"[bench kvquant] {msg}", file=sys.stderr, flush=True)


def add_args(p) -> None:  # noqa: ANN001
    p.add_argument("--e2e-memory", default="256MiB", help="KV budget of the end-to-end run")
    p.add_argument("--e2e-requests", type=int, default=64)
    p.add_argument("--e2e-prompt-tokens", type=int, default=256)
    p.add_argument("--e2e-max-tokens", type=int, default=128)
    p.add_argument("--time-prefill-heavy", action="store_true",
                   help="also time the prefill-heavy workload (128MiB, 48 x 320 + 48), which "
                        "the default run only replays without the model")
    p.add_argument("--parts", default="capacity,attention,fidelity,e2e",
                   help="comma-separated subset of capacity,attention,fidelity,e2e")
    p.add_argument("--chat-prompts", type=int, default=32, help="greedy agreement set size")
    p.add_argument("--chat-max-tokens", type=int, default=64)


def capacity(cfg) -> dict:  # noqa: ANN001
    per = {d: bytes_per_block(cfg.num_layers, 16, cfg.num_kv_heads, cfg.head_dim, d) / 16
           for d in FLOATS + QUANTS}
    return {d: {"bytes_per_token": per[d], "tokens_per_gib": int(2**30 // per[d]),
                "ratio_to_float32": round(per["float32"] / per[d], 3)} for d in per}


def decode_attention(cfg, repeats: int, batch: int = 32, contexts=(512, 2048)) -> dict:  # noqa: ANN001
    from pagedkv.attention.paged import decode_backend, paged_decode_attention
    from pagedkv.cache.storage import KVStorage

    hq, hkv, d, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, 16
    g = torch.Generator().manual_seed(0)
    res: dict = {"backend": decode_backend("cpu"), "batch": batch, "heads": [hq, hkv, d]}
    for ctx in contexts:
        nb = batch * ctx // bs
        tables = torch.randperm(nb, generator=g).view(batch, -1).to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32)
        q = torch.randn(batch, hq, d, generator=g)
        k = torch.randn(nb * bs, hkv, d, generator=g)
        stores = {}
        for name in ["float32", "bfloat16", *QUANTS]:
            st = KVStorage(1, nb, bs, hkv, d, name)
            st.write(0, torch.arange(nb * bs), k.to(st.dtype) if not st.quantized else k,
                     (k.to(st.dtype) if not st.quantized else k) * 0.5)
            stores[name] = st.layers[0]
        out = torch.empty_like(q)
        times: dict[str, list[float]] = {n: [] for n in stores}
        for _ in range(repeats):  # interleaved: machine noise hits every dtype alike
            for name, c in stores.items():
                t0 = time.perf_counter()
                paged_decode_attention(q, c.k, c.v, tables, lens, d**-0.5, out=out,
                                       k_scale=c.k_scale, v_scale=c.v_scale)
                times[name].append(time.perf_counter() - t0)
        med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        res[f"ctx_{ctx}"] = {n: {"ms": round(m, 3), "ratio_to_float32": round(m / med["float32"], 3)}
                             for n, m in med.items()}
        del stores
    return res


def fidelity(loaded, quick: bool, chat_prompts: int, chat_max_tokens: int) -> dict:  # noqa: ANN001
    from pagedkv.bench import kvquant_eval as ev

    model, tok = loaded.model, loaded.tokenizer
    ids = ev.text_token_ids(tok, 512 if quick else None)
    res: dict = {"text_tokens": len(ids)}

    _log("per-layer attention error on real activations")
    layers = ev.capture_qkv(model, ids[:512])
    study: dict = {}
    for name in QUANTS:
        dt = QUANT_DTYPES[name]
        for label, group in (("per_token_head", None), ("group_32", 32), ("group_16", 16)):
            errs = ev.attention_errors(layers, dt, num_queries=64, group=group)
            study.setdefault(name, {})[label] = {
                "bytes_per_token_head": cfg_bytes(loaded.config.head_dim, group),
                "max_abs": round(max(e["max_abs"] for e in errs), 5),
                "mean_abs": round(statistics.mean(e["mean_abs"] for e in errs), 6),
            }
            if group is None:
                study[name]["mean_abs_attention_output"] = round(
                    statistics.mean(e["mean_abs_output"] for e in errs), 5)
                study[name]["per_layer"] = [
                    {"max_abs": round(e["max_abs"], 5), "mean_abs": round(e["mean_abs"], 6)}
                    for e in errs
                ]
    res["attention_error"] = study
    del layers

    _log(f"perplexity of {len(ids)} tokens, cache filled in chunks of 256")
    ppl = {}
    for name in ["float32", *QUANTS]:
        ppl[name] = ev.perplexity(model, ids, resolve_kv_cache_dtype(name), chunk=256)
    res["perplexity"] = {n: {"ppl": round(p, 4), "rel_to_float32": round(p / ppl["float32"] - 1, 5)}
                         for n, p in ppl.items()}

    _log("greedy agreement on the chat prompts")
    chats = json.loads((DATA / "chat_prompts.json").read_text())["prompts"][:chat_prompts]
    prompts = [list(tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                        add_special_tokens=False).input_ids) for m in chats]
    outs = {n: _generate(loaded, prompts, chat_max_tokens, n) for n in ["float32", *QUANTS]}
    agree = {}
    for n in QUANTS:
        pairs = list(zip(outs[n], outs["float32"], strict=True))
        div = [_diverge(a, b) for a, b in pairs if a != b]
        agree[n] = {"identical": sum(a == b for a, b in pairs), "of": len(pairs),
                    "fraction": round(sum(a == b for a, b in pairs) / len(pairs), 3),
                    "mean_first_divergence": round(statistics.mean(div), 1) if div else None}
    res["greedy_agreement"] = {"max_tokens": chat_max_tokens, **agree}
    return res


def cfg_bytes(head_dim: int, group: int | None) -> int:
    """Bytes one (token, kv head) takes in a 1-byte dtype with float32 scales."""
    return head_dim + 4 * (1 if group is None else head_dim // group)


def _diverge(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _generate(loaded, prompts, max_tokens, kv, **kw) -> list[list[int]]:  # noqa: ANN001
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(loaded, kv_cache_dtype=kv, **kw)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens),
                        use_tqdm=False)
    return [o.token_ids for o in outs]


def _workload(loaded, memory: str, n: int, plen: int, out: int) -> tuple[dict, list[list[int]]]:  # noqa: ANN001
    """n distinct windows of plen tokens of the shipped text, each to produce exactly `out`."""
    from pagedkv.bench.kvquant_eval import text_token_ids

    ids = text_token_ids(loaded.tokenizer)
    step = max(1, (len(ids) - plen) // n)
    prompts = [ids[i * step : i * step + plen] for i in range(n)]
    spec = {"kv_cache_memory": memory, "requests": n, "prompt_tokens": plen, "max_tokens": out,
            "kv_tokens_needed": n * (plen + out)}
    return spec, prompts


def end_to_end(loaded, memory: str, n: int, plen: int, out: int, timed: bool = True) -> dict:  # noqa: ANN001
    """float32 and int8 KV in the same `memory`: preemptions, recomputed tokens, decode batch
    over time, output tok/s. The model-free replay of the same workload (`replay.py`) must make
    the same decisions (`replay_agrees`); `timed=False` reports the replay alone."""
    from pagedkv.bench.replay import StepTrace, replay
    from pagedkv.cache.sizing import parse_size
    from pagedkv.engine import LLM, SamplingParams
    from pagedkv.engine.config import EngineConfig

    cfg = loaded.config
    res, prompts = _workload(loaded, memory, n, plen, out)
    params = SamplingParams(temperature=0.0, max_tokens=out, ignore_eos=True)
    outs = {}
    for kv in ["float32", "int8"]:
        bs = EngineConfig.block_size  # the engine's, as the LLM below
        blocks = num_blocks_for_budget(parse_size(memory), cfg.num_layers, bs, cfg.num_kv_heads,
                                       cfg.head_dim, kv)
        rep = replay(blocks, [len(p) for p in prompts], out, max_num_seqs=n)
        row = {"kv_tokens_capacity": blocks * bs}
        if not timed:
            res[kv] = {**row, **rep}
            continue
        _log(f"end to end, {kv} KV in {memory}: {n} x {plen} prompt + {out} output tokens")
        llm = LLM(loaded, kv_cache_dtype=kv, kv_cache_memory=memory,
                  enable_prefix_caching=False, max_num_seqs=n)
        trace = StepTrace()
        trace.attach(llm.engine.scheduler)
        t0 = time.perf_counter()
        o = llm.generate(prompts, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        outs[kv] = [x.token_ids for x in o]
        tokens = sum(map(len, outs[kv]))
        got = {"preemptions": llm.engine.stats().num_preemptions,
               **trace.summary(sum(map(len, prompts)))}
        res[kv] = {**row, "memory_bytes": llm.engine.storage.memory_bytes, **got,
                   "seconds": round(dt, 2), "output_tok_s": round(tokens / dt, 1),
                   "replay_agrees": got == rep}
        del llm
    if timed:
        res["int8_speedup"] = round(res["int8"]["output_tok_s"] / res["float32"]["output_tok_s"], 3)
        res["identical_outputs"] = sum(
            a == b for a, b in zip(outs["int8"], outs["float32"], strict=True))
    return res


PREFILL_HEAVY = ("128MiB", 48, 320, 48)  # the first end-to-end workload: 15k prompt, 2.3k out


def run(args) -> dict:
    from pagedkv.attention.kernel import kernel_info
    from pagedkv.model.loader import load_model

    t0 = time.perf_counter()
    parts = set(args.parts.split(","))
    loaded = load_model(None, dtype=torch.float32)
    cfg = loaded.config
    res: dict = {"model": loaded.name, "threads": torch.get_num_threads(), "quick": args.quick,
                 "scale_granularity": "one float32 scale per (token, kv head)"}
    if "capacity" in parts:
        res["capacity"] = capacity(cfg)
    if "attention" in parts:
        _log("decode attention timing")
        res["decode_attention"] = decode_attention(cfg, repeats=3 if args.quick else 15)
        res["decode_attention"]["kernel"] = {
            k: v for k, v in kernel_info().items() if v is not None}
    if args.quick:
        args.e2e_requests, args.e2e_prompt_tokens, args.e2e_max_tokens = 8, 128, 16
        args.e2e_memory = "8MiB"
        args.chat_prompts, args.chat_max_tokens = 4, 16
    if "fidelity" in parts:
        res["fidelity"] = fidelity(loaded, args.quick, args.chat_prompts, args.chat_max_tokens)
    if "e2e" in parts:
        res["end_to_end"] = end_to_end(loaded, args.e2e_memory, args.e2e_requests,
                                       args.e2e_prompt_tokens, args.e2e_max_tokens)
        res["end_to_end_prefill_heavy"] = end_to_end(loaded, *PREFILL_HEAVY,
                                                     timed=args.time_prefill_heavy)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    return res
