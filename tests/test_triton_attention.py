"""The triton attention kernels against the torch path, and the device / backend options.

On the CPU the kernels run under triton's interpreter (exact IEEE float32 arithmetic, slow: the
shapes are small); on a machine with CUDA every kernel case runs on the GPU too
(benchmarks/gpu_check.sh). Cases cover GQA / MQA, head sizes that are not a power of two, block
sizes below the kernels' 16-position tile (a tile spans blocks), partial last blocks, table
entries never to be read (-1 holes before a window, garbage past the length), sliding windows,
split-K decode and the int8 / fp8 KV formats with their scales.
"""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.attention import AttentionMetadata, paged_attention
from pagedkv.attention import triton_backend as tb
from pagedkv.attention.paged import _decode_torch, paged_prefill_attention
from pagedkv.cache import KVStorage
from pagedkv.cache.storage import write_kv
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import DeviceError

pytestmark = pytest.mark.skipif(not tb.available(), reason="triton is not installed")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
FP8 = torch.float8_e4m3fn
QUANT = (torch.int8, FP8)
ROOT = Path(__file__).resolve().parents[1]


def _cache(n: int, bs: int, h: int, d: int, dtype: torch.dtype, device: str, seed: int = 0):
    """k/v caches [n, bs, h, d] filled with random K/V written by the torch path (+ scales)."""
    g = torch.Generator().manual_seed(seed)
    kc = torch.zeros(n, bs, h, d, dtype=dtype, device=device)
    vc = torch.zeros_like(kc)
    ks = vs = None
    if dtype in QUANT:
        ks = torch.zeros(n, bs, h, device=device)
        vs = torch.zeros_like(ks)
    src = torch.float32 if dtype in QUANT else dtype
    k = torch.randn(n * bs, h, d, generator=g).to(device=device, dtype=src)
    v = torch.randn(n * bs, h, d, generator=g).to(device=device, dtype=src)
    write_kv(kc, vc, torch.arange(n * bs, device=device), k, v, ks, vs)
    return kc, vc, ks, vs


def _poisoned(kc, vc, ks, vs) -> int:
    """Fill the last block with NaN (K, V, and the scales of a quantized pool): a kernel that
    reads it returns NaN. Table entries that must never be read point there."""
    nan = float("nan")
    for t in (kc, vc) if ks is None else (ks, vs):
        t[-1] = nan
    return kc.shape[0] - 1


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _tol(dtype: torch.dtype) -> float:
    return {torch.float16: 2e-3, torch.bfloat16: 2e-2}.get(dtype, 2e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int8, FP8],
                         ids=["f32", "f16", "bf16", "int8", "fp8"])
def test_write_kv_equals_torch_write(dtype: torch.dtype, device: str) -> None:
    """One launch writes what storage.write_kv writes: float caches bit for bit; quantized
    the same scales and, but for a rare q one step away (torch divides QMAX / amax by a
    reciprocal in its vector loop and exactly in its scalar tail), the same q; -1 slots are
    skipped and nothing else is touched."""
    n, bs, h, d = 6, 8, 3, 40
    g = torch.Generator().manual_seed(1)
    src = torch.bfloat16 if dtype in QUANT else dtype
    t = 37
    k = (torch.randn(t, h, d, generator=g) * 3).to(device=device, dtype=src)
    v = torch.randn(t, h, d, generator=g).to(device=device, dtype=src)
    k[5] = 0  # an all-zero row: scale 0, reads back as zeros
    slots = torch.randperm(n * bs, generator=g)[:t].to(device)
    slots[[2, 11, 30]] = -1
    ours = _cache(n, bs, h, d, dtype, device, seed=2)
    ref = tuple(None if x is None else x.clone() for x in ours)
    tb.write_kv(ours[0], ours[1], slots, k, v, ours[2], ours[3])
    write_kv(ref[0], ref[1], slots, k, v, ref[2], ref[3])
    for a, b in zip(ours[2:], ref[2:], strict=True):
        assert a is None or torch.equal(a, b)
    for a, b, scale in ((ours[0], ref[0], ref[2]), (ours[1], ref[1], ref[3])):
        if scale is None:
            assert torch.equal(a, b)
            continue
        same = _bits(a) == _bits(b)
        assert same.float().mean() > 0.995
        step = scale.unsqueeze(-1) * (1.0 if dtype == torch.int8 else 32.0)  # fp8: 1/8 of a binade
        assert bool(((a.float() - b.float()).abs() * scale.unsqueeze(-1) <= step + 1e-12).all())


DECODE_CASES = {
    # name: (dtype, Hq, Hkv, D, block size, window, splits)
    "f32-gqa4-split3": (torch.float32, 8, 2, 64, 16, 0, 3),
    "f16-mqa-bs4": (torch.float16, 4, 1, 32, 4, 0, 1),
    "bf16-mha-d80-window": (torch.bfloat16, 2, 2, 80, 8, 21, 2),
    "int8-gqa7-window": (torch.int8, 14, 2, 64, 16, 37, 4),
    "fp8-gqa3-split5": (FP8, 6, 2, 48, 8, 0, 5),
    # the tiles a GPU launch uses (64 positions a tile), run here too
    "f16-gqa4-window-gputiles": (torch.float16, 8, 2, 128, 16, 50, 2),
    "int8-mqa32-gputiles": (torch.int8, 32, 1, 64, 16, 0, 3),
    # Gemma 2's soft-capped scores (here capped at 0.5, where they matter), split and windowed
    "f32-gqa4-split3-softcap": (torch.float32, 8, 2, 64, 16, 0, 3),
    "int8-gqa7-window-softcap": (torch.int8, 14, 2, 64, 16, 37, 4),
}


def _tiles(case: str, d: int):
    return tb.tiles_for(torch.device("cuda"), d) if case.endswith("gputiles") else None


def _softcap(case: str) -> float:
    return 0.5 if case.endswith("softcap") else 0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_decode_equals_torch(case: str, device: str) -> None:
    dtype, hq, hkv, d, bs, window, splits = DECODE_CASES[case]
    n = 24
    kc, vc, ks, vs = _cache(n, bs, hkv, d, dtype, device)
    poison = _poisoned(kc, vc, ks, vs)
    lens = torch.tensor([1, bs, 3 * bs + 5, 70, 2 * bs - 1], dtype=torch.int32)  # partial tails
    b, width = lens.numel(), -(-int(lens.max()) // bs) + 2
    g = torch.Generator().manual_seed(3)
    tables = torch.randint(0, poison, (b, width), generator=g, dtype=torch.int32)
    # never read: entries past the length, and with a window those of blocks wholly before it
    # (holes); the kernel gets them as the NaN block, the torch reference as block 0
    unread = torch.arange(width).unsqueeze(0) >= (lens.unsqueeze(1) + bs - 1) // bs
    if window:
        unread |= torch.arange(width).unsqueeze(0) < ((lens - window).clamp_min(0) // bs).unsqueeze(1)
    qdt = torch.float32 if dtype in QUANT else dtype
    q = torch.randn(b, hq, d, generator=g).to(device=device, dtype=qdt)
    lens = lens.to(device)
    out = torch.full_like(q, float("nan"))
    tb.decode(q, kc, vc, tables.masked_fill(unread, poison).to(device), lens, d**-0.5, out=out,
              splits=splits, k_scale=ks, v_scale=vs, window=window, softcap=_softcap(case),
              tiles=_tiles(case, d))
    ref = _decode_torch(q, kc, vc, tables.masked_fill(unread, 0).to(device), lens, d**-0.5, None,
                        ks, vs, window, _softcap(case))
    torch.testing.assert_close(out.float(), ref.float(), atol=_tol(qdt), rtol=_tol(qdt))


PREFILL_CASES = {
    # name: (dtype, Hq, Hkv, D, block size, window, [(new tokens, cached context)])
    "f32-gqa-prefix-hits": (torch.float32, 6, 2, 32, 16, 0, [(20, 33), (7, 0), (1, 16)]),
    "f16-mqa-chunks-bs4": (torch.float16, 4, 1, 64, 4, 0, [(17, 10), (5, 3)]),
    "bf16-window-band": (torch.bfloat16, 2, 2, 40, 8, 10, [(30, 0), (9, 41)]),
    "int8-gqa-window": (torch.int8, 4, 2, 32, 8, 12, [(18, 27), (3, 0)]),
    "fp8-gqa-context": (FP8, 4, 2, 32, 16, 0, [(12, 40)]),
    "bf16-window-gputiles": (torch.bfloat16, 4, 2, 64, 16, 40, [(70, 30), (5, 90)]),
    # GQA grouping: 7 heads a kv head (rows = 2 tokens x 8, one padded), 16-head MQA (one
    # token x 16 a program on the CPU), with windows, holes and partial blocks
    "f32-gqa7-window-holes": (torch.float32, 14, 2, 32, 8, 9, [(11, 21), (4, 0), (6, 13)]),
    "f16-mqa16-prefix": (torch.float16, 16, 1, 32, 4, 0, [(5, 9), (3, 2)]),
    "int8-gqa7-gputiles": (torch.int8, 7, 1, 64, 16, 0, [(37, 20)]),
    "f32-gqa7-window-holes-softcap": (torch.float32, 14, 2, 32, 8, 9, [(11, 21), (4, 0), (6, 13)]),
    "bf16-prefix-softcap": (torch.bfloat16, 4, 2, 64, 16, 0, [(30, 17), (5, 0)]),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_equals_torch(case: str, device: str) -> None:
    """Causal attention over the cached prefix (through the table, dequantized in registers)
    and the chunk's own K/V at full precision, with the window's band."""
    dtype, hq, hkv, d, bs, window, seqs = PREFILL_CASES[case]
    n = 24
    kc, vc, ks, vs = _cache(n, bs, hkv, d, dtype, device)
    poison = _poisoned(kc, vc, ks, vs)
    qlens, ctxs = [s[0] for s in seqs], [s[1] for s in seqs]
    g = torch.Generator().manual_seed(4)
    width = max(-(-c // bs) for c in ctxs) + 1
    tables = torch.randint(0, poison, (len(seqs), width), generator=g, dtype=torch.int32)
    unread = torch.zeros_like(tables, dtype=torch.bool)  # past the context; before the band
    for i, c in enumerate(ctxs):
        unread[i, -(-c // bs):] = True
        if window:
            unread[i, : max(0, c - window + 1) // bs] = True
    clean = tables.masked_fill(unread, 0).to(device)
    tables = tables.masked_fill(unread, poison)
    p = sum(qlens)
    qdt = torch.float32 if dtype in QUANT else dtype
    q, k, v = (torch.randn(p, h, d, generator=g).to(device=device, dtype=qdt)
               for h in (hq, hkv, hkv))
    tables = tables.to(device)
    i32 = {"dtype": torch.int32, "device": device}
    starts = torch.tensor([sum(qlens[:i]) for i in range(len(qlens))], **i32)
    out = torch.full_like(q, float("nan"))
    tb.prefill(q, k, v, kc, vc, tables, starts, torch.tensor(qlens, **i32),
               torch.tensor(ctxs, **i32), max(qlens), d**-0.5, out=out, k_scale=ks, v_scale=vs,
               window=window, softcap=_softcap(case), tiles=_tiles(case, d))
    ref = paged_prefill_attention(q, k, v, kc, vc, qlens, ctxs, clean, d**-0.5,
                                  k_scale=ks, v_scale=vs, window=window, softcap=_softcap(case))
    torch.testing.assert_close(out.float(), ref.float(), atol=_tol(qdt), rtol=_tol(qdt))


def _sm90_compile(kern, types: dict[str, str], consts: dict[str, object]) -> None:
    """Compile a kernel for sm_90 (H100/H200) the way a launch would: triton's frontend,
    TTIR/TTGIR, LLVM, PTX and the ptxas its wheel ships. Needs no GPU."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(inspect.signature(kern.fn).parameters)
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    src = ASTSource(kern.gpu, sig, constexprs={(names.index(k),): v for k, v in consts.items()})
    assert triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


def _ptxas() -> bool:
    return bool(list(Path(importlib.util.find_spec("triton").origin).parent.glob(
        "backends/nvidia/bin/ptxas")))


@pytest.mark.skipif(not _ptxas(), reason="triton's wheel without ptxas")
def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """The compiled path (not the interpreter's) accepts the kernels: bf16 prefill with G = 3
    (the shared online-softmax device function inlined), split-K decode over int8 KV, the
    quantizing fp8 write. The whole matrix of dtypes and GQA groups compiled the same way
    when this was written; a GPU adds only running them (benchmarks/gpu_check.sh).
    In a fresh process: the interpreter the other tests run patches triton.language while a
    kernel runs, and in the full suite the frontend once met such a leftover
    ('block_argument' object has no attribute 'get_element_ty')."""
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
            "import test_triton_attention as t; t._compile_for_sm90()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def _compile_for_sm90() -> None:
    k = tb._k()
    ptr = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16",
           "scale": "fp32", "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "slot_ptr": "*i64"}
    i32 = {n: "*i32" for n in ("table_ptr", "q_start_ptr", "q_len_ptr", "ctx_ptr", "lens_ptr")}
    bf16 = {n: "*bf16" for n in ("kc_ptr", "vc_ptr", "ks_ptr", "vs_ptr")}
    _sm90_compile(k.prefill_kernel, {**ptr, **i32, **bf16},
                  {"BS": 16, "HKV": 2, "QUANT": False, "F32_DOT": False, "BLOCK_M": 16,
                   "BLOCK_G": 4, "BLOCK_N": 32, "BLOCK_D": 64})
    int8 = {"kc_ptr": "*i8", "vc_ptr": "*i8", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    _sm90_compile(k.decode_kernel, {**ptr, **i32, **int8},
                  {"BS": 16, "HKV": 2, "ONE_SPLIT": False, "QUANT": True, "F32_DOT": True,
                   "BLOCK_G": 16, "BLOCK_N": 64, "BLOCK_D": 64})
    fp8 = {"kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
    _sm90_compile(k.write_kv_kernel, {**ptr, **fp8},
                  {"QUANT": True, "IS_INT8": False, "QMAX": 448.0, "BLOCK_T": 16, "BLOCK_D": 64})


@pytest.mark.parametrize("kv_dtype", ["float32", "int8"])
def test_paged_attention_step_triton_equals_torch(kv_dtype: str) -> None:
    """A whole mixed step through paged_attention (write, then a prefill with a prefix and two
    decodes) gives the same output and the same cache with meta.backend "triton" as "torch"."""
    hq, hkv, d, bs = 4, 2, 32, 8
    stores = [KVStorage(1, 12, bs, hkv, d, kv_dtype) for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    old = [torch.randn(12 * bs, hkv, d, generator=g) for _ in range(2)]
    for s in stores:  # the same earlier context in both
        s.write(0, torch.arange(12 * bs), *old)
    # prefill: 5 new tokens at positions 11..15 after 11 cached (blocks 3, 4); decodes of
    # lengths 9 (blocks 6, 7) and 20 (blocks 8, 9, 10), each writing its last position
    slots = torch.tensor([4 * bs + 3, 4 * bs + 4, 4 * bs + 5, 4 * bs + 6, 4 * bs + 7,
                          7 * bs, 10 * bs + 3])
    t = slots.numel()
    q, k, v = (torch.randn(t, h, d, generator=g) for h in (hq, hkv, hkv))
    outs = []
    for backend, s in zip(("torch", "triton"), stores, strict=True):
        meta = AttentionMetadata(
            slot_mapping=slots, prefill_query_lens=[5], prefill_context_lens=[11],
            prefill_block_tables=torch.tensor([[3, 4]], dtype=torch.int32),
            decode_block_tables=torch.tensor([[6, 7, 0], [8, 9, 10]], dtype=torch.int32),
            decode_seq_lens=torch.tensor([9, 20], dtype=torch.int32), max_decode_seq_len=20,
            backend=backend)
        outs.append(paged_attention(q, k, v, s.layer(0), meta, d**-0.5))
        assert (meta.plan.triton is not None) == (backend == "triton")
    torch.testing.assert_close(outs[1], outs[0], atol=2e-5, rtol=2e-5)
    assert torch.equal(_bits(stores[0].kv), _bits(stores[1].kv))
    if stores[0].scales is not None:
        assert torch.equal(stores[0].scales, stores[1].scales)


# --- the engine: the device path's code end to end on a tiny model -------------------------


# small head counts: the interpreter's time goes by programs, one per (tile, query head)
TINY = {
    "qwen2": dict(arch="qwen2", name="Qwen2 small", hidden=256, heads=4, kv_heads=2, head_dim=64,
                  intermediate=512, bias=True, seed=11),
    "gemma3": dict(arch="gemma3", name="Gemma 3 small", hidden=256, heads=4, kv_heads=1,
                   head_dim=64, intermediate=512, qk_norm=True, window=16, seed=12),
}


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_gguf import TinySpec, write_tiny_gguf

    folder = tmp_path_factory.mktemp("triton")
    return {k: write_tiny_gguf(TinySpec(**v), folder / f"{k}.gguf") for k, v in TINY.items()}


@pytest.fixture(scope="module")
def tiny_qwen2(tiny_models: dict[str, Path]) -> Path:
    return tiny_models["qwen2"]


def _greedy(llm, prompts: list[list[int]], n: int = 4) -> list[list[int]]:
    from pagedkv import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    return [list(o.token_ids) for o in outs]


PROMPTS = [list(range(40, 75)), [*range(40, 60), 7, 8, 9], [5, 77, 300, 12]]


@pytest.mark.parametrize(("arch", "kv"), [("qwen2", "auto"), ("gemma3", "int8")])
def test_engine_triton_backend_greedy_equals_default(tiny_models: dict[str, Path], arch: str,
                                                     kv: str) -> None:
    """GQA 2:1 (Qwen2) or MQA with a 16-token window the prompts cross (Gemma 3) over an int8
    pool; chunked prefill (24-token steps), a prefix hit of the first prompt's blocks and
    batched decodes through the triton kernels: the same greedy tokens as the default path."""
    from pagedkv import LLM

    path = str(tiny_models[arch])
    opts = {"num_blocks": 48, "block_size": 8, "max_num_batched_tokens": 24, "kv_cache_dtype": kv}
    ref = LLM(path, **opts)
    tri = LLM(path, attention_backend="triton", **opts)
    assert tri.engine.runner.attention_backend == "triton"
    want = _greedy(ref, PROMPTS[:1]) + _greedy(ref, PROMPTS[1:])
    got = _greedy(tri, PROMPTS[:1]) + _greedy(tri, PROMPTS[1:])  # the second call hits blocks
    assert got == want
    assert len({tuple(row) for row in want}) == len(want)  # the prompts lead apart
    assert tri.engine.cache.stats().prefix_hits >= 16


def test_device_metadata_and_model_to_device(tiny_qwen2: Path) -> None:
    """The device path's host-side pieces on the CPU: device_metadata copies every tensor
    field and decides has_skips on the host; a float model moved by to_device (weights, RoPE
    tables, prebound matmuls) and its RoPE tables reserved ahead give the same greedy tokens."""
    from pagedkv import LLM
    from pagedkv.engine.model_runner import device_metadata

    meta = AttentionMetadata(torch.tensor([3, -1, 4]), [2], [0], torch.zeros((0, 1), dtype=torch.int32),
                             torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([5], dtype=torch.int32),
                             max_decode_seq_len=5, backend="triton")
    moved = device_metadata(meta, torch.device("cpu"))
    assert moved is not meta and moved.has_skips is True and moved.plan is None
    assert moved.backend == "triton" and moved.max_decode_seq_len == 5
    assert torch.equal(moved.slot_mapping, meta.slot_mapping)
    llm = LLM(str(tiny_qwen2), num_blocks=48, weights="float32")
    want = _greedy(llm, PROMPTS)
    model = llm.engine.loaded.model
    assert model.to_device("cpu") is model
    model.reserve_positions(5000)  # grows the tables past their 4,096 first positions
    assert model.rope.cos.shape[0] == 8192
    assert _greedy(llm, PROMPTS) == want


def test_tier_fingerprint_names_device_dtype_and_attention(tiny_qwen2: Path) -> None:
    """The tier fingerprint covers what computes the K/V: the device type (not its index),
    the compute dtype and the attention implementation that runs, besides the layout."""
    from pagedkv.cache.tiers import model_fingerprint
    from pagedkv.model.loader import load_model

    f32, bf16 = (load_model(str(tiny_qwen2), dtype=dt, weights="float32")
                 for dt in ("float32", "bfloat16"))
    layout = KVStorage(1, 2, 8, 2, 64, "float16").block_layout()  # the same KV bytes for all
    fp = functools.partial(model_fingerprint, layout=layout, block_size=8)
    base = fp(f32)
    assert base == fp(f32, device="cpu", attention="torch")
    assert fp(f32, device="cuda:0") == fp(f32, device="cuda:1") != base
    assert fp(f32, attention="triton") != base
    assert fp(bf16) != base


def test_kv_saved_by_another_attention_backend_is_not_read(tiny_qwen2: Path, tmp_path: Path) -> None:
    """A disk tier written by the triton backend serves another triton engine, never a torch
    one (its K/V differ in the last bits): the device path's blocks stay its own."""
    from pagedkv import LLM

    opts = {"num_blocks": 48, "block_size": 8, "kv_tier": f"disk:{tmp_path}",
            "weights": "float32"}
    prompt = [list(range(40, 75))]

    def tier_tokens(llm) -> int:
        from pagedkv import SamplingParams

        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))[0]
        llm.engine.tiers.connector.writer.flush()
        return out.num_tier_cached_tokens

    writer = LLM(str(tiny_qwen2), attention_backend="triton", **opts)
    assert tier_tokens(writer) == 0
    assert tier_tokens(LLM(str(tiny_qwen2), **opts)) == 0  # torch: another fingerprint
    assert tier_tokens(LLM(str(tiny_qwen2), attention_backend="triton", **opts)) == 32
    writer.engine.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_cuda_greedy(tiny_qwen2: Path, dtype: str) -> None:
    """On a GPU: weights dequantized at load, the pool and the step on the device; float32
    greedy equals the CPU path's, bfloat16 runs and mostly agrees (eager: the kernels alone;
    tests/test_cuda_graphs.py checks graphs against this)."""
    from pagedkv import LLM

    cpu = _greedy(LLM(str(tiny_qwen2), num_blocks=48, weights="float32"), PROMPTS)
    llm = LLM(str(tiny_qwen2), num_blocks=48, device="cuda", dtype=dtype, enforce_eager=True)
    assert llm.engine.storage.kv.is_cuda
    got = _greedy(llm, PROMPTS)
    if dtype == "float32":
        assert got == cpu
    else:
        assert sum(a == b for x, y in zip(got, cpu, strict=True) for a, b in zip(x, y, strict=True)) >= 9


# --- options -----------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_a_typed_error() -> None:
    from pagedkv import LLM

    with pytest.raises(DeviceError, match="device 'cuda'.*no CUDA device"):
        EngineConfig(device="cuda")
    with pytest.raises(DeviceError, match="cuda:1"):
        LLM(device="cuda:1")  # before anything loads
    for bad in ("gpu", "cuda:x", 3):
        with pytest.raises(DeviceError, match="device must be"):
            EngineConfig(device=bad)
    with pytest.raises(DeviceError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cli_device_flag_error(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.cli import main

    assert main(["generate", "--device", "cuda", "hi"]) != 0  # before any model loads
    assert "--device 'cuda': this machine has no CUDA devices" in capsys.readouterr().err


def test_without_triton_cpu_default_works() -> None:
    """With triton unimportable: pagedkv imports, the default CPU path runs, 'auto' stays on
    torch, and asking for the triton backend is a DeviceError at start-up."""
    code = """
import sys
sys.modules["triton"] = None  # import triton -> ImportError
import torch
from pagedkv.attention import AttentionMetadata, paged_attention, triton_backend
from pagedkv.cache import KVStorage
from pagedkv.engine.config import EngineConfig
from pagedkv.errors import DeviceError
assert not triton_backend.available()
s = KVStorage(1, 4, 4, 1, 8)
meta = AttentionMetadata(torch.arange(3), [3], [0], torch.zeros((0, 1), dtype=torch.int32),
                         torch.zeros((0, 1), dtype=torch.int32), torch.zeros(0, dtype=torch.int32))
out = paged_attention(*(torch.randn(3, 1, 8) for _ in range(3)), s.layer(0), meta, 0.3)
assert out.shape == (3, 1, 8) and meta.plan.triton is None
EngineConfig(attention_backend="auto")
try:
    EngineConfig(attention_backend="triton")
except DeviceError as e:
    assert "needs triton" in str(e)
else:
    raise SystemExit("no DeviceError")
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "ok"
