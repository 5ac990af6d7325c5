"""The asyncio end of one engine request: a bounded queue of deltas.

The engine thread turns each step's cumulative RequestOutput into a delta (only the text,
token ids and logprobs that are new since the previous update) and hands it to the request's
RequestStream on the event loop. So a queued update costs what it adds, not the whole answer
so far; and the queue is bounded: a client that falls more than `limit` updates behind is
aborted by the engine thread (its KV blocks are freed at once) and its connection dropped.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.errors import PagedKVError


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, stopped, or crashed)."""


class ShuttingDownError(EngineDeadError):
    """The server is shutting down; requests still in flight are ended with a 503."""


class ClientTooSlowError(PagedKVError, RuntimeError):
    """The client fell too far behind its stream: the request was aborted."""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the top alternatives, tokens already decoded."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Choice:
    """One choice's output: in an Update, only what is new since the previous update; in
    `Accumulator.final()`, all of it."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Update:
    """What one engine step added to a request (choices with nothing new are left out)."""

    choices: tuple[Choice, ...]
    finished: bool
    prompt_tokens: int
    cached_tokens: int
    tier_cached_tokens: int = 0  # of cached_tokens, loaded from the KV tier
    draft_tokens: int = 0  # speculative decoding: drafts verified for the request so far
    accepted_tokens: int = 0  # of those, accepted


@dataclass
class _Sent:
    """Engine-thread bookkeeping: how much of one choice earlier deltas carried."""

    chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    done: bool = False


class RequestStream:
    """Deltas of one request, in order. `get` runs on the event loop; `delta` on the engine
    thread. `queued` (engine thread) and `taken` (event loop) only ever grow, so their
    difference is a safe backlog estimate from either side."""

    def __init__(self, request_id: str, *, holdback: int = 0, limit: int = 256) -> None:
        self.request_id = request_id
        self.holdback = holdback  # chars kept back until a choice ends (stop strings)
        self.limit = limit
        self.prompt_tokens = 0
        self.finished = False
        self.queued = 0
        self.taken = 0
        self.on_drop: Callable[[], None] | None = None  # set by the server: drop the client
        self.tenant: str | None = None  # the submitter's tenant id, as the server's guard saw it
        self._items: collections.deque[Update | BaseException] = collections.deque()
        self._waiter: Any = None  # asyncio.Future while get() waits
        self._sent: dict[int, _Sent] = {}  # engine thread only

    # --- event loop -----------------------------------------------------------------------

    def _put(self, item: Update | BaseException) -> None:
        self._items.append(item)
        if isinstance(item, ClientTooSlowError) and self.on_drop is not None:
            self.on_drop()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def get(self) -> Update:
        """The next delta; raises the request's error (once) if it failed."""
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        self.taken += 1
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    # --- engine thread --------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        return self.queued - self.taken

    def delta(self, out: Any, tokenizer: Any) -> Update:
        """What `out` (cumulative) adds to the earlier deltas. Holds back the last
        `holdback` characters of a running choice: the engine strips a matched stop string
        from the text, and text already sent cannot be taken back."""
        choices = []
        for c in out.outputs:
            sent = self._sent.get(c.index)
            first = sent is None
            if sent is None:
                sent = self._sent[c.index] = _Sent()
            if sent.done:
                continue
            end = len(c.text)
            if c.finish_reason is None:
                end = max(sent.chars, end - self.holdback)
            text = c.text[sent.chars:end]
            ids = tuple(c.token_ids[sent.tokens:])
            logprobs = self._new_logprobs(c, sent, tokenizer)
            sent.chars, sent.tokens = max(sent.chars, end), len(c.token_ids)
            sent.done = c.finish_reason is not None
            if first or text or ids or sent.done:
                choices.append(Choice(c.index, text, ids, c.finish_reason, logprobs))
        return Update(tuple(choices), bool(out.finished), len(out.prompt_token_ids),
                      int(out.num_cached_tokens), int(getattr(out, "num_tier_cached_tokens", 0)),
                      int(getattr(out, "num_draft_tokens", 0)),
                      int(getattr(out, "num_accepted_tokens", 0)))

    def _new_logprobs(self, c: Any, sent: _Sent, tokenizer: Any) -> tuple[TokenLogprob, ...] | None:
        raw = getattr(c, "logprobs", None)
        if raw is None:
            return None
        new = []
        for tok, entry in zip(c.token_ids[sent.logprobs:], raw[sent.logprobs:], strict=False):
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            new.append(TokenLogprob(
                tokenizer.decode([tok]), _finite(entry.get(tok, -math.inf)),
                tuple((tokenizer.decode([t]), _finite(lp)) for t, lp in top),
            ))
        sent.logprobs += len(new)
        return tuple(new)


def _finite(logprob: float) -> float:
    # JSON has no -inf/NaN (Starlette refuses to encode them); OpenAI clamps the same way.
    x = float(logprob)
    return max(x, -9999.0) if x == x else -9999.0


@dataclass
class _Acc:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None


class Accumulator:
    """Joins a request's deltas back into its whole output (non-streamed responses)."""

    def __init__(self) -> None:
        self._choices: dict[int, _Acc] = {}
        self.last: Update | None = None

    def add(self, update: Update) -> None:
        self.last = update
        for c in update.choices:
            acc = self._choices.setdefault(c.index, _Acc())
            acc.text.append(c.text)
            acc.token_ids.extend(c.token_ids)
            if c.logprobs is not None:
                acc.logprobs = (acc.logprobs or []) + list(c.logprobs)
            acc.finish_reason = c.finish_reason or acc.finish_reason

    def final(self) -> Update:
        assert self.last is not None, "no update yet"
        choices = tuple(
            Choice(i, "".join(a.text), tuple(a.token_ids), a.finish_reason,
                   None if a.logprobs is None else tuple(a.logprobs))
            for i, a in sorted(self._choices.items())
        )
        last = self.last
        return Update(choices, last.finished, last.prompt_tokens, last.cached_tokens,
                      last.tier_cached_tokens, last.draft_tokens, last.accepted_tokens)
