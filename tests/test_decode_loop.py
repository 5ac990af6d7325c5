"""decode_loop.cpp: a pure-decode step's layers in one op give the Python loop's bits.

Each case runs the same greedy requests (logprobs on) twice on one engine, the layers in the
op and then in Python (llama.DECODE_LOOP), and wants the same tokens and the same float32
logprobs bit for bit: at 1, 6 and 16 rows, so the exact mode's row kernel and qgemm and the
int8 mode's row kernels and panel all run inside the op."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_gguf import SPECS, Q, TinySpec, write_tiny_gguf

from pagedkv import LLM, SamplingParams
from pagedkv.model import llama, qkernel

pytestmark = pytest.mark.skipif(not qkernel.load(), reason="needs the compiled kernels")

LOOP_SPECS = {
    # K-quants at whole super-blocks, Qwen2's q/k/v biases, Q6_K where Q4_K_M puts it
    "qwen2-kquants": TinySpec("qwen2", "Qwen2 K-quant tiny", 512, 4, 2, 128, 1280, layers=3, bias=True, seed=31,
                              qtypes={"attn": Q.Q4_K, "attn_v": Q.Q6_K, "ffn": Q.Q4_K, "ffn_down": Q.Q4_K,
                                      "ffn_down_odd": Q.Q6_K, "embd": Q.Q6_K}),
    # rows that are not whole super-blocks: the 32-element fallbacks of a real Q4_K_M file
    "llama-fallbacks": TinySpec("llama", "SmolLM2-like tiny", 960, 15, 5, 64, 2560 - 32, layers=3, seed=32,
                                qtypes={"attn": Q.Q5_0, "attn_v": Q.Q8_0, "ffn": Q.Q5_0, "ffn_down": Q.Q8_0,
                                        "ffn_down_odd": Q.Q4_1, "embd": Q.Q8_0}),
}


# QK-norm (Qwen3), the attention and MLP output norms (Gemma 2), both with sliding-window KV groups
# and a second RoPE table (Gemma 3)
NORMED = ("qwen3", "gemma2", "gemma3")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("loop")
    specs = {**LOOP_SPECS, **{name: SPECS[name] for name in NORMED}}
    return {name: write_tiny_gguf(spec, folder / f"{name}.gguf", fast=True) for name, spec in specs.items()}


class Calls:
    """Counts decode_layers calls (the op wrapped where qkernel hands it out)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.n = 0
        op = qkernel._kernel.decode_layers

        def counted(*args: Any) -> None:
            self.n += 1
            op(*args)

        monkeypatch.setattr(qkernel._kernel, "decode_layers", counted)


def run(llm: LLM, rows: int, loop: bool) -> list[tuple[list[int], Any]]:
    llama.DECODE_LOOP = loop
    try:
        prompts = [[7 + i, 90 + 3 * i, 200, 11 * i + 5, 64][: 2 + i % 4] for i in range(rows)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2))
    finally:
        llama.DECODE_LOOP = True
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("activations", ["float32", "int8"])
@pytest.mark.parametrize("name", [*sorted(LOOP_SPECS), *NORMED])
def test_loop_gives_the_python_loops_bits(files: dict[str, Path], name: str, activations: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(str(files[name]), activations=activations, enable_prefix_caching=False, num_blocks=128)
    calls = Calls(monkeypatch)
    for rows in (1, 6, 16):
        ours = run(llm, rows, loop=True)
        ran = calls.n
        assert ran >= 4, (rows, ran)  # every decode step of the 5 tokens took the op
        assert ours == run(llm, rows, loop=False), (name, activations, rows)
        assert calls.n == ran  # (and the Python loop's steps never did)


def test_batch_invariant_mode_keeps_a_sequences_bits_in_any_batch(files: dict[str, Path]) -> None:
    """With pagedkv_q.batch_invariant on (PAGEDKV_BATCH_INVARIANT=1) a greedy request's logprobs
    are the same bits alone and among 15 others (prefill and decode steps through qgemm, the op's
    layers included): the exact mode's paths all sum in one order."""
    llm = LLM(str(files["llama-fallbacks"]), enable_prefix_caching=False, num_blocks=256)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)
    one = [5, 77, 310, 12, 9, 41, 150]
    others = [[7 + i, 90 + 3 * i, 200, 11 * i + 5, 64, 3 + i][: 2 + i % 5] for i in range(15)]
    before = torch.ops.pagedkv_q.batch_invariant(True)
    try:
        alone = llm.generate([one], sp)[0].outputs[0]
        batched = llm.generate([one, *others], sp)[0].outputs[0]
    finally:
        torch.ops.pagedkv_q.batch_invariant(before)
    assert alone.token_ids == batched.token_ids and alone.logprobs == batched.logprobs


@pytest.mark.parametrize("kv", ["float16", "bfloat16"])
def test_loop_over_a_16_bit_kv_cache_gives_the_python_loops_bits(files: dict[str, Path], kv: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--kv-cache-dtype float16 / bfloat16 (llama.cpp's default KV type is f16): the float32 K/V
    are rounded into the cache by the fused write + decode, inside the op as in the Python loop."""
    llm = LLM(str(files["qwen3"]), activations="int8", enable_prefix_caching=False, num_blocks=128, kv_cache_dtype=kv)
    calls = Calls(monkeypatch)
    ours = run(llm, 6, loop=True)
    assert calls.n >= 4
    assert ours == run(llm, 6, loop=False)


def test_plan_follows_the_weights_routes(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan cached under int8 activations is not reused after the weights switch to float32
    (quant.route_key): the op then gives the exact mode's Python bits."""
    llm = LLM(str(files["qwen2-kquants"]), activations="int8", enable_prefix_caching=False, num_blocks=64)
    int8 = run(llm, 2, loop=True)
    llm.engine.runner.model.set_activations("float32")
    Calls(monkeypatch)
    exact = run(llm, 2, loop=True)
    assert exact == run(llm, 2, loop=False) and exact != int8


def test_cached_plans_hold_no_kv_storage(files: dict[str, Path]) -> None:
    """The plans the model caches hold its own tensors only: the KV caches go in each step, so a
    storage dropped by its engine is never kept alive by the model."""
    llm = LLM(str(files["qwen2-kquants"]), activations="int8", enable_prefix_caching=False, num_blocks=64)
    run(llm, 2, loop=True)
    model, storage = llm.engine.runner.model, llm.engine.storage
    kv = {t.untyped_storage().data_ptr() for c in storage.model_layers for t in (c.k, c.v)}
    plans = [p for _, p in model._plans.values() if p is not None]
    assert plans and all(t.untyped_storage().data_ptr() not in kv for p in plans for t in p[0])


def test_steps_it_does_not_take_run_in_python(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized KV cache's attention is not the op's fused write + decode: every step runs the
    Python loop."""
    llm = LLM(str(files["qwen3"]), enable_prefix_caching=False, num_blocks=64, kv_cache_dtype="int8")
    calls = Calls(monkeypatch)
    run(llm, 2, loop=True)
    assert calls.n == 0


def test_a_malformed_plan_changes_nothing(files: dict[str, Path]) -> None:
    """The op reads its whole plan before its first call: a plan one int short or long, with an
    unknown matmul kind, one cache short, a KV group index that overflows when scaled, a negative
    window or a NaN softcap fails with a clear error and nothing written to x, h or the KV cache."""
    llm = LLM(str(files["qwen2-kquants"]), activations="int8", enable_prefix_caching=False, num_blocks=64)
    model = llm.engine.runner.model
    captured: dict[str, Any] = {}
    real = model._decode_plan

    def keep(*args: Any) -> Any:
        plan = real(*args)
        if plan is not None:
            captured.setdefault("plan", plan)
        return plan

    model._decode_plan = keep
    run(llm, 1, loop=True)
    bufs, rope, meta, caches, w, ints, floats = captured["plan"]
    x, h = torch.randn(1, 512), torch.randn(1, 512)
    before = [t.clone() for t in caches]
    assert ints[-4:-2] == [1, 2]  # the last matmul (down): one segment, its impl and type
    kind = len(ints) - 5
    for bad in (ints[:-1], [*ints, 7], [9 if i == kind else v for i, v in enumerate(ints)]):
        x0, h0 = x.clone(), h.clone()
        with pytest.raises(RuntimeError, match="decode_layers"):
            qkernel.decode_layers()(x, h, bufs, rope, meta, caches, w, bad, floats)
        assert torch.equal(x, x0) and torch.equal(h, h0)
        assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))
    with pytest.raises(RuntimeError, match="a k and a v cache a layer"):  # one cache short
        qkernel.decode_layers()(x, h, bufs, rope, meta, caches[:-1], w, ints, floats)
    # hostile values: a group index whose 3 * g overflows int64, a negative window, a QK-norm flag
    # of 2, QK-norm and output-norm flags on a layer whose next tensors are not such weights, a
    # NaN softcap
    wrap = (2**64 + 2) // 3
    for bad_ints, bad_floats, match in (([*ints[:2], wrap, *ints[3:]], floats, "no KV group"),
                                        ([*ints[:4], -1, *ints[5:]], floats, "window -1 < 0"),
                                        ([*ints[:6], 2, *ints[7:]], floats, "0 or 1"),
                                        ([*ints[:6], 1, *ints[7:]], floats, r"\[Hq \+ Hkv, D\]"),
                                        ([*ints[:7], 1, *ints[8:]], floats, r"output norms must be \[H\]"),
                                        (ints, [floats[0], floats[1], float("nan")], "softcap")):
        with pytest.raises(RuntimeError, match=match):
            qkernel.decode_layers()(x, h, bufs, rope, meta, caches, w, bad_ints, bad_floats)
    assert torch.equal(x, x0) and torch.equal(h, h0)
    assert all(torch.equal(a, b) for a, b in zip(before, caches, strict=True))
    assert run(llm, 1, loop=True) == run(llm, 1, loop=False)  # the model serves on, unharmed


def test_kept_logits_buffer_gives_the_same_outputs(files: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With every step's logits in the one kept buffer (LlamaModel._logits_out, its threshold at 0)
    greedy tokens with logprobs, seeded n > 1 sampling (forks read the same logits) and beam
    search (its own forward loop) give what fresh logits tensors give; the buffer is reused
    step after step (the same storage) and grows to a larger row count."""
    from pagedkv.engine.beam_search import BeamSearchParams

    llm = LLM(str(files["qwen2-kquants"]), activations="int8", enable_prefix_caching=False, num_blocks=256)
    model = llm.engine.runner.model
    prompts = [[7 + i, 90 + 3 * i, 200, 11 * i + 5][: 2 + i % 3] for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.8, top_p=0.9, n=3, seed=5, max_tokens=6, ignore_eos=True, logprobs=2)]

    def outputs() -> Any:
        gen = [[(list(c.token_ids), c.logprobs) for c in o.outputs] for p in params for o in llm.generate(prompts, p)]
        beams = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=3, max_tokens=4, ignore_eos=True))
        return gen, [[(b.token_ids, b.cum_logprob) for b in o.sequences] for o in beams]

    monkeypatch.setattr(llama, "LOGITS_KEEP_MIN", 1 << 62)
    fresh = outputs()
    assert model._logits_buf is None
    monkeypatch.setattr(llama, "LOGITS_KEEP_MIN", 0)
    kept = outputs()
    buf = model._logits_buf
    assert buf is not None and buf.shape[0] >= 6 * 3
    assert kept == fresh
    storage = buf.untyped_storage().data_ptr()
    llm.generate(prompts[:2], params[0])
    assert model._logits_buf.untyped_storage().data_ptr() == storage  # reused, not reallocated
