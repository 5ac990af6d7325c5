"""`pagedkv bench throughput --device cuda`: engine output tok/s on a GPU at batch 1, 64, 256.

The model (SmolLM2-135M by default, or `--model`: a GGUF dequantized to bfloat16 at load) runs
with `device="cuda"` (the pool, the step's tensors and the triton attention on the GPU; the
scheduler, sampler and detokenizer on the host). Each batch size takes that many chat prompts
(pagedkv/bench/data/chat_prompts.json, repeated past 64), all admitted at once
(max_num_seqs = batch), greedy, ignore_eos, `max_tokens` new tokens each; one warm-up run, then
the median of `repeats` runs. Two engines run side by side, alternated run by run: one with
CUDA graphs of the decode step (the default sizes up to 256) and one with `enforce_eager`.
Reported per engine: output tok/s and the forward pass's share of step time (the rest:
scheduling, step tensors, the logits' copy to the host, sampling, detokenizing), their ratio,
and the share of requests whose greedy tokens are the same on both (bf16: near 1, not exactly).
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

BATCHES = (1, 64, 256)


def _log(msg: str) -> None:
    print(f"[bench throughput cuda] {msg}", file=sys.stderr, flush=True)


def run_cuda_throughput_bench(model: str | None = None, quick: bool = False,
                              max_tokens: int = 128, dtype: str = "bfloat16",
                              repeats: int = 2) -> dict:
    from pagedkv.bench.bench_throughput import load_prompts
    from pagedkv.engine import LLM, SamplingParams
    from pagedkv.errors import DeviceError
    from pagedkv.model.loader import load_model

    if not torch.cuda.is_available():
        raise DeviceError("bench throughput --device cuda: this machine has no CUDA device")
    loaded = load_model(model, dtype=dtype, weights="float32")
    tok = loaded.tokenizer
    chats = load_prompts("chat_prompts.json")

    def encode(msgs: list[dict]) -> list[int]:
        if tok is not None and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            return list(tok(text, add_special_tokens=False).input_ids)
        text = " ".join(m["content"] for m in msgs)  # a file without a chat template
        return list(tok(text, add_special_tokens=False).input_ids)

    prompts = [encode(m) for m in chats]
    if quick:
        max_tokens, repeats = 16, 1
    res: dict = {"device": torch.cuda.get_device_name(), "model": loaded.name, "dtype": dtype,
                 "max_tokens": max_tokens, "repeats": repeats, "batches": {}}
    common = {"device": "cuda", "max_num_seqs": max(BATCHES), "kv_cache_memory": "16GiB",
              "max_num_batched_tokens": 8192}
    engines = {"graphs": LLM(loaded, **common), "eager": LLM(loaded, enforce_eager=True, **common)}
    graphs = engines["graphs"].engine.runner.graphs
    res["cuda_graphs"] = None if graphs is None else {
        "sizes": list(graphs.sizes), "capture_seconds": round(graphs.capture_seconds, 2)}
    from pagedkv.attention.paged import use_triton

    res["attention_backend"] = "triton" if use_triton("auto", torch.device("cuda")) else "torch"
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for b in BATCHES:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        _log(f"batch {b}: {max_tokens} new tokens each, graphs and eager alternated")
        runs: dict[str, list[tuple[float, float, list]]] = {k: [] for k in engines}
        for llm in engines.values():
            llm.generate(batch[: min(b, 8)], warm, use_tqdm=False)
        for _ in range(repeats):
            for name, llm in engines.items():
                runs[name].append(_timed(llm, batch, params))
        row: dict = {"prompt_tokens": sum(map(len, batch))}
        for name, got in runs.items():
            row[name] = {"output_tok_s": round(statistics.median(r for r, _, _ in got), 1),
                         "forward_share": round(statistics.median(f for _, f, _ in got), 3)}
        row["output_tok_s"] = row["graphs"]["output_tok_s"]
        row["graphs_over_eager"] = round(row["graphs"]["output_tok_s"]
                                         / max(row["eager"]["output_tok_s"], 1e-9), 3)
        outs = {name: got[-1][2] for name, got in runs.items()}
        row["same_tokens"] = sum(a == b for a, b in zip(outs["graphs"], outs["eager"],
                                                        strict=True)) / len(batch)
        res["batches"][str(b)] = row
    if graphs is not None:
        res["cuda_graphs"]["replayed_steps"] = graphs.replays
    return res


def _timed(llm, batch: list[list[int]], params) -> tuple[float, float, list]:  # noqa: ANN001
    """(output tok/s, forward share of step time, token ids) of one generate call."""
    before = llm.engine.stats()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    dt = time.perf_counter() - t0
    after = llm.engine.stats()
    step = after.step_seconds - before.step_seconds
    fwd = after.forward_seconds - before.forward_seconds
    return (sum(len(o.token_ids) for o in outs) / dt, fwd / step if step > 0 else 0.0,
            [list(o.token_ids) for o in outs])
