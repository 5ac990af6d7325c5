"""Runs the (synchronous, single-threaded) LLMEngine on a background thread for asyncio.

The engine is not thread-safe, so the engine thread is the only one that ever steps it or
changes its requests: the asyncio side posts commands (add, abort, read stats...) that the
thread applies between two steps, and the thread hands each step's deltas back to the event
loop in one `call_soon_threadsafe` batch. When no request is unfinished the thread blocks on
an Event.

A step's batch is handed over when the next step's forward pass starts (the engine's
`before_forward` hook), or at once when no forward follows (nothing left to step, or a step
that ran none). Handed over right after the step, the event loop's wake-up took the GIL while
the engine thread went on in Python, which then waited for the loop's whole burst (SSE framing,
the socket write): ~0.6 ms a token, measured; started beside the forward pass, the loop's work
runs while the pass's kernels leave the GIL free.

Invariants:
- Only the engine thread runs torch work while serving: the threads that built the AsyncEngine
  and started it release their OpenMP worker teams (`openmp.release_team`), since a second
  team on a small machine makes every decode step wait on sleeping workers (about 2x slower).
- Tokenization and chat templates run on a separate preprocessing thread, never on the
  engine thread: one client's huge prompt never delays another client's next token.
- One request's failure never fails another: a `RequestFailedError` from the engine, or an
  exception while building one request's delta, ends that request alone. Only an exception
  the engine cannot attribute fails the whole batch (its state is unknown then).
- The loop survives exceptions anywhere in an iteration; after MAX_CONSECUTIVE_FAILURES in a
  row it gives up and the thread ends, and `is_alive` (hence /health) turns false.
- Once the thread has started shutting down, `submit` fails at once (checked under the same
  lock the thread takes to close the queue), so nobody waits on a command never run.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pagedkv.errors import RequestFailedError, RequestTooLongError
from pagedkv.server.config import ServerConfig
from pagedkv.server.openmp import release_team
from pagedkv.server.prep_queue import FairQueue
from pagedkv.server.stream import (
    Choice,
    ClientTooSlowError,
    EngineDeadError,
    RequestStream,
    ShuttingDownError,
    TokenLogprob,
    Update,
)
from pagedkv.server.tools import ToolChat

__all__ = ["AsyncEngine", "Choice", "ClientTooSlowError", "EngineDeadError", "RequestStream",
           "ShuttingDownError", "TokenLogprob", "Update"]

logger = logging.getLogger("pagedkv.server")

T = TypeVar("T")
Prompt = str | list[int] | list[dict[str, Any]]
Item = Update | BaseException
MAX_CONSECUTIVE_FAILURES = 20


class AsyncEngine:
    """Owns the engine thread. `start` must be called from the event loop that will consume
    the outputs; `stop` may be called from any thread."""

    def __init__(self, engine: Any, *, max_prompt_tokens: int | None = None,
                 stream_queue_limit: int = ServerConfig.stream_queue_limit) -> None:
        self.engine = engine
        self.max_prompt_tokens = max_prompt_tokens
        self.stream_queue_limit = stream_queue_limit
        self._commands: collections.deque[tuple[Callable[[Any], Any], concurrent.futures.Future]]
        self._commands = collections.deque()
        self._lock = threading.Lock()  # guards _closed against submit
        self._closed = True
        self._wake = threading.Event()
        self._stopping = False
        self._draining: BaseException | None = None  # set on shutdown: no new requests
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._held: list[tuple[RequestStream, Item]] = []  # engine thread only: not handed over yet
        self._forwarded = False  # engine thread only: a forward pass started in this step
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._prep = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedkv-prep")
        self._prep_queue = FairQueue(self._prep)  # per-client turns on that one thread
        self.max_token_chars: int | None = None  # measured on the preprocessing thread
        release_team()  # usually the thread that loaded the model: the engine thread steps it

    # --- event-loop side ---------------------------------------------------------------------

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        release_team()
        self._stopping = False
        self._closed = False
        if hasattr(self.engine, "before_forward"):
            self.engine.before_forward = self._before_forward
        self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
        self._thread.start()
        self._prep.submit(self._measure_vocab)

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts whatever is still in flight and joins the thread."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._close_queue()
        self._prep.shutdown(wait=False, cancel_futures=True)

    @property
    def is_alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and not self._closed)

    def submit(self, fn: Callable[[Any], T]) -> concurrent.futures.Future[T]:
        """Runs fn(engine) on the engine thread between two steps; fails at once if the
        thread is not (or no longer) taking commands."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        with self._lock:
            if self._closed or self._stopping:
                fut.set_exception(EngineDeadError("the engine is not running"))
                return fut
            self._commands.append((fn, fut))
        self._wake.set()
        return fut

    async def call(self, fn: Callable[[Any], T]) -> T:
        return await asyncio.wrap_future(self.submit(fn))

    chat_content_as_text = False  # --chat-content-special-tokens text (chat_tokens.py)

    def tokenizer_call(self, prompt: Prompt) -> Callable[[Any], list[int]]:
        """fn(engine) -> the prompt's ids, as every generation request computes them."""
        tools = None
        if isinstance(prompt, ToolChat):  # a template that reads the tools
            prompt, tools = prompt.messages, prompt.tools
        if self.chat_content_as_text and _is_chat(prompt):
            from pagedkv.server.chat_tokens import content_as_text

            def chat_ids(engine: Any) -> list[int]:
                engine.check_chat_template()
                return content_as_text(engine.tokenizer, prompt, tools)  # type: ignore[arg-type]

            return chat_ids
        if tools:
            return lambda engine: list(engine.tokenize(prompt, tools=tools))
        return lambda engine: list(engine.tokenize(prompt))

    async def tokenize(self, prompt: Prompt, key: Any = None) -> list[int]:
        """The prompt's token ids, computed on the preprocessing thread in `key`'s turn."""
        return list(await self.preprocess(self.tokenizer_call(prompt), key))

    async def preprocess(self, fn: Callable[[Any], T], key: Any = None) -> T:
        """Runs fn(engine) on the preprocessing thread: tokenizer work only (tokenize,
        chat templates, decode), which the tokenizer allows next to the engine thread's.
        Clients (`key`: the tenant) take turns, so one client's burst never queues another's
        request behind all of it (see prep_queue)."""
        engine = self.engine
        try:
            return await self._prep_queue.run(key, lambda: fn(engine))
        except RuntimeError as exc:  # the executor was shut down
            if self._stopping:
                raise ShuttingDownError("the server is shutting down") from exc
            raise

    async def add(
        self, request_id: str, prompt: Prompt, make_params: Callable[[int], Any], *,
        cache_salt: str | None = None, holdback: int = 0, tenant: str | None = None,
    ) -> RequestStream:
        """Tokenizes (off the engine thread), checks the limits, then adds the request;
        make_params(prompt_len) builds its SamplingParams; `tenant` is the submitter's tenant
        id (the server's own record, never from the body: see `tenant_of`). Errors (InvalidParamsError,
        RequestTooLongError...) are raised here, before any output."""
        return (await self.add_all([(request_id, prompt)], make_params, cache_salt=cache_salt,
                                   holdback=holdback, tenant=tenant))[0]

    async def add_all(
        self, prompts: list[tuple[str, Prompt]], make_params: Callable[[int], Any], *,
        cache_salt: str | None = None, holdback: int = 0, tenant: str | None = None,
    ) -> list[RequestStream]:
        """`add` for several (request_id, prompt) pairs, all or none: every prompt is
        tokenized and checked first, then one engine-thread command adds them all, so they
        reach the scheduler in the same step (prompts sharing a prefix can then share its
        prefill). If the engine refuses one, those added before it are aborted."""
        if self._draining is not None:
            raise self._draining
        ready = [await self._prepare(rid, p, make_params, holdback, tenant) for rid, p in prompts]
        await self.call(lambda engine: self._add_all_on_thread(engine, ready, cache_salt))
        return [stream for stream, _, _ in ready]

    async def _prepare(self, request_id: str, prompt: Prompt, make_params: Callable[[int], Any],
                       holdback: int, tenant: str | None) -> tuple[RequestStream, list[int], Any]:
        """Tokenized ids, params and a new stream for one prompt; raises if over a limit."""
        self.check_chars(prompt)
        ids = await self.tokenize(prompt, tenant)
        n, context = len(ids), self.engine.max_model_len
        shift = getattr(self.engine, "context_shift", False)  # longer prompts are cut, not refused
        if shift and n > self.engine.max_prompt_len:
            raise RequestTooLongError(f"prompt has {n} tokens, over the context-shift limit of "
                                      f"{self.engine.max_prompt_len}")
        if self.max_prompt_tokens is not None and n > self.max_prompt_tokens:
            raise RequestTooLongError(
                f"prompt has {n} tokens, over this server's limit of {self.max_prompt_tokens}"
            )
        if n >= context and not shift:
            raise RequestTooLongError(f"prompt has {n} tokens; the model's context is {context}")
        params = make_params(n)
        await self._compile(params, tenant)
        if n + params.max_tokens > context and not shift:
            raise RequestTooLongError(
                f"this model's context is {context} tokens, but the prompt ({n}) + max_tokens "
                f"({params.max_tokens}) would need {n + params.max_tokens}"
            )
        stream = RequestStream(request_id, holdback=holdback, limit=self.stream_queue_limit)
        stream.tenant = tenant
        return stream, ids, params

    async def _compile(self, params: Any, tenant: str | None) -> None:
        """A structured-output constraint is compiled here, on the preprocessing thread (a
        GrammarError is the client's 400); the engine thread then finds it in the cache."""
        spec = getattr(params, "structured_outputs", None)
        grammars = getattr(self.engine, "grammars", None)
        if spec is not None and grammars is not None:
            await self.preprocess(lambda engine: grammars.compile(spec), tenant)

    def _measure_vocab(self) -> None:
        """The longest token string of the vocabulary (a byte-level BPE token string has one
        character per byte), so a prompt far too long for the context can be refused without
        spending seconds tokenizing it."""
        try:
            vocab = self.engine.tokenizer.get_vocab()
            self.max_token_chars = max(len(t) for t in vocab) if vocab else None
        except Exception:  # a tokenizer without a vocabulary: no shortcut
            self.max_token_chars = None

    def check_chars(self, prompt: Prompt) -> None:
        """Every token covers at most max_token_chars characters (2x margin for normalizers),
        so a longer prompt cannot fit whatever it tokenizes to."""
        if self.max_token_chars is None:
            return
        tokens = getattr(self.engine, "max_prompt_len", self.engine.max_model_len - 1)
        if self.max_prompt_tokens is not None:
            tokens = min(tokens, self.max_prompt_tokens)
        if isinstance(prompt, ToolChat):
            prompt = prompt.messages
        if isinstance(prompt, str):
            chars = len(prompt)
        elif prompt and isinstance(prompt[0], dict):
            chars = sum(len(str(m.get("content") or "")) for m in prompt)  # type: ignore[union-attr]
        else:
            return  # token ids: counted exactly, cheaply
        if chars > 2 * self.max_token_chars * tokens:
            raise RequestTooLongError(
                f"prompt of {chars} characters is over any {tokens}-token prompt this server "
                "accepts")

    def abort(self, request_id: str) -> None:
        """Fire-and-forget abort; frees the request's KV blocks at the next step boundary."""
        self.submit(lambda engine: self._abort_on_thread(engine, request_id))

    def fail_all(self, exc: BaseException) -> None:
        """Ends every request in flight with `exc` (at the next step boundary)."""
        self.submit(lambda engine: self._fail_all(exc))

    def drain(self, exc: BaseException) -> None:
        """Shutdown: every request in flight, and any added from now on, fails with `exc`."""
        self._draining = exc
        self.fail_all(exc)

    # --- engine thread -----------------------------------------------------------------------

    def _add_all_on_thread(self, engine: Any, ready: list[tuple[RequestStream, list[int], Any]],
                           cache_salt: str | None) -> None:
        added: list[str] = []
        try:
            for stream, ids, params in ready:
                self._add_on_thread(engine, stream, ids, params, cache_salt)
                added.append(stream.request_id)
        except BaseException:
            for rid in added:  # all or none
                self._abort_on_thread(engine, rid)
            raise

    def _add_on_thread(self, engine: Any, stream: RequestStream, ids: list[int], params: Any,
                       cache_salt: str | None) -> None:
        if self._draining is not None:
            raise self._draining
        extra = {k: v for k, v in (("cache_salt", cache_salt), ("tenant", stream.tenant))
                 if v is not None}
        engine.add_request(stream.request_id, ids, params, **extra)
        stream.prompt_tokens = len(ids)
        self._streams[stream.request_id] = stream

    def tenant_of(self, request_id: str) -> str | None:
        """Engine thread only: the tenant that submitted a live request (None: no keys, or a
        request this server did not submit or no longer tracks)."""
        stream = self._streams.get(request_id)
        return None if stream is None else stream.tenant

    def _abort_on_thread(self, engine: Any, request_id: str) -> None:
        if self._streams.pop(request_id, None) is not None:
            engine.abort_request(request_id)

    def _run(self) -> None:
        failures = 0
        try:
            while not self._stopping:
                try:
                    self._iterate()
                    failures = 0
                except Exception as exc:
                    failures += 1
                    logger.exception("engine loop iteration failed (%d in a row)", failures)
                    self._fail_all(exc)
                    if failures >= MAX_CONSECUTIVE_FAILURES:
                        logger.error("engine loop gives up; /health now reports it down")
                        break
        except BaseException:
            logger.exception("engine thread crashed")
        finally:
            self._shutdown_on_thread()

    def _iterate(self) -> None:
        self._run_commands()
        if self.engine.has_unfinished_requests():
            self._forwarded = False
            self._step()
            if not self._forwarded or not self.engine.has_unfinished_requests():
                self._hand_over()  # no forward ran, or none follows: the batch goes now
        else:
            self._hand_over()
            self._wake.wait()
            self._wake.clear()

    def _before_forward(self) -> None:
        self._forwarded = True
        self._hand_over()

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
        except RequestFailedError as exc:
            # The engine names the requests that failed and has dropped them; the rest of
            # the batch is intact and simply runs again at the next step.
            logger.warning("engine step failed for %s: %s", exc.request_ids, exc)
            self._fail(exc.request_ids, exc)
            return
        except Exception as exc:
            logger.exception("engine step failed")
            self._fail_all(exc)
            return
        batch: list[tuple[RequestStream, Item]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                batch.append((stream, self._item(stream, out)))
        self._dispatch(batch)

    def _item(self, stream: RequestStream, out: Any) -> Item:
        """The stream's next queue item; a failure here ends this request only."""
        rid = stream.request_id
        try:
            item: Item = stream.delta(out, self.engine.tokenizer)
            finished = item.finished
            if any(c.finish_reason == "error" for c in item.choices):
                # the sampler could not sample this request's row: it fails, alone
                item, finished = RequestFailedError(
                    [rid], "this request's next-token distribution could not be sampled "
                    "(not finite)"), False
        except Exception as exc:
            logger.exception("output of %s could not be read", rid)
            item, finished = exc, False
        if not finished and (isinstance(item, BaseException) or stream.backlog >= stream.limit):
            if not isinstance(item, BaseException):
                item = ClientTooSlowError(
                    f"the client fell {stream.backlog} updates behind; request aborted")
            self._abort_quietly(rid)
        if finished or isinstance(item, BaseException):
            self._streams.pop(rid, None)
        stream.queued += 1
        return item

    def _abort_quietly(self, request_id: str) -> None:
        try:
            self.engine.abort_request(request_id)
        except Exception:
            logger.exception("abort of %s failed", request_id)

    def _fail(self, request_ids: Any, exc: BaseException) -> None:
        batch: list[tuple[RequestStream, Item]] = []
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            self._abort_quietly(rid)
            if stream is not None:
                batch.append((stream, exc))
        self._dispatch(batch)

    def _fail_all(self, exc: BaseException) -> None:
        self._fail(list(self._streams), exc)

    def _shutdown_on_thread(self) -> None:
        self._stopping = True
        self._close_queue()
        self._fail_all(ShuttingDownError("the server is shutting down"))
        self._hand_over()
        if getattr(self.engine, "before_forward", None) == self._before_forward:
            self.engine.before_forward = None  # the engine may go on without this server

    def _close_queue(self) -> None:
        with self._lock:
            self._closed = True
        while self._commands:
            _, fut = self._commands.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(ShuttingDownError("the server is shutting down"))

    def _dispatch(self, batch: list[tuple[RequestStream, Item]]) -> None:
        """Queues a batch for the event loop; `_hand_over` sends what is queued, in order."""
        self._held.extend(batch)

    def _hand_over(self) -> None:
        batch, self._held = self._held, []
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_deliver, batch)
        except RuntimeError:  # the event loop is already closed: nobody is listening
            pass


def _deliver(batch: list[tuple[RequestStream, Item]]) -> None:
    for stream, item in batch:
        stream._put(item)


def _is_chat(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(m, dict) for m in prompt)
