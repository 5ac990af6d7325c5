"""CUDA graphs of the decode step (engine/cuda_graphs.py): the options, and the padded
static-buffer path that every replay runs, on the CPU (capture off) against the eager step.

What a GPU adds, `torch.cuda.graph` capture and replay, is checked by the CUDA-only tests at the
end (benchmarks/gpu_check.sh runs them); everything else runs here: decode steps padded to the
next captured size give the unpadded step's logits and tokens, padding rows write no KV (slot
-1) and read none (length 0), the cache's invariants hold, and prefill / mixed / speculative /
oversized steps fall back to the eager path.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import LLM, SamplingParams
from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.engine.config import DEFAULT_GRAPH_SIZES, EngineConfig, capture_sizes
from pagedkv.engine.cuda_graphs import GraphRunner, StaticInputs
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.engine.step_plan import StepPlan
from pagedkv.errors import InvalidParamsError
from pagedkv.options import add_arguments, from_namespace

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [list(range(40, 75)), [*range(40, 60), 7, 8, 9], [5, 77, 300, 12], [9, 8, 7, 6, 5, 4],
           [100 + i for i in range(19)]]


# --- options --------------------------------------------------------------------------------


def test_capture_sizes_are_vllms_and_capped_by_max_num_seqs() -> None:
    assert DEFAULT_GRAPH_SIZES[:5] == (1, 2, 4, 8, 16) and DEFAULT_GRAPH_SIZES[-1] == 256
    assert len(DEFAULT_GRAPH_SIZES) == 35
    assert capture_sizes(DEFAULT_GRAPH_SIZES, 64) == (1, 2, 4, *range(8, 65, 8))
    assert capture_sizes(DEFAULT_GRAPH_SIZES, 12) == (1, 2, 4, 8, 16)  # the first >= 12 too
    assert capture_sizes([8, 2, 2, 300], 512) == (2, 8, 300)
    assert capture_sizes([1, 2], 512) == (1, 2)  # larger batches: eager
    assert EngineConfig().graph_sizes() == ()  # the CPU never captures
    assert EngineConfig(enforce_eager=True).graph_sizes() == ()


def test_graph_options_refused_where_they_would_be_ignored() -> None:
    for bad in ([0], [1, "2"], [], 4, [1, 5000], [True]):
        with pytest.raises(InvalidParamsError, match="cuda_graph_sizes must be"):
            EngineConfig(cuda_graph_sizes=bad)
    with pytest.raises(InvalidParamsError, match="would be ignored: device is cpu"):
        EngineConfig(cuda_graph_sizes=[1, 2, 4])
    with pytest.raises(InvalidParamsError, match="cuda_graph_sizes"):
        LLM(cuda_graph_sizes=[8])  # before anything loads


def test_cli_spells_vllms_flags() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    args = parser.parse_args(["--enforce-eager", "--cuda-graph-sizes", "1", "2", "8"])
    assert args.cuda_graph_sizes == [1, 2, 8] and args.enforce_eager is True
    with pytest.raises(InvalidParamsError, match="device is cpu"):
        from_namespace(EngineConfig, args)
    assert from_namespace(EngineConfig, parser.parse_args(["--enforce-eager"])).enforce_eager
    with pytest.raises(SystemExit):
        parser.parse_args(["--cuda-graph-sizes", "0"])


def test_cli_graph_sizes_on_the_cpu_is_refused_in_flags(capsys: pytest.CaptureFixture[str]) -> None:
    from pagedkv.cli import main

    assert main(["generate", "hi", "--cuda-graph-sizes", "4", "8"]) != 0  # before any load
    assert "--cuda-graph-sizes would be ignored: --device is cpu" in capsys.readouterr().err


# --- the static buffers -----------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 8), st.integers(1, 5), st.randoms()), min_size=1,
                max_size=6))
def test_static_inputs_hold_exactly_the_padded_step(steps) -> None:  # noqa: ANN001
    """Steps of any batch (<= 8) and table width (<= 5 of 6 columns), in any order: after
    fill, the first `size` rows of every buffer are the step's rows, then padding (id 0,
    position 0, slot -1, length 0, a zero table); nothing of a larger earlier step remains."""
    groups, width = 2, 6
    inputs = StaticInputs(8, width, groups, torch.device("cpu"))
    for n, w, rnd in steps:
        size = next(s for s in (1, 2, 4, 8) if s >= n)
        rand = functools.partial(rnd.randint, 1, 10_000)
        tensor = functools.partial(torch.tensor, dtype=torch.int64)
        metas = tuple(AttentionMetadata(
            slot_mapping=tensor([rand() for _ in range(n)]), prefill_query_lens=[],
            prefill_context_lens=[], prefill_block_tables=torch.zeros((0, 1), dtype=torch.int32),
            decode_block_tables=torch.tensor([[rand() for _ in range(w)] for _ in range(n)],
                                             dtype=torch.int32),
            decode_seq_lens=torch.tensor([rand() for _ in range(n)], dtype=torch.int32))
            for _ in range(groups))
        plan = StepPlan(input_ids=tensor([rand() for _ in range(n)]),
                        positions=tensor([rand() for _ in range(n)]), meta=metas[0], metas=metas)
        inputs.fill(plan, size)
        pad = size - n
        assert inputs.ids(size).tolist() == plan.input_ids.tolist() + [0] * pad
        assert inputs.positions(size).tolist() == plan.positions.tolist() + [0] * pad
        for g, m in enumerate(metas):
            slots, tables, lens = inputs.group(g, size)
            assert slots.tolist() == m.slot_mapping.tolist() + [-1] * pad
            assert lens.tolist() == m.decode_seq_lens.tolist() + [0] * pad
            want = torch.zeros((size, width), dtype=torch.int32)
            want[:n, :w] = m.decode_block_tables
            assert torch.equal(tables, want)


# --- the padded path on the CPU -------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    sys.path.insert(0, str(Path(__file__).parent))
    from tiny_gguf import TinySpec, write_tiny_gguf

    specs = {
        "qwen2": TinySpec(arch="qwen2", name="Qwen2 small", hidden=256, heads=4, kv_heads=2,
                          head_dim=64, intermediate=512, bias=True, seed=11),
        "gemma3": TinySpec(arch="gemma3", name="Gemma 3 small", hidden=256, heads=4, kv_heads=1,
                           head_dim=64, intermediate=512, qk_norm=True, window=16, layers=7,
                           seed=12),
    }
    folder = tmp_path_factory.mktemp("graphs")
    return {k: write_tiny_gguf(v, folder / f"{k}.gguf") for k, v in specs.items()}


class EagerAndPadded:
    """A runner doing every step eagerly (its logits go on) and, where the GraphRunner has a
    size, padded too: keeps both logits and checks that the padded run wrote only the plan's
    slots (every other slot of the pool, the last one included, keeps its bits)."""

    def __init__(self, engine, sizes: tuple[int, ...], check_kv: bool) -> None:  # noqa: ANN001
        self.eager = engine.runner
        self.graphs = padded_runner(engine, sizes)
        self.storage, self.check_kv = engine.storage, check_kv
        self.pairs: list[tuple[int, torch.Tensor, torch.Tensor]] = []
        self.eager_only = 0

    def run(self, plan):  # noqa: ANN001, ANN201
        plan.greedy = None  # every logit is compared: the plain LM head (no greedy screen)
        want = self.eager.run(plan)
        size = self.graphs.size_for(plan)
        if size is None:
            self.eager_only += 1
            return want
        before = self.storage.kv.clone() if self.check_kv else None
        got = self.graphs.run(plan)
        if before is not None:
            kv = self.storage.kv
            n = kv.shape[2] * kv.shape[3]  # slots
            changed = (kv.view(torch.int32) != before.view(torch.int32)) if kv.dtype == torch.float32 \
                else (kv != before)
            changed = changed.transpose(0, 2).reshape(n, -1).any(dim=1)
            allowed = torch.zeros(n, dtype=torch.bool)
            for m in plan.metas:
                allowed[m.slot_mapping] = True
            assert not (changed & ~allowed).any(), "a padded row wrote outside the plan's slots"
        self.pairs.append((size, want, got))
        return want


def padded_runner(engine, sizes: tuple[int, ...]) -> GraphRunner:  # noqa: ANN001
    windows = tuple(w or 0 for w in engine.cache.groups.windows)
    return GraphRunner(engine.loaded.model, engine.storage, sizes, engine.max_model_len, windows,
                       engine.runner.attention_backend, capture=False)


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _check_pairs(both: EagerAndPadded, atol: float) -> None:
    assert both.pairs and both.eager_only  # prefill steps ran eagerly, decodes padded
    for size, want, got in both.pairs:
        assert got.shape == want.shape and size >= want.shape[0]
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_padded_decode_equals_eager_on_smollm2(smollm2) -> None:  # noqa: ANN001
    """The real model (quantized CPU kernels, torch attention): batches of 5 and 3 decodes
    padded to 8 and 4 give the eager step's logits; the generation is the default's."""
    opts = {"num_blocks": 64, "max_num_batched_tokens": 64}
    want = _greedy(LLM(smollm2, **opts), PROMPTS)
    llm = LLM(smollm2, **opts)
    both = llm.engine.runner = EagerAndPadded(llm.engine, (1, 2, 4, 8), check_kv=False)
    assert _greedy(llm, PROMPTS) == want
    assert _greedy(llm, PROMPTS[:3]) == want[:3]
    _check_pairs(both, 1e-3)
    assert {s for s, w, _ in both.pairs if w.shape[0] < s} >= {4, 8}  # padding happened
    llm.engine.cache.check_invariants()


@pytest.mark.parametrize(("arch", "backend", "kv"), [("qwen2", "torch", "auto"),
                                                     ("gemma3", "torch", "int8"),
                                                     ("qwen2", "triton", "auto")])
def test_padded_steps_write_only_their_slots(tiny_models: dict[str, Path], arch: str,
                                             backend: str, kv: str) -> None:
    """GQA (Qwen2) and a hybrid cache of full and 16-token window groups (Gemma 3, MQA, int8
    KV), torch and triton attention: every padded step changes no KV slot but the plan's, its
    logits are the eager step's, the tokens the default's, and the cache stays consistent."""
    opts = {"num_blocks": 48, "block_size": 8, "max_num_batched_tokens": 24,
            "kv_cache_dtype": kv, "weights": "float32"}
    path = str(tiny_models[arch])
    want = _greedy(LLM(path, **opts), PROMPTS)
    llm = LLM(path, attention_backend=backend, **opts)
    both = llm.engine.runner = EagerAndPadded(llm.engine, (2, 4, 8), check_kv=True)
    if arch == "gemma3":
        assert llm.engine.cache.num_groups > 1
    assert _greedy(llm, PROMPTS) == want
    _check_pairs(both, 1e-4)
    llm.engine.cache.check_invariants()


def test_graph_runner_serves_only_plain_decode_steps(tiny_models: dict[str, Path]) -> None:
    """Prefill, mixed, speculative (drafts) and larger-than-captured steps run eagerly; a
    decode step takes the smallest captured size that holds it."""
    llm = LLM(str(tiny_models["qwen2"]), num_blocks=48, block_size=8, max_num_batched_tokens=64,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "adaptive": False})
    e = llm.engine
    graphs = padded_runner(e, (2, 4))
    e.runner.graphs = graphs
    seen: list[tuple[int, int, bool, int | None]] = []
    eager = ModelRunner.run

    class Recorder(ModelRunner):
        def run(self, plan):  # noqa: ANN001, ANN201
            seen.append((len(plan.prefills), len(plan.decodes), bool(plan.drafts),
                         graphs.size_for(plan)))
            return eager(self, plan)

    e.runner.__class__ = Recorder
    rep = [1, 2, 3, 1, 2, 3, 1, 2, 3]  # a repeating prompt: prompt lookup drafts
    llm.generate([rep, rep[:7]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    for prefills, decodes, drafts, size in seen:
        if prefills or drafts or decodes > 4:
            assert size is None
        else:
            assert size == (2 if decodes <= 2 else 4)
    assert any(s is None and d for _, _, d, s in seen)  # a speculative step fell back
    assert any(dec == 5 and s is None for p, dec, _, s in seen if not p)  # 5 > 4: eager
    assert graphs.replays == sum(s is not None for *_, s in seen) > 0


def test_tensors_the_model_may_replace_are_held(tiny_models: dict[str, Path]) -> None:
    """What a graph reads and the model could rebuild (a second engine's to_device rebinds
    the q|k norm weights; a longer context regrows RoPE tables) is listed to be held alive."""
    from pagedkv.engine.cuda_graphs import _replaceable
    from pagedkv.model.loader import load_model

    model = load_model(str(tiny_models["gemma3"]), weights="float32").model
    held = _replaceable(model)
    assert any(t is model.rope.cos for t in held) and any(t is model.rope_local.cos for t in held)
    old = [layer._qk_norm_w for layer in model.layers]
    assert all(any(t is w for t in held) for w in old)
    model.to_device("cpu")  # rebinds: new q|k norm tensors, same values
    assert all(layer._qk_norm_w is not w and torch.equal(layer._qk_norm_w, w)
               for layer, w in zip(model.layers, old, strict=True))


# --- on a GPU ---------------------------------------------------------------------------------


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@CUDA
def test_cuda_graphs_capture_and_replay_equal_eager(tiny_models: dict[str, Path]) -> None:
    """Graphs captured at start (float32, so replay and eager can be compared exactly in
    tokens), batches of 1, 3 and 5 replayed padded: the eager engine's tokens."""
    for arch in ("qwen2", "gemma3"):
        path = str(tiny_models[arch])
        opts = {"num_blocks": 64, "device": "cuda", "dtype": "float32", "max_num_seqs": 8}
        eager = LLM(path, enforce_eager=True, **opts)
        assert eager.engine.runner.graphs is None
        llm = LLM(path, cuda_graph_sizes=[1, 2, 4, 8], **opts)
        graphs = llm.engine.runner.graphs
        assert graphs is not None, "capture failed: see the pagedkv.engine warning"
        assert sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.capture_seconds > 0
        for batch in (PROMPTS[:1], PROMPTS[:3], PROMPTS):
            assert _greedy(llm, batch) == _greedy(eager, batch)
        assert graphs.replays > 0
        llm.engine.cache.check_invariants()


@CUDA
def test_cuda_graph_replay_logits_equal_eager_step(tiny_models: dict[str, Path]) -> None:
    """Each replayed decode step's logits against the eager step on the same plan (bf16)."""
    llm = LLM(str(tiny_models["qwen2"]), num_blocks=64, device="cuda", dtype="bfloat16",
              cuda_graph_sizes=[4, 8], max_num_seqs=8)
    e = llm.engine
    graphs, eager = e.runner.graphs, ModelRunner(e.loaded.model, e.storage, "auto")
    pairs = []

    class Both(ModelRunner):
        def run(self, plan):  # noqa: ANN001, ANN201
            want = eager.run(plan)
            got = graphs.run(plan)
            if got is not None:
                pairs.append((want, got))
            return want

    e.runner.__class__ = Both
    _greedy(llm, PROMPTS[:3])
    assert pairs
    for want, got in pairs:
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
