"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar), compiled once
by llguidance, and one matcher per sequence that yields the step's token mask.

- `StructuredOutputsParams` (structured_params.py) holds the request's one constraint.
- `GrammarCompiler` (one per engine, thread-safe: the server compiles on its preprocessing
  thread, the engine thread then hits the cache) turns a constraint into a `CompiledGrammar`:
  validated, its first mask computed (a grammar that admits no token is refused here, never
  in a step), kept in a bounded LRU keyed by the constraint's canonical text.
- `GrammarMatcher` is a sequence's parser state. Invariant: it has consumed exactly the
  sequence's output tokens. Preemption recomputes K/V from the same token ids, so the matcher
  is never rolled back; a fork (n > 1) starts its own matcher before any output exists.

Masks are written as bits (llguidance's layout: token t is bit t % 32 of int32 word t // 32)
for all of a step's constrained rows in one call that releases the GIL.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pagedkv.engine.structured_params import StructuredOutputsParams
from pagedkv.errors import GrammarError

CACHE_SIZE = 256  # compiled grammars kept (LRU)
# JSON is emitted in one canonical layout: a small model given free whitespace tends to loop on
# newlines; these separators are how such models write JSON anyway
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(slots=True, eq=False)
class CompiledGrammar:
    """A validated grammar and a matcher in its start state (copied for every sequence)."""

    kind: str
    template: Any  # llguidance.LLMatcher, never advanced

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.template.deep_copy())


class GrammarMatcher:
    """A sequence's parser state: `accept(token)` after each sampled token; the sampler fills
    its mask each step. Invariant: it has consumed exactly the sequence's output tokens."""

    __slots__ = ("m", "consumed")

    def __init__(self, m: Any) -> None:
        self.m = m
        self.consumed = 0  # tokens accepted: a mask computed at this count is the mask now

    def accept(self, token: int) -> bool:
        """Consume a sampled token; False (the matcher is then in its error state) if the
        grammar does not allow it."""
        self.consumed += 1
        return bool(self.m.consume_token(token))

    @property
    def stopped(self) -> bool:
        """Nothing but EOS can follow: the output is complete."""
        return bool(self.m.is_stopped())

    @property
    def error(self) -> str:
        return self.m.get_error() if self.m.is_error() else ""


class GrammarCompiler:
    """Compiles constraints against one tokenizer and vocabulary; a bounded LRU by constraint."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int],
                 cache_size: int = CACHE_SIZE) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._eos = sorted(eos_ids)
        self._ll: Any = None  # llguidance.LLTokenizer, built on first use (~0.5 s)
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._size = cache_size
        self._lock = threading.Lock()
        self.compile_seconds = 0.0  # spent compiling (cache misses), over the engine's life
        self.compiles = 0

    def _tokenizer(self) -> Any:
        if self._ll is None:
            if self._hf is None:
                raise GrammarError("structured outputs need a tokenizer", "structured_outputs")
            self._ll = _ll_tokenizer(self._hf, self.vocab_size, tuple(self._eos))
        return self._ll

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of `spec` (cached); GrammarError if it cannot be used. The
        compile itself runs outside the lock: a long one never holds up another thread's hit."""
        key = spec.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        t0 = time.perf_counter()
        compiled = self._compile(spec)
        with self._lock:
            self.compile_seconds += time.perf_counter() - t0
            self.compiles += 1
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            if len(self._cache) > self._size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        import llguidance as llg

        kind, text = spec.key()
        try:
            grammar = _llg_grammar(llg, kind, text)
        except GrammarError:
            raise
        except Exception as exc:  # the converters raise ValueError / RuntimeError on bad text
            raise GrammarError(f"invalid {kind}: {_one_line(str(exc))}", kind) from None
        m = llg.LLMatcher(self._tokenizer(), grammar, log_level=0, limits=_limits(llg))
        if m.is_error():
            raise GrammarError(f"invalid {kind}: {_one_line(m.get_error())}", kind)
        mask = torch.zeros(self.words, dtype=torch.int32)
        m.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
        if m.is_error() or not bool(mask.any()):
            raise GrammarError(f"the {kind} constraint matches no output", kind)
        return CompiledGrammar(kind, m)

    # --- the step's masks ---------------------------------------------------------------------

    def fill_masks(self, matchers: list[GrammarMatcher], out: torch.Tensor) -> None:
        """Row j of `out` (int32 [len(matchers), words], contiguous) := matcher j's mask. A matcher in its error state still allows EOS:
        the sampler fails such rows itself."""
        row = self.words * 4
        ptr = out.data_ptr()
        for j, g in enumerate(matchers):
            g.m.unsafe_compute_mask_ptr(ptr + j * row, row)


_LL_TOKENIZERS: dict[tuple[int, int, tuple[int, ...]], tuple[Any, Any]] = {}
_LL_LOCK = threading.Lock()


def _ll_tokenizer(hf: Any, vocab_size: int, eos: tuple[int, ...]) -> Any:
    """llguidance's view of a transformers tokenizer (~0.5 s to build), one per tokenizer
    object: engines over the same loaded model share it (the entry keeps `hf` alive, so its
    id is not reused)."""
    import llguidance.hf

    key = (id(hf), vocab_size, eos)
    with _LL_LOCK:
        hit = _LL_TOKENIZERS.get(key)
        if hit is None:
            ll = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=list(eos) or None)
            hit = _LL_TOKENIZERS[key] = (hf, ll)
        return hit[1]


def apply_masks(x: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """x[rows] := -inf wherever the bit mask (int32 [len(rows), words]) is clear.

    By 32-token words, in numpy: a word of zeros bans its 32 logits in one slice assignment, a
    word of ones is skipped, and only the mixed words are unpacked to bits (a JSON grammar's
    mask is mostly zero words; inside a string, mostly ones). torch's indexing and masked_fill_
    woke the OpenMP team for every call: ~2 ms a row right after a forward pass."""
    vocab = x.shape[-1]
    words = masks.shape[1]
    if words * 32 < vocab:
        raise ValueError(f"masks cover {words * 32} tokens, the logits {vocab}")
    xn = x.numpy()  # a view: x is the sampler's own float32 CPU copy
    m = masks.numpy()
    full = vocab // 32  # whole words inside the row
    for j, i in enumerate(rows):
        w = m[j]
        row = xn[i]
        some = np.flatnonzero(w)
        if some.size * 4 < words:  # few words allow anything: keep those tokens, ban the rest
            ids = _set_bits(w, some)
            ids = ids[ids < vocab]
            kept = row[ids]
            row.fill(-np.inf)
            row[ids] = kept
            continue
        blocks = row[:full * 32].reshape(full, 32)
        blocks[w[:full] == 0] = -np.inf
        mixed = np.flatnonzero((w != 0) & (w != -1))
        if mixed.size:
            ids = _set_bits(~w, mixed)  # the clear bits of the mixed words
            row[ids[ids < vocab]] = -np.inf
        if full * 32 < vocab and w[full] == 0:  # the last, partial word
            row[full * 32:] = -np.inf


def _set_bits(w: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """Token ids of the set bits of the words w[idx] (word k holds tokens 32k .. 32k + 31)."""
    bits = np.unpackbits(w[idx].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    return (idx[:, None] * 32 + np.arange(32))[bits == 1]


def _llg_grammar(llg: Any, kind: str, text: str) -> str:
    if kind == "json":
        return llg.LLMatcher.grammar_from_json_schema(text, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=JSON_OPTIONS)
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        return llg.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(text)))
    return llg.grammar_from("grammar", text)  # GBNF (llama.cpp) or Lark


def _limits(llg: Any) -> Any:
    # below llguidance's defaults: a request's grammar must stay cheap for the shared step
    return llg.LLParserLimits(max_grammar_size=200_000, max_lexer_states=50_000,
                              verbose_errors=False)


def _one_line(msg: str, limit: int = 400) -> str:
    """llguidance's message (multi-line, with a caret diagram) as one capped line."""
    text = " ".join(part.strip() for part in msg.splitlines() if part.strip().strip("^"))
    return (text[:limit] + "...") if len(text) > limit else text or "invalid grammar"
