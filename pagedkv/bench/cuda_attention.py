"""`pagedkv bench attention --device cuda`: the triton paged decode kernel on a GPU.

Shapes of a Llama-3-8B layer (Hq 32, Hkv 8, head_dim 128, blocks of 16, bfloat16), block ids
shuffled so each sequence's blocks are scattered over the pool, at (batch, context) points from
one long sequence to many short ones. Each point times, interleaved in one loop with CUDA events:
- `paged`: triton_backend.decode over the block tables (split-K as the engine picks it);
- `sdpa`: torch's scaled_dot_product_attention over the same K/V stored contiguously per
  sequence (q [B, Hq, 1, D], K/V [B, Hkv, L, D] with enable_gqa, and heads pre-expanded; the
  faster is the reference), the ratio paged / sdpa (goal <= 1.1);
- the bytes decode must read (K and V of every position, plus q and the output) over its time,
  as a fraction of the device's copy bandwidth measured here (a 1 GiB device-to-device copy:
  read + write bytes over its time; goal >= 0.7);
- the int8 pool (half the bytes, scales included) at the same points.
"""

from __future__ import annotations

import math
import statistics

import torch
import torch.nn.functional as F

HQ, HKV, D, BS = 32, 8, 128, 16
POINTS = ((1, 16384), (8, 4096), (64, 2048), (256, 1024))
TARGET_RATIO = 1.1
TARGET_BANDWIDTH = 0.7


def _time_ms(fns: dict, repeats: int, inner: int) -> dict[str, float]:
    """Median ms per call of each fn, `inner` calls per timed sample, fns interleaved."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(inner):
                fn()
            b.record()
            b.synchronize()
            times[name].append(a.elapsed_time(b) / inner)
    return {k: statistics.median(v) for k, v in times.items()}


def copy_bandwidth(repeats: int = 20) -> float:
    """Device copy bandwidth in GB/s: (read + write) bytes of a 1 GiB copy over its time."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _time_ms({"copy": lambda: dst.copy_(src)}, repeats, 5)["copy"]
    return 2 * n / (ms * 1e-3) / 1e9


def _point(b: int, ctx: int, kv_dtype: str, repeats: int, gen: torch.Generator) -> dict:
    from pagedkv.attention import triton_backend as tb
    from pagedkv.cache.storage import write_kv

    dev, dt = "cuda", torch.bfloat16
    nb = b * (ctx // BS) + 1
    store = torch.int8 if kv_dtype == "int8" else dt
    kc = torch.empty(nb, BS, HKV, D, dtype=store, device=dev)
    vc = torch.empty_like(kc)
    ks = vs = None
    if kv_dtype == "int8":
        ks = torch.empty(nb, BS, HKV, device=dev)
        vs = torch.empty_like(ks)
    k_all = torch.randn(nb * BS, HKV, D, device=dev, dtype=dt, generator=gen)
    v_all = torch.randn(nb * BS, HKV, D, device=dev, dtype=dt, generator=gen)
    write_kv(kc, vc, torch.arange(nb * BS, device=dev), k_all, v_all, ks, vs)
    del k_all, v_all
    ids = torch.randperm(nb - 1, device=dev, generator=gen) + 1
    tables = ids.view(b, ctx // BS).to(torch.int32)
    lens = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(b, HQ, D, device=dev, dtype=dt, generator=gen)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(D)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = tb.decode_splits(b, HKV, ctx, 2 * sms)
    scratch = tb._scratch(b, HQ, D, splits, q.device)

    def paged() -> None:
        tb.decode(q, kc, vc, tables, lens, scale, out=out, splits=splits, k_scale=ks,
                  v_scale=vs, scratch=scratch)

    # the same K/V (dequantized for int8) stored contiguously per sequence: [B, Hkv, L, D]
    flat = tables.long()
    kf = kc[flat] if ks is None else (kc[flat].float() * ks[flat].unsqueeze(-1)).to(dt)
    vf = vc[flat] if vs is None else (vc[flat].float() * vs[flat].unsqueeze(-1)).to(dt)
    kcont = kf.reshape(b, ctx, HKV, D).transpose(1, 2).contiguous()
    vcont = vf.reshape(b, ctx, HKV, D).transpose(1, 2).contiguous()
    del kf, vf
    q4 = q.view(b, HQ, 1, D)
    fns = {"paged": paged,
           "sdpa_gqa": lambda: F.scaled_dot_product_attention(q4, kcont, vcont, scale=scale,
                                                              enable_gqa=True)}
    if b * ctx <= 64 * 2048:  # the expanded copy: 4x the K/V memory
        krep = kcont.repeat_interleave(HQ // HKV, dim=1)
        vrep = vcont.repeat_interleave(HQ // HKV, dim=1)
        fns["sdpa_expanded"] = lambda: F.scaled_dot_product_attention(q4, krep, vrep, scale=scale)
    paged()
    ref = F.scaled_dot_product_attention(q4.float(), kcont.float(), vcont.float(), scale=scale,
                                         enable_gqa=True).view(b, HQ, D)
    err = float((out.float() - ref).abs().max())
    med = _time_ms(fns, repeats, 10)
    best = min((k for k in med if k != "paged"), key=med.__getitem__)
    kv_bytes = 2 * b * ctx * HKV * (D * kc.element_size() + (4 if ks is not None else 0))
    moved = kv_bytes + 2 * q.numel() * q.element_size() + b * 4 * (ctx // BS)
    return {"batch": b, "context": ctx, "kv_dtype": kv_dtype, "splits": splits,
            "paged_ms": round(med["paged"], 4), "sdpa_ms": round(med[best], 4),
            "sdpa_variant": best, "paged_over_sdpa": round(med["paged"] / med[best], 3),
            "paged_gb_s": round(moved / (med["paged"] * 1e-3) / 1e9, 1),
            "max_abs_err": err}


def run_cuda_attention_bench(quick: bool = False) -> dict:
    if not torch.cuda.is_available():
        from pagedkv.errors import DeviceError

        raise DeviceError("bench attention --device cuda: this machine has no CUDA device")
    import triton

    repeats = 5 if quick else 20
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_bandwidth()
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                 "triton": triton.__version__, "hq": HQ, "hkv": HKV, "head_dim": D,
                 "block_size": BS, "dtype": "bfloat16", "copy_gb_s": round(copy, 1),
                 "points": []}
    with torch.inference_mode():
        for kv in ("bfloat16", "int8"):
            for b, ctx in POINTS[1:3] if quick else POINTS:
                r = _point(b, ctx, kv, repeats, gen)
                r["bandwidth_fraction"] = round(r["paged_gb_s"] / copy, 3)
                res["points"].append(r)
                torch.cuda.empty_cache()
    bf = [r for r in res["points"] if r["kv_dtype"] == "bfloat16"]
    res["paged_over_sdpa"] = max(r["paged_over_sdpa"] for r in bf)
    res["bandwidth_fraction"] = min(r["bandwidth_fraction"] for r in bf)
    res["targets"] = {"paged_over_sdpa": TARGET_RATIO, "bandwidth_fraction": TARGET_BANDWIDTH}
    res["meets_targets"] = (res["paged_over_sdpa"] <= TARGET_RATIO
                            and res["bandwidth_fraction"] >= TARGET_BANDWIDTH)
    return res
