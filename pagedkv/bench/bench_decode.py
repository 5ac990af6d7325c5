"""`pagedkv bench decode`: one user's decode and prefill speed, quantized vs float32 weights.

For each mode (the GGUF's quantized blocks with exact float32 activations, "quantized"; the same
blocks with activations quantized to int8, "quantized_int8", opt-in and approximate; the weights
dequantized to float32, "float32"):
- decode tok/s of one greedy stream (median over repeats), and the weight bandwidth that implies
  (weight bytes read per step x steps per second), next to the machine's measured memory-copy
  bandwidth (torch copy of a 256 MiB buffer, size / time, same threads: each byte is read and
  written, so the memory traffic is twice that): target >= 70%. Also, for reference, the read
  bandwidth (torch sum over a 256 MiB buffer, bytes / time), which is what streaming weights
  needs, and the fraction of it;
- prefill tok/s of one 512-token prompt (also with batch_weights="float32", the opt-in float32
  copy for prefill and big batches, "quantized_batch_f32");
- the breakdown of a batch-1 decode step (torch profiler, self time per op family, and what is
  left for Python, scheduling and sampling);
- resident memory (VmRSS) of `pagedkv serve` with a 256 MiB KV cache, measured in a subprocess.
Also the kernel / tiles / qgemm crossover of the quantized matmul (the rules behind
quant.TILED_ROWS and quant.GEMM_MIN_ROWS),
the exact vs int8-activation kernels alone at 1, 8 and 40 rows (and a whole step's int8 matmuls
by rows, row kernel vs VNNI panel vs tiles: the rules behind quant.PANEL_ROWS and quant.A8_ROWS), and how often greedy decoding with int8 activations picks the
exact mode's tokens (agreement, first divergences).

`--model PATH` benchmarks any GGUF file instead (run_model): its type mix and weight bytes vs
file bytes, load time, and the quantized modes' decode / prefill speed and step breakdown.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import torch


def add_args(p) -> None:  # noqa: ANN001
    p.add_argument("--model", default=None, metavar="PATH",
                   help="any GGUF file: its type mix, weight vs file bytes, load time, decode and "
                        "prefill tok/s (quantized, exact and int8 activations); default: the "
                        "shipped SmolLM2 with every mode and the kernel studies")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-rss", action="store_true", help="skip the serve memory measurement")
    p.add_argument("--agreement-prompts", type=int, default=8,
                   help="chat prompts for the int8-vs-exact greedy agreement (64 tokens each)")


def _log(msg: str) -> None:
    print(f"[bench decode] {msg}", file=sys.stderr, flush=True)


def memcpy_gbs(threads: int, mib: int = 256) -> float:
    """Memory-copy bandwidth, GB/s of data copied (best of 5)."""
    torch.set_num_threads(threads)
    a = torch.ones(mib << 18)
    b = torch.empty_like(a)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def read_gbs(threads: int, mib: int = 256) -> float:
    """Memory read bandwidth, GB/s (a sum over a buffer too big for the caches; best of 5)."""
    torch.set_num_threads(threads)
    a = torch.ones(mib << 18)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        a.sum()
        best = min(best, time.perf_counter() - t)
    return a.numel() * 4 / best / 1e9


def _engine(loaded):  # noqa: ANN001, ANN202
    from pagedkv.engine import LLMEngine

    return LLMEngine(loaded, num_blocks=256, enable_prefix_caching=False, max_num_batched_tokens=4096)


def _decode(engine, ids: list[int], n: int) -> float:  # noqa: ANN001
    """Decode tok/s of one greedy stream (the prefill step excluded)."""
    from pagedkv.engine import SamplingParams

    rid = f"d{time.monotonic_ns()}"
    engine.add_request(rid, ids, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    engine.step()  # prefill + first token
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps / (time.perf_counter() - t0)


def _prefill(engine, n: int) -> float:  # noqa: ANN001
    from pagedkv.engine import SamplingParams

    top = min(40000, engine.loaded.config.vocab_size)
    ids = torch.randint(min(100, top - 1), top, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    engine.add_request(f"p{time.monotonic_ns()}", ids, SamplingParams(temperature=0.0, max_tokens=1))
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return n / (time.perf_counter() - t0)


_FAMILIES = {
    "linear": ("pagedkv_q::qmatmul", "pagedkv_q::qrows", "pagedkv_a8::linear", "pagedkv_a8::matmul",
               "pagedkv_a8::panel",
               "pagedkv_a8::quantize", "mkldnn::_linear_pointwise", "aten::mm",
               "aten::addmm", "aten::linear"),
    "attention": ("pagedkv_attn::paged_decode", "pagedkv_attn::write_decode", "aten::index_put_",
                  "aten::index_copy_"),
    "norm_rope_act": ("pagedkv_ops::add_rms_norm", "pagedkv_ops::norm_add_rms_norm", "pagedkv_ops::rope",
                      "pagedkv_ops::silu_mul", "pagedkv_ops::gelu_tanh_mul", "aten::rms_norm",
                      "aten::_fused_rms_norm", "aten::mul", "aten::addcmul",
                      "aten::flip", "aten::silu", "aten::mul_", "aten::add_", "aten::index_select",
                      "aten::cat", "aten::embedding", "aten::pow", "aten::mean", "aten::rsqrt"),
}


def step_breakdown(engine, ids: list[int], steps: int = 24) -> dict:  # noqa: ANN001
    """Per-step ms of a batch-1 decode by op family (profiler self time); the rest is Python,
    scheduling, tensor building and sampling."""
    from torch.profiler import ProfilerActivity, profile

    from pagedkv.engine import SamplingParams

    engine.add_request("prof", ids, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True))
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        n = 0
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
        wall = time.perf_counter() - t0
    fam = dict.fromkeys([*_FAMILIES, "other_ops"], 0.0)
    for e in prof.key_averages():
        key = next((f for f, names in _FAMILIES.items() if e.key in names), "other_ops")
        fam[key] += e.self_cpu_time_total / 1e3  # ms
    out = {k: round(v / n, 3) for k, v in fam.items()}
    out["step_ms_profiled"] = round(wall * 1e3 / n, 3)
    out["python_scheduling_sampling"] = round(out["step_ms_profiled"] - sum(fam.values()) / n, 3)
    return out


def crossover(threads: int) -> dict:
    """ms of one SmolLM2 gate/up matmul by activation rows (exact), weight in cache: the
    row-streaming kernel, the tiles + BLAS, and qgemm where the CPU has AVX-512 (the rules
    behind quant.TILED_ROWS and quant.GEMM_MIN_ROWS / GEMM_MAX_ROWS)."""
    from pagedkv.model import load_model, qkernel, quant

    torch.set_num_threads(threads)
    q = load_model(weights="quantized").model.layers[0].gate_up_proj.q
    never = 1 << 30
    modes = {"kernel": (never, never), "tiles": (0, never)}  # (TILED_ROWS, GEMM_MIN_ROWS)
    if qkernel.gemm() is not None:
        modes["gemm"] = (0, 0)
    saved, res = (quant.TILED_ROWS, quant.GEMM_MIN_ROWS), {}
    try:
        for rows in (1, 4, 8, 16, 32, 64, 128, 256):
            x = torch.randn(rows, q.k)
            t = {}
            for mode, (tiled, gemm) in modes.items():
                quant.TILED_ROWS, quant.GEMM_MIN_ROWS = tiled, gemm
                q.linear(x)
                t[mode] = round(min(_timed(q.linear, x) for _ in range(7)) * 1e3, 3)
            res[rows] = t
    finally:
        quant.TILED_ROWS, quant.GEMM_MIN_ROWS = saved
    return {"rows": res, "tiled_rows_setting": saved[0], "gemm_rows_setting": [saved[1], quant.GEMM_MAX_ROWS]}


def a8_crossover(threads: int) -> dict:
    """ms of all of SmolLM2's matmuls of one step (30 layers + the LM head, streamed from memory
    as a step sees them) by activation rows, int8 activations: the row kernel (qmatmul_a8.cpp),
    the VNNI panel kernel (where the CPU has it) and the exact path (float32 activations: qgemm
    or the tiles); median of 5. The rules behind quant.PANEL_ROWS and quant.A8_ROWS."""
    from pagedkv.model import load_model, qkernel, quant

    torch.set_num_threads(threads)
    m = load_model(weights="quantized", activations="int8").model
    qs = [lin.q for layer in m.layers
          for lin in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)] + [m.lm_head_q]
    modes = {"rows": (1 << 30, 1 << 30), "exact": (0, 1 << 30)}  # (A8_ROWS, PANEL_ROWS)
    if qkernel.panel() is not None:
        modes["panel"] = (1 << 30, 1)
    saved, res = (quant.A8_ROWS, quant.PANEL_ROWS), {}
    try:
        for rows in (1, 2, 4, 8, 16, 40, 64, 256):
            calls = [(q, torch.randn(rows, q.k), torch.empty(rows, q.n)) for q in qs]
            t = {}
            for mode, (a8_rows, panel_rows) in modes.items():
                if mode == "exact" and rows < 16:
                    continue
                quant.A8_ROWS, quant.PANEL_ROWS = a8_rows, panel_rows
                t[mode] = round(statistics.median(_timed_calls(calls) for _ in range(5)) * 1e3, 2)
            res[rows] = t
    finally:
        quant.A8_ROWS, quant.PANEL_ROWS = saved
    return {"rows": res, "a8_rows_setting": saved[0], "panel_rows_setting": saved[1],
            "panel_available": "panel" in modes}


def _timed_calls(calls: list) -> float:
    t = time.perf_counter()
    for q, x, out in calls:
        q.linear(x, out)
    return time.perf_counter() - t


def _timed(f, x) -> float:  # noqa: ANN001
    t = time.perf_counter()
    f(x)
    return time.perf_counter() - t


def serve_rss_mib(weights: str, threads: int, extra: tuple[str, ...] = ()) -> float | None:
    """VmRSS of `pagedkv serve --kv-cache-memory 256MiB` once it answers /health."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "pagedkv.cli", "serve", "--port", str(port), "--weights", weights,
           "--kv-cache-memory", "256MiB", "--threads", str(threads), "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        else:
            return None
        with open(f"/proc/{proc.pid}/status") as f:
            kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
        return round(kb / 1024, 1)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def kernels(threads: int) -> dict:
    """ms of SmolLM2's matmuls (layer 0 qkv, gate/up, down; the Q8_0 LM head) at 1, 8, 40 rows,
    exact (float32 activations) vs int8 activations (best of 15)."""
    from pagedkv.model import load_model

    torch.set_num_threads(threads)
    m = load_model(weights="quantized").model
    ws = {"qkv": m.layers[0].qkv_proj.q, "gate_up": m.layers[0].gate_up_proj.q,
          "down": m.layers[0].down_proj.q, "lm_head": m.lm_head_q}
    out: dict = {}
    for name, q in ws.items():
        for rows in (1, 8, 40):
            x = torch.randn(rows, q.k)
            t = {}
            for mode in ("float32", "int8"):
                q.set_activations(mode)
                q.linear(x)
                t[mode] = min(_timed(q.linear, x) for _ in range(15)) * 1e3
            q.set_activations("float32")
            out[f"{name}_{rows}"] = {"exact": round(t["float32"], 3), "int8": round(t["int8"], 3),
                                     "speedup": round(t["float32"] / t["int8"], 2)}
    return out


def agreement(prompts: list[list[int]], n: int) -> dict:
    """Greedy tokens of int8 activations vs exact (float32 activations), each prompt alone."""
    from pagedkv.engine import SamplingParams
    from pagedkv.model import load_model

    outs = {}
    for mode in ("float32", "int8"):
        engine = _engine(load_model(weights="quantized", activations=mode))
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        res = []
        for i, ids in enumerate(prompts):
            engine.add_request(f"a{i}", ids, sp)
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        res.append(list(o.outputs[0].token_ids))
        outs[mode] = res
    first = []
    same = total = 0
    for a, b in zip(outs["float32"], outs["int8"], strict=True):
        d = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        first.append(d)
        same += len(a) if d is None else d
        total += len(a)
    return {"prompts": len(prompts), "tokens_each": n,
            "identical_prefix_fraction": round(same / max(total, 1), 3),
            "identical_outputs": sum(d is None for d in first),
            "first_divergence": first}


def _chat_prompts(tok, k: int) -> list[list[int]]:  # noqa: ANN001
    import json

    from pagedkv.bench import DATA

    chats = json.loads((DATA / "chat_prompts.json").read_text())["prompts"][:k]
    return [list(tok(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                     add_special_tokens=False).input_ids) for c in chats]


def _mode(weights: str, args, ids: list[int], gbs_ref: tuple[float, float], activations: str = "float32",  # noqa: ANN001
          batch_weights: str = "quantized") -> dict:
    from pagedkv.model import load_model

    copy_gbs, rd_gbs = gbs_ref
    t0 = time.perf_counter()
    loaded = load_model(getattr(args, "model", None), weights=weights, activations=activations,
                        batch_weights=batch_weights)
    load_s = time.perf_counter() - t0
    engine = _engine(loaded)
    n = 24 if args.quick else args.decode_tokens
    reps = 1 if args.quick else args.repeats
    _decode(engine, ids, 8)  # warm-up (kernel load, allocator)
    dec = statistics.median(_decode(engine, ids, n) for _ in range(reps))
    pre = statistics.median(_prefill(engine, 64 if args.quick else args.prefill_tokens) for _ in range(reps))
    wb = loaded.weight_bytes
    gbs = wb * dec / 1e9
    out = {
        "weight_bytes": wb,
        "load_s": round(load_s, 2),
        "decode_tok_s": round(dec, 1),
        "prefill_tok_s": round(pre, 1),
        "implied_weight_gbs": round(gbs, 2),
        "fraction_of_memcpy": round(gbs / copy_gbs, 3),
        "fraction_of_read": round(gbs / rd_gbs, 3),
        "step_breakdown_ms": step_breakdown(engine, ids, 8 if args.quick else 24),
    }
    _log(f"{weights}/{activations}: {out}")
    return out


def file_facts(path: str) -> dict:
    """What a GGUF file holds: architecture, shapes, and per ggml type its tensors, elements and
    bytes (the "type mix"), file bytes."""
    from collections import Counter

    from pagedkv.model.gguf_file import GGUFFile

    g = GGUFFile(path)
    tensors, elems, nbytes = Counter(), Counter(), Counter()
    for info in g.tensors.values():
        t = info.qtype.name
        tensors[t] += 1
        elems[t] += int(torch.tensor(info.shape).prod()) if info.shape else 1
        nbytes[t] += info.nbytes
    arch = g.metadata.get("general.architecture")
    keys = ("embedding_length", "block_count", "feed_forward_length", "attention.head_count",
            "attention.head_count_kv")
    return {
        "file": os.path.basename(path), "file_bytes": os.path.getsize(path), "architecture": arch,
        "shape": {k: g.metadata.get(f"{arch}.{k}") for k in keys},
        "types": {t: {"tensors": tensors[t], "elements": elems[t], "bytes": nbytes[t]}
                  for t in sorted(nbytes, key=nbytes.get, reverse=True)},
    }


def _model_prompt(tok, vocab: int) -> list[int]:  # noqa: ANN001
    """The chat prompt of the default run through the file's own template, else 40 fixed ids."""
    msgs = [{"role": "user", "content": "Explain how a hash table works."}]
    if tok is not None and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        return list(tok(text, add_special_tokens=False).input_ids)
    return torch.randint(0, vocab, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def run_model(args) -> dict:  # noqa: ANN001
    """`--model PATH`: the file's facts and the quantized modes (exact and int8 activations)."""
    from pagedkv.model import load_model, qkernel

    torch.set_num_threads(args.threads)
    copy_gbs, rd_gbs = memcpy_gbs(args.threads), read_gbs(args.threads)
    res: dict = {"threads": args.threads, "memcpy_gbs": round(copy_gbs, 2), "read_gbs": round(rd_gbs, 2),
                 **file_facts(args.model)}
    probe = load_model(args.model, weights="quantized")
    ids = _model_prompt(probe.tokenizer, probe.config.vocab_size)
    res["config"] = {k: v for k, v in probe.config.to_dict().items() if k != "eos_token_ids"}
    del probe
    for key, act in (("quantized", "float32"), ("quantized_int8", "int8")):
        res[key] = _mode("quantized", args, ids, (copy_gbs, rd_gbs), act)
    res["weight_bytes_vs_file"] = round(res["quantized"]["weight_bytes"] / res["file_bytes"], 3)
    res["kernel"] = qkernel.info()
    res["machine_note"] = f"{os.cpu_count()} cpus; load average {os.getloadavg()[0]:.1f} at the end"
    return res


def run(args) -> dict:  # noqa: ANN001
    from pagedkv.model import load_model, qkernel

    if getattr(args, "model", None):
        return run_model(args)
    torch.set_num_threads(args.threads)
    copy_gbs, rd_gbs = memcpy_gbs(args.threads), read_gbs(args.threads)
    _log(f"memcpy {copy_gbs:.2f} GB/s, read {rd_gbs:.2f} GB/s")
    ref = (copy_gbs, rd_gbs)
    tok = load_model(weights="quantized").tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Explain how a hash table works."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = list(tok(text, add_special_tokens=False).input_ids)
    res: dict = {
        "threads": args.threads,
        "memcpy_gbs": round(copy_gbs, 2),
        "read_gbs": round(rd_gbs, 2),
        "target_fraction_of_memcpy": 0.7,
        "quantized": _mode("quantized", args, ids, ref),
        "quantized_int8": _mode("quantized", args, ids, ref, "int8"),
        "quantized_batch_f32": _mode("quantized", args, ids, ref, batch_weights="float32"),
        "float32": _mode("float32", args, ids, ref),
    }
    q, a, f = res["quantized"], res["quantized_int8"], res["float32"]
    res["decode_speedup"] = round(q["decode_tok_s"] / f["decode_tok_s"], 2)
    res["prefill_ratio"] = round(q["prefill_tok_s"] / f["prefill_tok_s"], 2)
    res["prefill_ratio_batch_f32"] = round(res["quantized_batch_f32"]["prefill_tok_s"] / f["prefill_tok_s"], 2)
    res["int8_decode_speedup_vs_exact"] = round(a["decode_tok_s"] / q["decode_tok_s"], 2)
    res["int8_prefill_ratio_vs_exact"] = round(a["prefill_tok_s"] / q["prefill_tok_s"], 2)
    res["target_met"] = q["fraction_of_memcpy"] >= 0.7
    res["target_met_int8"] = a["fraction_of_memcpy"] >= 0.7
    res["kernel"] = qkernel.info()
    res["crossover_ms"] = crossover(args.threads)
    res["kernel_ms"] = kernels(args.threads)
    res["a8_crossover_ms"] = a8_crossover(args.threads)
    n_prompts, n_tok = (2, 16) if args.quick else (args.agreement_prompts, 64)
    res["int8_greedy_agreement"] = agreement(_chat_prompts(tok, n_prompts), n_tok)
    if not args.no_rss and not args.quick:
        rss = {w: serve_rss_mib(w, args.threads) for w in ("quantized", "float32")}
        rss["quantized_batch_f32"] = serve_rss_mib("quantized", args.threads, ("--batch-weights", "float32"))
        res["serve_rss_mib_256mib_kv"] = rss
    res["machine_note"] = f"{os.cpu_count()} cpus; load average {os.getloadavg()[0]:.1f} at the end"
    return res
