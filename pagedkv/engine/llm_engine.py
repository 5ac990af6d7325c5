"""LLMEngine (add_request / step / abort, used by the server) and LLM (the offline API)."""

from __future__ import annotations

import itertools
import logging
import os
import sys
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.cache import KVStorage, PagedKVCache
from pagedkv.cache.groups import kv_groups
from pagedkv.cache.quant import resolve_kv_cache_dtype
from pagedkv.cache.sizing import parse_size
from pagedkv.cache.storage import num_blocks_for_budget
from pagedkv.engine.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams, BeamStepStats
from pagedkv.engine.config import EngineConfig
from pagedkv.engine.context_shift import SHIFT_PROMPT_FACTOR, ContextShift
from pagedkv.engine.cuda_graphs import GraphRunner
from pagedkv.engine.detokenizer import find_stop
from pagedkv.engine.kv_events import EngineKVEvents
from pagedkv.engine.model_runner import ModelRunner
from pagedkv.engine.sampler import (
    ARGMAX_ONLY,
    FAILED,
    Sampler,
    generator_for,
    greedy_kind,
    top_logprobs,
)
from pagedkv.engine.sampling_params import SamplingParams
from pagedkv.engine.scheduler import Scheduler
from pagedkv.engine.sequence import CompletionOutput, Request, RequestOutput, Sequence, Status
from pagedkv.engine.spec_decode import SpecDecoder
from pagedkv.engine.step_plan import StepPlan
from pagedkv.engine.structured import GrammarCompiler
from pagedkv.engine.tiers import EngineTiers
from pagedkv.errors import CacheConfigError, InvalidParamsError, RequestTooLongError

log = logging.getLogger("pagedkv.engine")

Prompt = str | list[int] | list[dict]


@dataclass(slots=True)
class Forward:
    """One committed forward pass (LLMEngine.forward): row i of `logits` samples for
    `plan.samplers[i]`."""

    plan: StepPlan
    logits: torch.Tensor
    # row i's token where the model's greedy head decided it (greedy_head.py), else -1; None
    greedy_tokens: torch.Tensor | None = None


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # used blocks / all blocks
    num_blocks: int
    blocks_used: int
    blocks_cached: int  # free but still holding a prefix (evictable)
    blocks_free: int  # includes the cached ones
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    prefix_hit_rate: float
    num_preemptions: int
    num_requests_finished: int
    prompt_tokens_total: int
    generation_tokens_total: int
    cow_copies: int
    fork_shared_blocks: int  # blocks n > 1 samples shared instead of copying the prompt's
    fork_saved_bytes: int  # the KV memory that sharing saved
    gen_tokens_per_s: float  # generated tokens / busy seconds, over the engine's life
    evictions: int = 0  # cached prefix blocks reused for new data (LRU)
    prefix_cache_partial_hits: int = 0  # of the hits: tokens copied from a partly matched block
    step_seconds: float = 0.0  # wall time inside step(), over the engine's life
    forward_seconds: float = 0.0  # of which in the model's forward pass
    overhead_share: float = 0.0  # 1 - forward / step: scheduling, tensors, sampling, detokenizing
    dedup_requests_held: int = 0  # requests held for a prefix another prefill was computing
    dedup_tokens_saved: int = 0  # prompt tokens those requests got as hits instead of computing
    context_shifts: int = 0  # times a full context was shifted instead of finishing
    fair_preemptions: int = 0  # of num_preemptions, made for another request's fair share
    kv_events_published: int = 0  # KV cache events sent (--kv-events-config)
    kv_events_dropped: int = 0  # events dropped: the publisher's queue was full
    # speculative decoding (vLLM's names): sequences that verified drafts, drafts, accepted
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_acceptance_rate: float = 0.0  # accepted / draft tokens
    # method "draft_model": the draft's forward seconds (in the scheduler, outside
    # forward_seconds), its own KV cache's usage, and draft failures (drafts skipped)
    spec_decode_draft_forward_seconds: float = 0.0
    spec_decode_draft_kv_usage: float = 0.0
    spec_decode_draft_failures: int = 0


class LLMEngine:
    """Continuous-batching engine over the paged KV cache. Not thread-safe: one caller thread."""

    def __init__(self, model: object = None, *, config: EngineConfig | None = None,
                 **options: Any) -> None:
        """`model` (a path, None for the shipped SmolLM2, a LoadedModel or a transformers model)
        and any EngineConfig field as a keyword (`block_size=32, kv_cache_memory="2GiB"`), or a
        whole `config` (keywords then override it). The options are validated before the model
        loads; an unknown keyword raises UnknownOptionError."""
        from pagedkv.model.loader import LoadedModel, load_model

        if model is not None:
            options["model"] = model
        self.config = c = EngineConfig.build(config, **options)
        kv_dtype = resolve_kv_cache_dtype(c.kv_cache_dtype)
        if c.threads is not None:
            torch.set_num_threads(c.threads)
        on_cpu = c.device == "cpu"
        weights = c.weights if on_cpu or c.weights is not None else "float32"  # (cuda: no
        # quantized kernels, the GGUF blocks are dequantized to c.dtype at load)
        self.loaded = (
            c.model
            if isinstance(c.model, LoadedModel)
            else load_model(c.model, dtype=c.dtype, weights=weights, activations=c.activations,
                            batch_weights=c.batch_weights, context=c.max_model_len)
        )
        if not on_cpu:
            self.loaded.model.to_device(c.device)
        elif c.greedy_head == "screen" and hasattr(self.loaded.model, "prepare_greedy_head"):
            self.loaded.model.prepare_greedy_head()  # its norms now, not in the first step
        cfg = self.loaded.config
        self.tokenizer = self.loaded.tokenizer
        self.model_name = self.loaded.name
        wdtype = next(self.loaded.model.parameters()).dtype
        kv_dtype = kv_dtype or wdtype  # "auto": the model's dtype
        # not capped by the cache: a request that could never fit it is rejected instead
        self.max_model_len = c.context_len(cfg.max_position_embeddings)
        # KV cache groups: window layers apart unless the hybrid manager is off (groups.py)
        groups = kv_groups([cfg.layer_window(i) for i in range(cfg.num_layers)],
                           hybrid=not c.disable_hybrid_kv_cache_manager)
        num_blocks = c.num_blocks or num_blocks_for_budget(
            c.kv_cache_bytes, groups.layers_per_group, c.block_size, cfg.num_kv_heads,
            cfg.head_dim, kv_dtype)
        self.storage = KVStorage(groups.layers_per_group, num_blocks, c.block_size,
                                 cfg.num_kv_heads, cfg.head_dim, kv_dtype, c.device)
        self.storage.bind_groups(groups)
        self.cache = PagedKVCache(num_blocks, c.block_size, storage=self.storage,
                                  enable_prefix_caching=c.enable_prefix_caching,
                                  max_seq_len=self.max_model_len, groups=groups)
        self.context_shift = ContextShift(c.n_keep, c.n_discard) if c.context_shift else None
        if self.context_shift is not None:
            if groups.has_windows:
                raise CacheConfigError(
                    "context_shift moves K/V that sliding-window KV groups give back "
                    f"({groups.describe()}); use it with --disable-hybrid-kv-cache-manager")
            self.context_shift.check(self.max_model_len, self.cache.token_capacity)
            self.cache.register_rotation(self.loaded.model.shift_keys)
        spec = c.spec
        self.eos_ids = set(cfg.eos_token_ids or [])
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.grammars = GrammarCompiler(self.tokenizer, cfg.vocab_size, sorted(self.eos_ids))
        self.sampler = Sampler(self.eos_ids, self.grammars)
        self.spec = None if spec is None else SpecDecoder(spec, self._draft_proposer(spec,
                                                                                     num_blocks))
        self.scheduler = Scheduler(self.cache, c.max_num_seqs, c.max_num_batched_tokens,
                                   max_model_len=self.max_model_len,
                                   dedup_inflight_prefixes=c.dedup_inflight_prefixes,
                                   context_shift=self.context_shift,
                                   tier_read_timeout=c.kv_tier_read_timeout, spec=self.spec)
        self.runner = ModelRunner(self.loaded.model, self.storage, c.attention_backend)
        self.runner.graphs = self._capture_graphs(c, groups.windows)
        self.tiers = EngineTiers(self.loaded, self.cache, kv_tier=c.kv_tier, queue=c.kv_tier_queue,
                                 snapshot=c.kv_snapshot, snapshot_interval=c.kv_snapshot_interval,
                                 key=c.tier_key(), attention=self.runner.attention)
        self.kv_events = self._open_kv_events(c)
        self._cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        self.requests: dict[str, Request] = {}
        self._seq_ids = itertools.count()
        self._finished = 0
        self._prompt_tokens = 0
        self._gen_tokens = 0
        self._busy_s = 0.0
        self._forward_s = 0.0
        self._fork_shared = 0
        # called on this thread right before each forward pass (the server hands the previous
        # step's outputs to its event loop then, while the pass's kernels leave the GIL free)
        self.before_forward: Callable[[], None] | None = None

    def _capture_graphs(self, c: EngineConfig, windows: Seq[int | None]) -> GraphRunner | None:
        """CUDA graphs of the decode step at c.graph_sizes(), captured now; None on the CPU,
        with enforce_eager, or where the attention is not the triton kernels (torch syncs)."""
        sizes = c.graph_sizes()
        if not sizes:
            return None
        if self.runner.attention != "triton":
            log.info("no CUDA graphs: the attention backend is torch (triton is not installed)")
            return None
        graphs = GraphRunner(self.loaded.model, self.storage, sizes, self.max_model_len,
                             tuple(w or 0 for w in windows), c.attention_backend)
        try:
            graphs.capture_all()
        except Exception as exc:  # all or nothing: a failed capture leaves the eager engine
            log.warning("CUDA graph capture failed, decode steps run eagerly: %s: %s",
                        type(exc).__name__, exc)
            return None
        return graphs

    def _draft_proposer(self, spec: Any, num_blocks: int) -> Any:
        """method "draft_model": the draft (loaded, vocabulary checked: SpecConfigError) with
        its own cache of `num_blocks` blocks, and its proposer; None for prompt lookup."""
        if spec.method != "draft_model":
            return None
        from pagedkv.engine.draft_model import DraftModel
        from pagedkv.engine.draft_proposer import DraftProposer

        draft = DraftModel.load(spec, self.loaded, self.config, num_blocks, self.max_model_len)
        ratio = draft.loaded.weight_bytes / max(1, self.loaded.weight_bytes)
        return DraftProposer(draft, self.sampler, self.config.max_num_batched_tokens, ratio)

    def _open_kv_events(self, c: EngineConfig) -> EngineKVEvents | None:
        ev = c.kv_events()
        if ev is None or not ev.enabled:
            return None
        conn = self.tiers.connector
        return EngineKVEvents(ev, self.cache, None if conn is None else conn.tier)

    @property
    def max_prompt_len(self) -> int:
        """Longest prompt taken: one token short of the context; with context shift (which
        keeps n_keep + the latest tokens of a longer prompt) SHIFT_PROMPT_FACTOR contexts."""
        if self.context_shift is not None:
            return SHIFT_PROMPT_FACTOR * self.max_model_len
        return self.max_model_len - 1

    # --- requests -----------------------------------------------------------------------------

    def tokenize(self, prompt: Prompt, *, tools: list[dict] | None = None) -> list[int]:
        """Raw text, token ids, or chat messages (the model's chat template applied, given
        `tools` when there are some)."""
        if isinstance(prompt, str):
            self._check_tokenizer()
            return list(self.tokenizer(prompt).input_ids)
        if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            self._check_tokenizer()
            self.check_chat_template()
            kwargs = {"tools": tools} if tools else {}
            text = self.tokenizer.apply_chat_template(prompt, tokenize=False,
                                                      add_generation_prompt=True, **kwargs)
            return list(self.tokenizer(text, add_special_tokens=False).input_ids)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                            for t in prompt):
            vocab = self.loaded.config.vocab_size
            if any(not 0 <= t < vocab for t in prompt):
                raise InvalidParamsError(f"token ids must lie in [0, {vocab})")
            return list(prompt)
        raise InvalidParamsError("a prompt is a string, a list of token ids or chat messages")

    def _check_tokenizer(self) -> None:
        """InvalidParamsError for text when the model has no tokenizer (its file's could not be
        built): token ids still work."""
        if self.tokenizer is None:
            raise InvalidParamsError(f"{self.model_name} has no tokenizer (its file's could not be "
                                     "built): send token ids")

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def check_chat_template(self) -> None:
        """InvalidParamsError unless the tokenizer can render chat messages (a base model's file,
        e.g. Gemma 3 270M, has no template: its prompts are plain text)."""
        if not self.has_chat_template:
            err = InvalidParamsError(
                f"{self.model_name} has no chat template: send plain text (a completion prompt)")
            err.param = "messages"  # type: ignore[attr-defined]
            raise err

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        tenant: str | None = None,
    ) -> None:
        """Queue a request. Raises (and adds nothing) on bad input or a request that can never
        fit: prompt + max_tokens over the context or the whole cache. `tenant` (the server's
        API key identity) is who the scheduler's fair shares count it for."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidParamsError("params must be a SamplingParams")
        if request_id in self.requests:
            raise InvalidParamsError(f"request id {request_id!r} is already in use")
        params.check_vocab(self.loaded.config.vocab_size)
        spec = params.structured_outputs
        grammar = None if spec is None else self.grammars.compile(spec)  # GrammarError: 400
        ids = self.tokenize(prompt)
        if not ids:
            raise InvalidParamsError("the prompt is empty")
        shift = self.context_shift
        if len(ids) > self.max_prompt_len:
            raise RequestTooLongError(
                f"prompt of {len(ids)} tokens leaves no room in a context of {self.max_model_len}"
                if shift is None else
                f"prompt of {len(ids)} tokens is over the context-shift limit of "
                f"{self.max_prompt_len}"
            )
        capacity = self.cache.token_capacity
        if shift is None and min(len(ids) + params.max_tokens, self.max_model_len) > capacity:
            raise RequestTooLongError(
                f"prompt ({len(ids)}) + max_tokens ({params.max_tokens}) exceeds the KV cache "
                f"({capacity} tokens)"
            )
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_ids
        req = Request(request_id, ids, params, prompt if isinstance(prompt, str) else None,
                      cache_salt=cache_salt, stop_ids=stop_ids, grammar=grammar,
                      tenant=tenant, speculate=self.spec is not None and grammar is None)
        req.seqs.append(self.new_sequence(req, 0, list(ids)))
        if shift is not None:
            shift.cut_prompt(req.seqs[0], self.max_model_len)
        self.requests[request_id] = req
        self.scheduler.add(req.seqs[0])
        self._prompt_tokens += len(ids)

    def new_sequence(self, req: Request, index: int, token_ids: list[int]) -> Sequence:
        """Sample `index` of `req` over `token_ids` (not queued: see add_sequence / fork_sequence),
        with its seeded generator and logprob list as the request's params ask."""
        s = Sequence(next(self._seq_ids), req, index, token_ids)
        if req.params.seed is not None:
            s.generator = generator_for(req.params.seed, index)
        if req.params.logprobs is not None:
            s.logprobs = []
        if req.grammar is not None:  # a fresh matcher: s has no output yet
            s.grammar = req.grammar.matcher()
        return s

    def add_sequence(self, s: Sequence) -> None:
        """Queue a sequence made by new_sequence for prefill (beam search's entry; requests go
        through add_request)."""
        self.scheduler.add(s)

    def fork_sequence(self, parent: Sequence, child: Sequence) -> int:
        """child (a copy of parent's tokens) shares parent's blocks and runs; returns the blocks
        shared."""
        return self.scheduler.fork(parent, child)

    def finish_sequence(self, s: Sequence, reason: str) -> None:
        """End s now (its blocks go back at once); a finished sequence is left as it is."""
        if not s.finished:
            self.scheduler.finish(s, reason)

    def block_ids(self, s: Sequence) -> list[int] | None:
        """The KV blocks s holds, or None while it is not admitted."""
        return self.cache.block_ids(s.seq_id) if s.seq_id in self.cache else None

    def tier_reads_pending(self) -> bool:
        """Some waiting prompt is held for a KV tier read still in progress (forward() may
        then schedule nothing; calling it again waits on the read, up to its deadline)."""
        return bool(self.scheduler.tier_reads.pending())

    def is_idle(self) -> bool:
        """No request, and nothing queued or running in the scheduler."""
        return not self.requests and not self.scheduler.running and not self.scheduler.waiting

    def abort_request(self, request_id: str) -> None:
        """Drop a request now; its blocks go back to the pool at once. Unknown ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for s in req.seqs:
            if not s.finished:
                self.scheduler.finish(s, "abort")
        req.finish_time = time.monotonic()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # --- one step -----------------------------------------------------------------------------

    def forward(self, masks: bool = False, speculate: bool = False, greedy: bool = False) -> Forward | None:
        """The one step primitive, shared by step() and beam search: schedule -> run the plan ->
        commit (or undo and re-raise) -> tier writes -> timing. None when nothing could be
        scheduled. `masks` (step()'s): the sampler's grammar masks for the plan are computed
        on its worker while the forward pass runs, where `grammar_mask_overlap` says so.

        On return the step's K/V are written and its newly full blocks hashed and offered to the
        KV tier; row i of the logits samples for `plan.samplers[i]`. If the forward pass raises,
        the step's sequences go back to the queue with nothing of this step cached (no prefix
        hash over unwritten K/V), and the error propagates. `speculate` (step() only, with
        speculative decoding on): decoding sequences may verify drafts (`plan.drafts`); the
        caller must then hand every verifying sequence's tokens to `Scheduler.accept`.
        `greedy` (step()'s, whose sampler takes each greedy row's argmax): with greedy_head
        "screen", those rows' logits are the screened ones (greedy_rows).
        """
        t0 = time.perf_counter()
        sched = self.scheduler
        plan = sched.schedule(speculate)
        if plan.empty and sched.tier_reads.pending():
            # nothing runs: wait on the tier reads (once, up to the earliest deadline, so the
            # caller's loop still sees new requests) instead of spinning
            sched.tier_reads.wait()
            plan = sched.schedule(speculate)
        if plan.empty:
            return None
        tf = time.perf_counter()
        if masks and self._overlap_masks():
            self.sampler.prefetch(plan.samplers)
        if self.before_forward is not None:
            self.before_forward()
        if greedy:
            plan.greedy = self._greedy_rows(plan)
        try:
            logits = self.runner.run(plan)
        except BaseException:
            sched.undo(plan)
            raise
        dt = time.perf_counter() - tf
        self._forward_s += dt
        sched.commit(plan)
        self.tiers.after_step()  # blocks that became full this step go to the KV tier
        if self.kv_events is not None:
            self.kv_events.after_step()  # the step's stored / removed blocks, one batch
        self._busy_s += time.perf_counter() - t0
        return Forward(plan, logits, getattr(self.runner, "greedy_tokens", None) if greedy else None)

    @staticmethod
    def _greedy_rows(plan: StepPlan) -> tuple[torch.Tensor, bool] | None:
        """(the logits rows of greedy samplers whose token is the argmax of their raw logits,
        whether every row is one that reads no other logit) for the model's greedy head
        (greedy_head.py), or None when no row is."""
        kinds = [greedy_kind(s) for s in plan.samplers]
        if not any(kinds):
            return None
        rows: list[int] = []
        r = 0
        for i, k in enumerate(kinds):
            n = 1 + (len(plan.drafts[i]) if plan.drafts else 0)
            if k:
                rows.extend(range(r, r + n))
            r += n
        return torch.tensor(rows, dtype=torch.int64), all(k == ARGMAX_ONLY for k in kinds)

    def step(self) -> list[RequestOutput]:
        """One forward pass (`forward`), then sample, append, finish and detokenize; return the
        requests that progressed. With speculative decoding a decode-only step's whole seconds
        feed the policy's cost fit (`SpecDecoder.observe_step`)."""
        ts = time.perf_counter()
        done = self.forward(masks=True, speculate=self.spec is not None,
                            greedy=self.config.greedy_head == "screen")
        if done is None:
            return []
        outs = self._step_verified(done) if done.plan.drafts else self._step_sampled(done)
        if self.spec is not None and not done.plan.prefills:
            self.spec.observe_step(done.plan, time.perf_counter() - ts)
        return outs

    def _step_sampled(self, done: Forward) -> list[RequestOutput]:
        """step() after a plain forward pass: one token per sampler (n > 1 forks here)."""
        t0 = time.perf_counter()
        logits = done.logits
        seqs = done.plan.samplers
        tokens = self.sampler(logits, seqs, done.greedy_tokens)
        rows = list(range(len(seqs)))
        for row, s in enumerate(done.plan.samplers):
            if s.request.params.n > 1 and not s.request.forked:
                seqs, tokens, rows = self._fork_samples(s, logits[row], row, seqs, tokens, rows)
        self._accept_grammar(seqs, tokens)
        self.scheduler.postprocess(seqs, tokens)
        self._finish_grammar(seqs, tokens)
        if self.kv_events is not None:
            self.kv_events.after_step()  # hashes a context shift dropped
        touched: dict[str, Request] = {}
        now = time.monotonic()
        for s, row, tok in zip(seqs, rows, tokens, strict=True):
            req = s.request
            touched[req.request_id] = req
            if tok == FAILED:  # this row could not be sampled: its sequence ended alone
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            if s.logprobs is not None:
                s.logprobs.append(top_logprobs(logits[row], s.token_ids[-1], req.params.logprobs or 0))
            self._detokenize(s)
        self._gen_tokens += sum(t != FAILED for t in tokens)
        return self._end_step(touched, now, t0)

    def _step_verified(self, done: Forward) -> list[RequestOutput]:
        """step() after a speculative forward pass: each sampler's tokens (accepted drafts +
        one, `Sampler.verify`) go through the same path as decoded ones, one token per round
        (postprocess: stop ids, max_tokens; logprobs; detokenizing, stop strings), so a
        sequence that finishes at its j-th token never sees the rest; then the accepted
        drafts' lookahead slots become the running sequences' cached tokens."""
        t0 = time.perf_counter()
        plan, logits = done.plan, done.logits
        firsts = plan.first_rows()
        lists = self.sampler.verify(logits, plan.samplers, plan.drafts,
                                    self.spec.draft_probs(plan.samplers, plan.drafts),  # type: ignore[union-attr]
                                    done.greedy_tokens)
        entries = list(zip(plan.samplers, lists, firsts, plan.drafts, strict=True))
        for s, _toks, r, _ in list(entries):
            if s.request.params.n > 1 and not s.request.forked:  # a prompt's end (no drafts)
                kids, ktoks, _ = self._fork_samples(s, logits[r], r, [], [], [])
                entries.extend((k, [t], r, []) for k, t in zip(kids, ktoks, strict=True))
        touched: dict[str, Request] = {}
        now = time.monotonic()
        appended = [0] * len(entries)
        for j in range(max(len(e[1]) for e in entries)):
            live = [i for i, e in enumerate(entries) if j < len(e[1]) and not e[0].finished]
            if not live:
                break
            seqs = [entries[i][0] for i in live]
            tokens = [entries[i][1][j] for i in live]
            self._accept_grammar(seqs, tokens)
            self.scheduler.postprocess(seqs, tokens)
            self._finish_grammar(seqs, tokens)
            for i, s, tok in zip(live, seqs, tokens, strict=True):
                req = s.request
                touched[req.request_id] = req
                if tok == FAILED:
                    continue
                appended[i] += 1
                if req.first_token_time is None:
                    req.first_token_time = now
                if s.logprobs is not None:
                    s.logprobs.append(top_logprobs(logits[entries[i][2] + j], tok,
                                                   req.params.logprobs or 0))
                self._detokenize(s)
        spec = self.spec
        for (s, toks, _, d), n in zip(entries, appended, strict=True):
            if d:
                spec.observe(s, len(d), len(toks) - 1)  # type: ignore[union-attr]
                if s.status is Status.RUNNING:
                    self.scheduler.accept(s, len(d), n)
        self._gen_tokens += sum(appended)
        return self._end_step(touched, now, t0)

    def _end_step(self, touched: dict[str, Request], now: float, t0: float) -> list[RequestOutput]:
        """The step's tail: finished requests leave, every touched one reports its output."""
        for r in touched.values():
            if r.finished:
                r.finish_time = now
                self.requests.pop(r.request_id, None)
                self._finished += 1
        outs = [self._output(r) for r in touched.values()]
        self._busy_s += time.perf_counter() - t0
        return outs

    @staticmethod
    def _accept_grammar(seqs: list[Sequence], tokens: list[int]) -> None:
        """Each constrained sequence's matcher consumes its token; a token it refuses (only a
        matcher in its error state lets one through the mask) fails that row alone."""
        for i, s in enumerate(seqs):
            g = s.grammar
            if g is not None and tokens[i] != FAILED and not g.accept(tokens[i]):
                tokens[i] = FAILED

    def _finish_grammar(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """A constrained sequence whose grammar is complete (only EOS could follow) stops now,
        without spending a step on the EOS."""
        for s, tok in zip(seqs, tokens, strict=True):
            if s.grammar is not None and tok != FAILED and not s.finished and s.grammar.stopped:
                self.scheduler.finish(s, "stop")

    def _fork_samples(
        self, parent: Sequence, row: torch.Tensor, r: int,
        seqs: list[Sequence], tokens: list[int], rows: list[int],
    ) -> tuple[list[Sequence], list[int], list[int]]:
        """n > 1: the other samples share the prompt's blocks (copy-on-write) and each draw their
        first token from the same logits."""
        req = parent.request
        req.forked = True
        seqs, tokens, rows = list(seqs), list(tokens), list(rows)
        for i in range(1, req.params.n):
            child = self.new_sequence(req, i, list(parent.token_ids))
            self._fork_shared += self.fork_sequence(parent, child)
            req.seqs.append(child)
            seqs.append(child)
            tokens.append(self.sampler(row[None], [child])[0])
            rows.append(r)
        return seqs, tokens, rows

    def _detokenize(self, s: Sequence) -> None:
        """Extend the text by the new token's; a stop string cuts it and finishes the sequence."""
        final = s.finish_reason is not None
        old = len(s.text)
        s.text += s.detok.step(self.tokenizer, s.token_ids, final)  # type: ignore[union-attr]
        p = s.request.params
        stops = p.stop
        if stops and len(s.token_ids) - s.num_prompt >= p.min_tokens:
            cut = find_stop(s.text, stops, old)
            if cut is not None:
                s.text = s.text[:cut]
                if s.status is Status.FINISHED:
                    s.finish_reason = "stop"
                else:
                    self.scheduler.finish(s, "stop")

    def _output(self, r: Request) -> RequestOutput:
        outs = [CompletionOutput(s.index, s.text, s.output_ids, s.finish_reason,  # a new list
                                 None if s.logprobs is None else list(s.logprobs))
                for s in r.seqs]
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, outs,
                             r.finish_time is not None, r.num_cached_tokens, r.arrival_time,
                             r.first_token_time, r.finish_time, r.num_tier_cached_tokens,
                             r.num_draft_tokens, r.num_accepted_tokens)

    # --- KV tier and snapshots ----------------------------------------------------------------

    def tier_stats(self) -> dict[str, float] | None:
        """The KV tier's counters (None without a tier)."""
        out = self.tiers.stats()
        if out is not None:
            out["read_timeouts"] = self.scheduler.tier_reads.timeouts
        return out

    def reset_prefix_cache(self, tier: bool = False) -> dict[str, int]:
        """Empty the device prefix cache (blocks in use keep serving), and the tier if asked."""
        before = len(self.cache.cached_blocks())
        self.cache.reset_prefix_cache()
        if self.spec is not None:
            self.spec.reset()
        out = {"device_blocks": before, "tier_blocks": self.tiers.clear() if tier else 0}
        if self.kv_events is not None:
            if tier:
                self.kv_events.cleared()
            else:
                self.kv_events.after_step()
        return out

    def snapshot(self) -> int:
        """Write every prefix-cached block to the --kv-snapshot directory (blocks written)."""
        return self.tiers.snapshot_now()

    def close(self) -> None:
        """Finish queued tier writes and release the tier and the event publisher, stop the
        mask worker (idempotent)."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        self.tiers.close()
        self.sampler.close()

    def _overlap_masks(self) -> bool:
        """grammar_mask_overlap: on; auto: only while a CPU is left beside the torch threads
        (on 2 cores the worker slows the forward pass more than it saves: measured)."""
        mode = self.config.grammar_mask_overlap
        return mode == "on" or (mode == "auto" and self._cpus > torch.get_num_threads())

    # --- stats --------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        c = self.cache.stats()
        inflight = self.scheduler.inflight
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_usage=c.usage,
            num_blocks=c.num_blocks,
            blocks_used=c.used_blocks,
            blocks_cached=c.cached_blocks,
            blocks_free=c.free_blocks,
            prefix_cache_queries=c.prefix_queries,
            prefix_cache_hits=c.prefix_hits,
            prefix_hit_rate=c.prefix_hit_rate,
            prefix_cache_partial_hits=c.partial_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_requests_finished=self._finished,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._gen_tokens,
            cow_copies=c.cow_copies,
            fork_shared_blocks=self._fork_shared,
            fork_saved_bytes=self._fork_shared * self.storage.bytes_per_block,
            gen_tokens_per_s=self._gen_tokens / self._busy_s if self._busy_s else 0.0,
            evictions=c.evictions,
            step_seconds=self._busy_s,
            forward_seconds=self._forward_s,
            overhead_share=1 - self._forward_s / self._busy_s if self._busy_s else 0.0,
            dedup_requests_held=inflight.requests_held if inflight else 0,
            dedup_tokens_saved=inflight.tokens_saved if inflight else 0,
            context_shifts=self.scheduler.num_context_shifts,
            fair_preemptions=self.scheduler.num_fair_preemptions,
            **self._kv_event_counts(),
            **(self.spec.stats() if self.spec is not None else {}),
        )

    def _kv_event_counts(self) -> dict[str, int]:
        if self.kv_events is None:
            return {}
        st = self.kv_events.stats()
        return {"kv_events_published": st["events_published"],
                "kv_events_dropped": st["events_dropped"]}


class LLM:
    """Offline batch generation: `LLM(model).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: object = None, *, config: EngineConfig | None = None,
                 **options: Any) -> None:
        """The same arguments as LLMEngine: EngineConfig's fields as keywords, or a config."""
        self.engine = LLMEngine(model, config=config, **options)
        self._ids = itertools.count()

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        use_tqdm: bool | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order."""
        plist = _as_prompt_list(prompts)
        params = sampling_params or SamplingParams()
        plist_params = list(params) if isinstance(params, list | tuple) else [params] * len(plist)
        if len(plist_params) != len(plist):
            raise InvalidParamsError("one SamplingParams per prompt, or a single one for all")
        ids = [f"gen-{next(self._ids)}" for _ in plist]
        try:
            for rid, p, sp in zip(ids, plist, plist_params, strict=True):
                self.engine.add_request(rid, p, sp)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(
        self,
        prompts: Prompt | Seq[Prompt],
        params: BeamSearchParams,
        *,
        on_step: Callable[[BeamStepStats], None] | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`): one output per prompt, beams best first.
        Beams are forks sharing blocks; see `engine/beam_search.py`. `on_step` sees the KV
        blocks the beams hold after every step."""
        ids = [self.engine.tokenize(p) for p in _as_prompt_list(prompts)]
        if not all(ids):
            raise InvalidParamsError("the prompt is empty")
        return BeamSearch(self.engine, params, on_step).run(ids)

    def _run(self, ids: list[str], use_tqdm: bool | None) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        show = sys.stderr.isatty() if use_tqdm is None else use_tqdm
        bar = None
        if show:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generate", unit="req")
        while len(done) < len(ids):
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [done[i] for i in ids]


def _as_prompt_list(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    if isinstance(prompts, list) and prompts and all(isinstance(m, dict) for m in prompts):
        return [prompts]  # one chat
    if not isinstance(prompts, list | tuple) or not prompts:
        raise InvalidParamsError("prompts must be a prompt or a non-empty list of prompts")
    return list(prompts)


__all__ = ["LLM", "EngineConfig", "EngineStats", "LLMEngine", "Status", "parse_size"]
