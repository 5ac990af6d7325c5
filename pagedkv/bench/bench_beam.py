"""Beam search KV memory: blocks shared between beams vs a private copy of every beam.

SmolLM2 beam search (`LLM.beam_search`) on the shipped chat prompts, for beam widths 2, 4 and 6,
block_size 16. After every step the live beams' block tables are read: `shared` counts distinct
blocks (what the paged cache holds: beams are forks sharing the prompt and common prefix),
`copied` the sum of every beam's table (each beam keeping its own copy, as a contiguous cache
must). Saving = 1 - sum(shared) / sum(copied) over the run's steps (time-averaged memory), and
at the peak step; bytes = blocks x the model's bytes per block. The vLLM paper (Kwon et al.,
SOSP 2023, fig. 15) reports 37.6-55.2% (Alpaca) and up to 66.3% with shared prefixes for beam
search. Timings are not the point here; the counts do not depend on the machine.

`pagedkv bench beam` prints one JSON object.
"""

from __future__ import annotations

import argparse
import time

VLLM_PAPER = "37-66% (vLLM paper, beam search, beam width 2-6)"
PROMPTS = [
    "Explain how a hash table works.",
    "Write a short poem about a lighthouse.",
    "Give me three tips for learning a new language.",
    "Why is the sky blue?",
    "Describe the water cycle.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?",
]


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--widths", default="2,4,6", help="beam widths, comma separated")
    ap.add_argument("--max-tokens", type=int, default=48, help="tokens per beam")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many prompts")


def run(args: argparse.Namespace) -> dict:
    from pagedkv.engine import LLM, BeamSearchParams

    widths = [int(w) for w in args.widths.split(",")]
    max_tokens, n = args.max_tokens, min(args.prompts, len(PROMPTS))
    if args.quick:
        widths, max_tokens, n = [2, 4], 8, 2
    llm = LLM(num_blocks=2048, block_size=16)
    tok = llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True) for p in PROMPTS[:n]]
    per_block = llm.engine.storage.bytes_per_block
    rows = []
    for k in widths:
        steps = []
        t0 = time.perf_counter()
        outs = llm.beam_search(prompts, BeamSearchParams(k, max_tokens), on_step=steps.append)
        wall = time.perf_counter() - t0
        shared = sum(s.shared_blocks for s in steps)
        copied = sum(s.copied_blocks for s in steps)
        peak = max(steps, key=lambda s: s.copied_blocks)
        rows.append({
            "beam_width": k,
            "steps": len(steps),
            "block_steps_shared": shared,
            "block_steps_copied": copied,
            "saving": round(1 - shared / copied, 4) if copied else 0.0,
            "peak_blocks_shared": peak.shared_blocks,
            "peak_blocks_copied": peak.copied_blocks,
            "peak_bytes_shared": peak.shared_blocks * per_block,
            "peak_bytes_copied": peak.copied_blocks * per_block,
            "peak_saving": round(1 - peak.shared_blocks / peak.copied_blocks, 4),
            "mean_tokens_best_beam": sum(len(o.token_ids) for o in outs) / len(outs),
            "wall_s": round(wall, 2),
        })
    return {
        "benchmark": "beam",
        "model": llm.engine.model_name,
        "prompts": n,
        "prompt_tokens_mean": sum(len(tok(p).input_ids) for p in prompts) / n,
        "max_tokens": max_tokens,
        "block_size": 16,
        "bytes_per_block": per_block,
        "widths": rows,
        "reference": VLLM_PAPER,
    }
