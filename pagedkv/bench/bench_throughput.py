"""`pagedkv bench throughput`: pagedkv against transformers on one chat workload, greedy.

Three workloads, one run, SmolLM2 in float32:
1. 64 chat requests of varied length (pagedkv/bench/data/chat_prompts.json), max_tokens 128:
   pagedkv, transformers static left-padded `generate`, transformers `generate_batch`; how many
   outputs match the unbatched reference (pagedkv one request at a time).
2. 32 requests sharing a ~500-token system prompt: prefix caching on against off.
3. The first workload with a KV cache of a quarter of what it needs: preemptions, throughput,
   and whether the outputs are unchanged.
4. Engine overhead: the 64 chat requests at once (batch 64), ignore_eos, at 128 and 1,024 new
   tokens: output tok/s and the share of step time spent outside the model's forward pass
   (scheduling, step tensors, sampling, detokenizing). Target <= 10%, not growing with length.
   `--overhead-lengths` picks the lengths (the 1,024 run is the longest part of the benchmark).
`--device cuda`: engine tok/s on a GPU at batch 1, 64, 256 instead (bench/cuda_throughput.py).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

DATA = Path(__file__).parent / "data"


def load_prompts(name: str) -> list[list[dict]]:
    return json.loads((DATA / name).read_text())["prompts"]


def _log(msg: str) -> None:
    print(f"[bench throughput] {msg}", file=sys.stderr, flush=True)


def _run_pagedkv(loaded, prompt_ids, max_tokens, **kw) -> tuple[list[list[int]], float, dict]:  # noqa: ANN001
    from pagedkv.engine import LLM, SamplingParams

    llm = LLM(loaded, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(prompt_ids, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    llm.engine.cache.check_invariants()
    st = llm.engine.stats()
    return [o.token_ids for o in outs], dt, {
        "overhead_share": round(st.overhead_share, 4),
        "preemptions": st.num_preemptions,
        "prefix_hit_rate": round(st.prefix_hit_rate, 4),
        "num_blocks": st.num_blocks,
        "blocks_in_use_after": st.blocks_used,
    }


def _figures(outs: list[list[int]], seconds: float, ref: list[list[int]] | None) -> dict:
    n = sum(map(len, outs))
    d = {"seconds": round(seconds, 2), "output_tokens": n, "output_tok_s": round(n / seconds, 1)}
    if ref is not None:
        d["match_reference"] = sum(a == b for a, b in zip(outs, ref, strict=True))
        d["first_divergence"] = [_diverge(a, b) for a, b in zip(outs, ref, strict=True)
                                 if a != b][:16]
    return d


def _diverge(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _overhead(loaded, prompt_ids: list[list[int]], lengths: list[int]) -> dict:  # noqa: ANN001
    """Batch of len(prompt_ids) (all admitted at once), fixed output lengths."""
    from pagedkv.engine import LLM, SamplingParams

    out = {"batch": len(prompt_ids), "target_share": 0.10}
    for n in lengths:
        _log(f"overhead: batch {len(prompt_ids)}, {n} new tokens each")
        llm = LLM(loaded, max_num_seqs=len(prompt_ids))
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompt_ids, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        st = llm.engine.stats()
        toks = sum(len(o.token_ids) for o in outs)
        out[str(n)] = {"seconds": round(dt, 2), "output_tok_s": round(toks / dt, 1),
                       "step_seconds": round(st.step_seconds, 2),
                       "forward_seconds": round(st.forward_seconds, 2),
                       "outside_forward_share": round(st.overhead_share, 4)}
    return out


def run_throughput_bench(quick: bool = False, max_tokens: int = 128,
                         overhead_lengths: tuple[int, ...] = (128, 1024)) -> dict:
    from pagedkv.bench.peers import hf_continuous, hf_static, load_hf
    from pagedkv.model.loader import load_model

    torch.set_num_threads(os.cpu_count() or 1)
    loaded = load_model(None, dtype=torch.float32)
    tok = loaded.tokenizer

    def encode(msgs: list[dict]) -> list[int]:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False).input_ids)

    chats = load_prompts("chat_prompts.json")
    if quick:
        chats = chats[::4]
    prompt_ids = [encode(m) for m in chats]
    eos = set(loaded.config.eos_token_ids or []) | {tok.eos_token_id}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    res: dict = {"model": loaded.name, "dtype": "float32", "threads": torch.get_num_threads(),
                 "requests": len(prompt_ids), "max_tokens": max_tokens,
                 "prompt_tokens": {"total": sum(map(len, prompt_ids)),
                                   "median": statistics.median(map(len, prompt_ids)),
                                   "max": max(map(len, prompt_ids))}}

    _log("reference: pagedkv one request at a time")
    ref, ref_s, _ = _run_pagedkv(loaded, prompt_ids, max_tokens, max_num_seqs=1)
    res["unbatched_reference"] = _figures(ref, ref_s, None)
    _log("pagedkv batched")
    outs, sec, info = _run_pagedkv(loaded, prompt_ids, max_tokens, max_num_seqs=256)
    res["pagedkv"] = _figures(outs, sec, ref) | info

    _log("transformers static generate")
    hf = load_hf("sdpa")
    hs, hs_s = hf_static(hf, prompt_ids, max_tokens, pad, eos)
    res["hf_static"] = _figures(hs, hs_s, ref)
    _log("transformers generate_batch")
    try:
        hc, hc_s = hf_continuous(hf, prompt_ids, max_tokens, pad, eos)
        res["hf_continuous"] = _figures(hc, hc_s, ref) | {"attn_implementation": "sdpa"}
    except Exception as e:  # report, never hide, a peer that cannot run
        res["hf_continuous"] = {"error": f"{type(e).__name__}: {e}"}
    del hf
    p = res["pagedkv"]["output_tok_s"]
    res["vs_hf_static"] = round(p / res["hf_static"]["output_tok_s"], 2)
    if "output_tok_s" in res["hf_continuous"]:
        res["vs_hf_continuous"] = round(p / res["hf_continuous"]["output_tok_s"], 2)
    res["targets"] = {"vs_hf_static": 2.0, "vs_hf_continuous": 3.0, "prefix_cache_speedup": 2.5}

    _log("prefix workload")
    shared = [encode(m) for m in load_prompts("prefix_prompts.json")]
    if quick:
        shared = shared[:8]
    on, on_s, on_info = _run_pagedkv(loaded, shared, max_tokens, max_num_seqs=256)
    off, off_s, _ = _run_pagedkv(loaded, shared, max_tokens, max_num_seqs=256,
                                 enable_prefix_caching=False)
    res["prefix"] = {
        "requests": len(shared),
        "shared_prefix_tokens": _common_prefix(shared),
        "on": _figures(on, on_s, None) | {"prefix_hit_rate": on_info["prefix_hit_rate"]},
        "off": _figures(off, off_s, None),
        "outputs_identical": on == off,
    }
    res["prefix_cache_speedup"] = round(off_s / on_s, 2)

    _log("preemption workload: a quarter of the KV cache the workload needs")
    bs = 16
    need = sum(-(-(len(p) + max_tokens) // bs) for p in prompt_ids)
    small = max(need // 4, max(-(-(len(p) + max_tokens) // bs) for p in prompt_ids))
    pre, pre_s, pre_info = _run_pagedkv(loaded, prompt_ids, max_tokens, max_num_seqs=256,
                                        num_blocks=small)
    res["preemption"] = _figures(pre, pre_s, outs) | {
        "num_blocks": small, "blocks_needed": need, "preemptions": pre_info["preemptions"],
        "outputs_unchanged": pre == outs, "blocks_in_use_after": pre_info["blocks_in_use_after"],
    }
    lengths = [16, 64] if quick else list(overhead_lengths)
    res["overhead"] = _overhead(loaded, prompt_ids, lengths)
    return res


def _common_prefix(seqs: list[list[int]]) -> int:
    first = seqs[0]
    n = len(first)
    for s in seqs[1:]:
        n = min(n, _diverge(first, s))
    return n


def add_args(p) -> None:  # noqa: ANN001
    p.add_argument("--overhead-lengths", default="128,1024",
                   help="new tokens per request for the overhead runs (comma-separated)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: engine tok/s on the GPU at batch 1, 64, 256 instead "
                        "(bench/cuda_throughput.py)")
    p.add_argument("--model", default=None, help="--device cuda: a GGUF file (default SmolLM2)")


def run(args) -> dict:
    if getattr(args, "device", "cpu") == "cuda":
        from pagedkv.bench.cuda_throughput import run_cuda_throughput_bench

        return run_cuda_throughput_bench(model=args.model, quick=args.quick)
    lengths = tuple(int(x) for x in str(args.overhead_lengths).split(",") if x)
    return run_throughput_bench(quick=args.quick, overhead_lengths=lengths)
