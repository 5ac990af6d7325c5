"""`pagedkv bench throughput --device cuda`: engine output tok/s on a GPU at batch 1, 64, 256.

The model (SmolLM2-135M by default, or `--model`: a GGUF dequantized to bfloat16 at load) runs
with `device="cuda"` (the pool, the step's tensors and the triton attention on the GPU; the
scheduler, sampler and detokenizer on the host). Each batch size takes that many chat prompts
(pagedkv/bench/data/chat_prompts.json, repeated past 64), all admitted at once
(max_num_seqs = batch), greedy, ignore_eos, `max_tokens` new tokens each; one warm-up run, then
the median of `repeats` runs. Reported: output tok/s and the forward pass's share of step time
(the rest: scheduling, step tensors, the logits' copy to the host, sampling, detokenizing).
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
                              repeats: int = 3) -> dict:
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
    llm = LLM(loaded, device="cuda", max_num_seqs=max(BATCHES), kv_cache_memory="16GiB",
              max_num_batched_tokens=8192)
    from pagedkv.attention.paged import use_triton

    res["attention_backend"] = "triton" if use_triton("auto", torch.device("cuda")) else "torch"
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for b in BATCHES:
        batch = [prompts[i % len(prompts)] for i in range(b)]
        _log(f"batch {b}: {max_tokens} new tokens each")
        llm.generate(batch[: min(b, 8)], SamplingParams(temperature=0.0, max_tokens=4,
                                                        ignore_eos=True), use_tqdm=False)
        rates, shares = [], []
        for _ in range(repeats):
            before = llm.engine.stats()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            after = llm.engine.stats()
            rates.append(sum(len(o.token_ids) for o in outs) / dt)
            step = after.step_seconds - before.step_seconds
            fwd = after.forward_seconds - before.forward_seconds
            shares.append(fwd / step if step > 0 else 0.0)
        res["batches"][str(b)] = {"output_tok_s": round(statistics.median(rates), 1),
                                  "forward_share": round(statistics.median(shares), 3),
                                  "prompt_tokens": sum(map(len, batch))}
    return res
