"""Runs the (synchronous, single-threaded) LLMEngine on a background thread for asyncio.

The engine is not thread-safe, so the engine thread is the only one that ever touches it:
the asyncio side posts commands (add, abort, read stats...) that the thread applies between
two steps, and the thread hands each step's outputs back to the event loop in one
`call_soon_threadsafe` batch. When no request is unfinished the thread blocks on an Event.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pagedkv.errors import RequestTooLongError

logger = logging.getLogger("pagedkv.server")

T = TypeVar("T")
Prompt = str | list[int] | list[dict[str, Any]]


class EngineDeadError(RuntimeError):
    """The engine thread is not running (never started, stopped, or crashed)."""


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's logprob and the top alternatives, tokens already decoded."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class Choice:
    """An immutable copy of one CompletionOutput, safe to read from the event loop."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class Update:
    """The cumulative state of one request after an engine step."""

    choices: tuple[Choice, ...]
    finished: bool
    prompt_tokens: int
    cached_tokens: int


class RequestStream:
    """The asyncio end of one request: awaits the engine's cumulative updates."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.prompt_tokens = 0
        self.finished = False
        self._queue: asyncio.Queue[Update | BaseException] = asyncio.Queue()
        self._logprobs: dict[int, list[TokenLogprob]] = {}  # engine thread only

    def _put(self, item: Update | BaseException) -> None:
        self._queue.put_nowait(item)

    async def get(self) -> Update:
        """The newest update; older ones still queued are skipped (updates are cumulative)."""
        items = [await self._queue.get()]
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        for item in items:
            if isinstance(item, BaseException):
                self.finished = True
                raise item
        latest = items[-1]
        assert isinstance(latest, Update)
        self.finished = latest.finished
        return latest

    async def __aiter__(self) -> AsyncIterator[Update]:
        while not self.finished:
            yield await self.get()

    def _snapshot(self, out: Any, tokenizer: Any) -> Update:
        """Runs on the engine thread: copies what the engine keeps mutating, and decodes
        logprob tokens here because the tokenizer must stay on this thread."""
        choices = tuple(
            Choice(c.index, c.text, tuple(c.token_ids), c.finish_reason,
                   self._decode_logprobs(c, tokenizer))
            for c in out.outputs
        )
        return Update(choices, bool(out.finished), len(out.prompt_token_ids), out.num_cached_tokens)

    def _decode_logprobs(self, c: Any, tokenizer: Any) -> tuple[TokenLogprob, ...] | None:
        raw = getattr(c, "logprobs", None)
        if raw is None:
            return None
        done = self._logprobs.setdefault(c.index, [])
        for tok, entry in zip(c.token_ids[len(done):], raw[len(done):], strict=False):
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            done.append(TokenLogprob(
                tokenizer.decode([tok]), _finite(entry.get(tok, -math.inf)),
                tuple((tokenizer.decode([t]), _finite(lp)) for t, lp in top),
            ))
        return tuple(done)


def _finite(logprob: float) -> float:
    # JSON has no -inf/NaN (Starlette refuses to encode them); OpenAI clamps the same way.
    x = float(logprob)
    return max(x, -9999.0) if x == x else -9999.0


class AsyncEngine:
    """Owns the engine thread. `start` must be called from the event loop that will consume
    the outputs; `stop` may be called from any thread."""

    def __init__(self, engine: Any, *, max_prompt_tokens: int | None = None) -> None:
        self.engine = engine
        self.max_prompt_tokens = max_prompt_tokens
        self._commands: collections.deque[tuple[Callable[[Any], Any], concurrent.futures.Future]]
        self._commands = collections.deque()
        self._wake = threading.Event()
        self._stopping = False
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # --- event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts whatever is still in flight and joins the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._fail_commands()  # posted while the thread was exiting

    def _fail_commands(self) -> None:
        while self._commands:
            _, fut = self._commands.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineDeadError("the server is shutting down"))

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Runs fn(engine) on the engine thread between two steps."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.is_alive:
            fut.set_exception(EngineDeadError("the engine is not running"))
            return fut
        self._commands.append((fn, fut))
        self._wake.set()
        return fut

    async def call(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    async def add(
        self, request_id: str, prompt: Prompt, make_params: Callable[[int], Any]
    ) -> RequestStream:
        """Adds a request; make_params(prompt_len) builds its SamplingParams. Errors from the
        engine (InvalidParamsError, RequestTooLongError) are raised here, before any output."""
        stream = RequestStream(request_id)
        await self.call(lambda engine: self._add_on_thread(engine, stream, prompt, make_params))
        return stream

    def abort(self, request_id: str) -> None:
        """Fire-and-forget abort; frees the request's KV blocks at the next step boundary."""
        if self.is_alive:
            self.submit(lambda engine: self._abort_on_thread(engine, request_id))

    # --- engine thread -----------------------------------------------------------------------

    def _add_on_thread(
        self, engine: Any, stream: RequestStream, prompt: Prompt, make_params: Callable
    ) -> None:
        # Tokenized here once (the engine takes the ids) so the limits below see the exact
        # count the engine will use.
        ids = list(engine.tokenize(prompt))
        n, context = len(ids), engine.max_model_len
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise RequestTooLongError(
                f"prompt has {n} tokens, over this server's limit of {self.max_prompt_tokens}"
            )
        if n >= context:
            raise RequestTooLongError(f"prompt has {n} tokens; the model's context is {context}")
        params = make_params(n)
        if n + params.max_tokens > context:
            raise RequestTooLongError(
                f"this model's context is {context} tokens, but the prompt ({n}) + max_tokens "
                f"({params.max_tokens}) would need {n + params.max_tokens}"
            )
        engine.add_request(stream.request_id, ids, params)
        stream.prompt_tokens = n
        self._streams[stream.request_id] = stream

    def _abort_on_thread(self, engine: Any, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            engine.abort_request(request_id)

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wake.wait()
                    self._wake.clear()
        except BaseException:
            logger.exception("engine thread crashed")
        finally:
            self._shutdown_on_thread()

    def _run_commands(self) -> None:
        while self._commands:
            fn, fut = self._commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller, not raised here
                fut.set_exception(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # Fail the requests in flight rather than the server; the next request gets a
            # fresh chance.
            logger.exception("engine step failed")
            self._fail_all(exc)
            return
        batch: list[tuple[RequestStream, Update | BaseException]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted by its client in the meantime
            if out.finished:
                del self._streams[out.request_id]
            batch.append((stream, stream._snapshot(out, self.engine.tokenizer)))
        self._dispatch(batch)

    def _fail_all(self, exc: BaseException) -> None:
        batch: list[tuple[RequestStream, Update | BaseException]] = []
        for rid, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of %s failed", rid)
            batch.append((stream, exc))
        self._streams.clear()
        self._dispatch(batch)

    def _shutdown_on_thread(self) -> None:
        self._stopping = True
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._fail_commands()

    def _dispatch(self, batch: list[tuple[RequestStream, Update | BaseException]]) -> None:
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is already closed: nobody is listening
            pass


def _deliver(batch: list[tuple[RequestStream, Update | BaseException]]) -> None:
    for stream, item in batch:
        stream._put(item)
