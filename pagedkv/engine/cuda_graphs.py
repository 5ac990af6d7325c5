"""GraphRunner: decode-only steps at fixed batch sizes through static buffers (CUDA graphs).

vLLM's CUDA graph mode for the decode step. A captured graph replays the kernels of one forward
pass over the same memory, so everything the pass reads lives in static buffers sized for the
largest captured batch S: token ids and positions [S] int64 and, per KV group, the slot mapping
[S] int64, the block tables [S, W] int32 (W = the context's blocks, zero past each row's table)
and the sequence lengths [S] int32. A step of n decodes takes the smallest captured size >= n;
rows n .. size-1 are padding: token 0 at position 0, slot -1 (the KV write skips it: no block is
written), length 0 (attention reads no position and gives 0), and their logits are dropped. So
the real rows compute what an eager step computes, and padding touches no KV block.

Everything but `torch.cuda.graph` runs on the CPU too: with `capture=False` the runner fills the
same buffers and runs the padded batch eagerly (what the tests check against the unpadded step).
On CUDA (`capture=True`, the triton backend) each size is run once to compile the kernels and
build the step's attention plan (the split-K count fixed for the longest context), then
captured, largest first, sharing one memory pool; a step is then one host-to-device copy of the
two packed input buffers, a replay, and the logits' copy back (the step's one sync).

Invariants: a plan is replayed only when it is decode-only, without drafts, of at most the
largest size, and its tables fit W columns (`size_for`); otherwise `run` returns None and the
caller runs it eagerly. The RoPE tables are reserved for the whole context before capture, and
the tensors a graph reads that the model could replace later are held (`_replaceable`), so no
memory a graph reads is ever freed and reused.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.attention.metadata import AttentionMetadata
from pagedkv.engine.step_plan import StepPlan

log = logging.getLogger("pagedkv.engine")

_NO_TABLE = torch.zeros((0, 1), dtype=torch.int32)


class StaticInputs:
    """The buffers a graph reads, packed in one int64 and one int32 tensor so a step is two
    copies: int64 [ids S | positions S | slots G x S], int32 [lens G x S | tables G x S x W].
    On CUDA the step fills pinned host twins and copies them over; on the CPU it fills them."""

    def __init__(self, max_size: int, width: int, groups: int, device: torch.device) -> None:
        self.size, self.width, self.groups = max_size, width, groups
        n64, n32 = (2 + groups) * max_size, groups * max_size * (1 + width)
        pin = device.type == "cuda"
        self.host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=pin)
        self.dev64 = self.host64 if not pin else torch.zeros(n64, dtype=torch.int64, device=device)
        self.dev32 = self.host32 if not pin else torch.zeros(n32, dtype=torch.int32, device=device)

    def _views(self, b64: torch.Tensor, b32: torch.Tensor, g: int):
        s, w = self.size, self.width
        lens = b32[g * s : (g + 1) * s]
        t0 = self.groups * s + g * s * w
        return b64[(2 + g) * s : (3 + g) * s], b32[t0 : t0 + s * w].view(s, w), lens

    def ids(self, size: int) -> torch.Tensor:
        return self.dev64[:size]

    def positions(self, size: int) -> torch.Tensor:
        return self.dev64[self.size : self.size + size]

    def group(self, g: int, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Group g's (slots [size], tables [size, W], lens [size]) as the graph reads them."""
        slots, tables, lens = self._views(self.dev64, self.dev32, g)
        return slots[:size], tables[:size], lens[:size]

    def fill(self, plan: StepPlan, size: int) -> None:
        """The plan's n decode rows (one token each), then padding up to `size`; copied to
        the device. Every row below `size` is rewritten: nothing of an earlier step remains."""
        n, s = plan.num_tokens, self.size
        h64, h32 = self.host64, self.host32
        h64[:n] = plan.input_ids
        h64[s : s + n] = plan.positions
        for g, meta in enumerate(plan.metas or (plan.meta,)):
            slots, tables, lens = self._views(h64, h32, g)
            slots[:n] = meta.slot_mapping
            lens[:n] = meta.decode_seq_lens
            t = meta.decode_block_tables
            tables[:n, : t.shape[1]] = t
            tables[:n, t.shape[1] :] = 0
        self.pad_rows(n, size, host_only=True)
        if self.dev64 is not h64:
            self.dev64.copy_(h64, non_blocking=True)
            self.dev32.copy_(h32, non_blocking=True)

    def pad_rows(self, lo: int, hi: int, host_only: bool = False) -> None:
        """Rows lo .. hi-1 as padding (all of them before a capture's warm-up run)."""
        s = self.size
        self.host64[lo:hi] = 0
        self.host64[s + lo : s + hi] = 0
        for g in range(self.groups):
            slots, tables, lens = self._views(self.host64, self.host32, g)
            slots[lo:hi] = -1
            lens[lo:hi] = 0
            tables[lo:hi].zero_()
        if not host_only and self.dev64 is not self.host64:
            self.dev64.copy_(self.host64)
            self.dev32.copy_(self.host32)


@dataclass(slots=True)
class _Graph:
    """One captured size: the metadata its kernels were built with, its output, the graph."""

    metas: tuple[AttentionMetadata, ...]
    logits: torch.Tensor  # [size, V] float32, written by every replay
    graph: Any  # torch.cuda.CUDAGraph


class GraphRunner:
    """Pads decode-only steps to a captured size and replays its graph (CUDA), or runs the
    padded batch eagerly (`capture=False`: the CPU, tests)."""

    def __init__(self, model: torch.nn.Module, storage: Any, sizes: tuple[int, ...],
                 max_model_len: int, windows: tuple[int, ...], backend: str = "auto",
                 capture: bool = True) -> None:
        if not sizes or any(n < 1 for n in sizes):
            raise ValueError(f"capture sizes must be positive, got {sizes!r}")
        self.model, self.storage, self.backend = model, storage, backend
        self.sizes = tuple(sorted(set(sizes)))
        self.device = torch.device(getattr(storage, "device", "cpu"))
        self.capture = capture
        self.max_model_len = max_model_len
        self.windows = windows
        width = max(1, -(-max_model_len // storage.block_size))
        self.inputs = StaticInputs(self.sizes[-1], width, len(windows), self.device)
        self.graphs: dict[int, _Graph] = {}
        self._held: list[torch.Tensor] = []  # see _replaceable
        self.replays = 0  # steps this runner served
        self.capture_seconds = 0.0

    def size_for(self, plan: StepPlan) -> int | None:
        """The captured size that serves `plan`, or None: it runs eagerly."""
        n = len(plan.decodes)
        if plan.prefills or not n or plan.drafts or n > self.sizes[-1]:
            return None
        metas = plan.metas or (plan.meta,)
        if len(metas) != len(self.windows) or any(
                m.decode_block_tables.shape[1] > self.inputs.width for m in metas):
            return None
        return next(s for s in self.sizes if s >= n)

    def _metas(self, size: int, max_len: int) -> tuple[AttentionMetadata, ...]:
        """Decode-only metadata over the static buffers' first `size` rows, one per group."""
        out = []
        for g, w in enumerate(self.windows):
            slots, tables, lens = self.inputs.group(g, size)
            out.append(AttentionMetadata(
                slot_mapping=slots, prefill_query_lens=[], prefill_context_lens=[],
                prefill_block_tables=_NO_TABLE, decode_block_tables=tables, decode_seq_lens=lens,
                max_decode_seq_len=max_len, group_window=w, backend=self.backend))
        return tuple(out)

    def _forward(self, size: int, metas: tuple[AttentionMetadata, ...]) -> torch.Tensor:
        with torch.inference_mode():
            return self.model(self.inputs.ids(size), self.inputs.positions(size), self.storage,
                              metas, None)

    def run(self, plan: StepPlan) -> torch.Tensor | None:
        """Logits [n, V] on the CPU for a plan this runner serves (`size_for`), else None."""
        size = self.size_for(plan)
        if size is None:
            return None
        n = len(plan.decodes)
        self.inputs.fill(plan, size)
        self.replays += 1
        graph = self.graphs.get(size)
        if graph is None:  # not captured (capture=False): the padded batch, eagerly
            logits = self._forward(size, self._metas(size, plan.meta.max_decode_seq_len))
        else:
            graph.graph.replay()
            logits = graph.logits
        logits = logits[:n]
        return logits if logits.is_cpu else logits.float().cpu()

    def capture_all(self) -> None:
        """Capture every size (CUDA only; largest first, one shared pool)."""
        if not self.capture or self.device.type != "cuda":
            return
        t0 = time.perf_counter()
        self.model.reserve_positions(self.max_model_len)  # no RoPE table regrows after this
        self._held = _replaceable(self.model)
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            metas = self._metas(size, self.max_model_len)  # split-K fixed for the longest context
            self.inputs.pad_rows(0, self.inputs.size)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):  # compiles the kernels, builds each meta's plan
                self._forward(size, metas)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size, metas)
            self.graphs[size] = _Graph(metas, logits, graph)
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        log.info("captured %d CUDA graphs (decode batch sizes %s) in %.1f s", len(self.sizes),
                 ",".join(map(str, self.sizes)), self.capture_seconds)


def _replaceable(model: torch.nn.Module) -> list[torch.Tensor]:
    """Tensors a graph reads that the model may later replace by new ones of the same values
    (RoPE tables grown by another engine's longer context, q|k norm weights rebuilt by
    `bind` when a second engine moves the model): held, so their memory is never reused
    while a graph still reads it."""
    held = []
    for rope in getattr(model, "ropes", tuple)():
        if rope is not None:
            held += [rope.cos, rope.sin_signed]
    for layer in getattr(model, "layers", ()):
        w = getattr(layer, "_qk_norm_w", None)
        if w is not None:
            held.append(w)
    return held
