"""Requests and their sequences (one sequence per parallel sample)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pagedkv.cache.hashing import HashChain
from pagedkv.engine.detokenizer import IncrementalDetokenizer
from pagedkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedkv.engine.spec_decode import SeqSpec
    from pagedkv.engine.structured import CompiledGrammar, GrammarMatcher


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens. `token_ids` = prompt + generated, owned here (the cache never sees
    this list). `chain` (with prefix caching; the scheduler builds it at `add`) is the context's
    ids and their block hashes, grown by `append` (each block hashed once, when it fills); the
    cache reads it for prefix lookups and hashes, and applies its context edits to it, so
    `len(chain) == num_ctx`. `num_scheduled`: context tokens scheduled for computation (a step's
    K/V are written by the end of that step; the cache counts written ones, `num_written`). In
    decode, exactly the newest token is not scheduled yet."""

    seq_id: int
    request: Request
    index: int  # sample index within the request (0..n-1)
    token_ids: list[int]
    num_scheduled: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    text: str = ""
    logprobs: list[dict[int, float]] | None = None
    generator: torch.Generator | None = None
    detok: IncrementalDetokenizer | None = None  # text of the output so far, step by step
    # context shift: the cache holds token_ids[:n_keep] + token_ids[n_keep + n_dropped:]
    n_keep: int = 0
    n_dropped: int = 0
    chain: HashChain | None = None  # the context's ids and block hashes (prefix caching)
    grammar: GrammarMatcher | None = None  # structured outputs: has consumed output_ids
    spec: SeqSpec | None = None  # speculative decoding: its n-gram index and acceptance

    def __post_init__(self) -> None:
        if self.detok is None:
            self.detok = IncrementalDetokenizer.at(len(self.token_ids))

    @property
    def num_prompt(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt :]

    @property
    def num_ctx(self) -> int:
        """Tokens in the context (the cache's view): all of them unless a context shift
        dropped some."""
        return len(self.token_ids) - self.n_dropped

    def ctx_ids(self, start: int, end: int) -> list[int]:
        """Token ids at context positions [start, end)."""
        if not self.n_dropped:
            return self.token_ids[start:end]
        k, d = self.n_keep, self.n_dropped
        return self.token_ids[min(start, k) : min(end, k)] + self.token_ids[max(start, k) + d : end + d]

    def append(self, tok: int) -> None:
        self.token_ids.append(tok)
        c = self.chain
        if c is not None:  # HashChain.append, inlined (once per token of every sequence)
            ids = c.ids
            ids.append(tok)
            if len(ids) % c.block_size == 0:
                c.rehash()

    @property
    def is_prefill(self) -> bool:
        return self.num_scheduled < self.num_ctx - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from a cache (device or tier)
    num_tier_cached_tokens: int = 0  # of those, the ones loaded from the KV tier
    forked: bool = False  # n > 1: samples forked off the first sequence after its prefill
    cache_salt: str | None = None  # prefix-cache extra key: tenants never share blocks
    stop_ids: frozenset[int] = frozenset()  # token ids that finish a sequence (eos + stop ids)
    grammar: CompiledGrammar | None = None  # structured outputs: each sample's matcher's source
    tenant: str | None = None  # who submitted it (the server's API key identity): fair shares
    fair_share: bool = True  # False: never preempted for another request's share (beam search)
    speculate: bool = False  # its sequences may verify draft tokens (add_request, spec on)
    num_draft_tokens: int = 0  # drafts its sequences verified
    num_accepted_tokens: int = 0  # of those, the ones the target agreed with

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs) and (self.forked or self.params.n == 1)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # None while running, then "stop" | "length" | "abort" | "error"
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    arrival_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    num_tier_cached_tokens: int = 0  # of num_cached_tokens, loaded from the KV tier
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request
    num_accepted_tokens: int = 0  # of those, accepted

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason
