"""OpenAI-compatible HTTP server over an LLMEngine (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not),
GET /v1/models, GET /health, GET /metrics (Prometheus text), POST /tokenize, POST /detokenize,
GET /version (utility.py).

Every error a client sees is an OpenAI-style JSON body (`{"error": {...}}`), a stream's as an
error event followed by `data: [DONE]`; nothing ever answers with a plain-text 500.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedkv.engine import SamplingParams
from pagedkv.errors import GrammarError, InvalidParamsError, PagedKVError, RequestTooLongError
from pagedkv.options import from_namespace
from pagedkv.server.async_engine import (
    AsyncEngine,
    Choice,
    ClientTooSlowError,
    EngineDeadError,
    RequestStream,
    ShuttingDownError,
    Update,
)
from pagedkv.server.auth import ApiKeys, cache_salt
from pagedkv.server.batch import MergedStream
from pagedkv.server.config import ServerConfig
from pagedkv.server.dashboard import add_dashboard
from pagedkv.server.guard import (
    CUTOFF_KEY,
    GENERATION_PATHS,
    STREAMS_KEY,
    TENANT_KEY,
    Guard,
)
from pagedkv.server.kv_tier import add_kv_routes, finish_engine
from pagedkv.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.options import DEFAULT_MAX_REQUEST_BYTES, add_serve_args  # noqa: F401
from pagedkv.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatResponseFormat,
    CompletionRequest,
    ResponseFormat,
    parse_request,
)
from pagedkv.server.stats_log import configure_logging, log_stats
from pagedkv.server.stream import Accumulator
from pagedkv.server.structured import request_constraint
from pagedkv.server.tools import Tools, ToolStream, prompt_messages, template_takes_tools, tools_of
from pagedkv.server.unsupported import check_consistent, check_supported
from pagedkv.server.utility import add_utility_routes
from pagedkv.server.worker_info import add_worker_routes

logger = logging.getLogger("pagedkv.server")

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks for a vanished client
DRAIN_GRACE_S = 5.0  # after the shutdown timeout: time for the 503s to reach the clients
HURRY_FLUSH_S = 0.5  # after a second SIGTERM: time for the 503s before the forced exit


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def error_for(exc: BaseException) -> ApiError:
    """The OpenAI-style error a client sees for an exception raised while serving it."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, EngineDeadError):  # ShuttingDownError too
        return ApiError(503, str(exc), type="server_error", code="service_unavailable")
    if isinstance(exc, ClientTooSlowError):
        return ApiError(408, str(exc), code="client_too_slow")
    if isinstance(exc, RequestTooLongError):
        return ApiError(400, str(exc), code="context_length_exceeded")
    if isinstance(exc, InvalidParamsError):
        return ApiError(400, str(exc))
    if isinstance(exc, PagedKVError):
        return ApiError(500, f"engine error: {exc}", type="server_error")
    return ApiError(500, "internal error while serving this request", type="server_error")


class _Tracker:
    """Per-request timing for the TTFT / latency metrics."""

    def __init__(self, metrics: ServerMetrics, endpoint: str) -> None:
        self.metrics = metrics
        self.endpoint = endpoint
        self.start = time.monotonic()
        self.saw_token = False

    def on_update(self, update: Update) -> None:
        if not self.saw_token and any(c.token_ids for c in update.choices):
            self.saw_token = True
            self.metrics.ttft.observe(time.monotonic() - self.start)
        if update.finished:
            reasons = [c.finish_reason for c in update.choices if c.finish_reason]
            self.metrics.request_finished(
                self.endpoint, reasons[0] if reasons else "abort", time.monotonic() - self.start
            )


class _StreamText:
    """Turns a request's deltas into the endpoint's chunks (the engine thread already held
    back text that a stop string could still take back)."""

    def __init__(self, fmt: ResponseFormat) -> None:
        self.fmt = fmt
        self.tool_streams: dict[int, ToolStream] = {}  # chat with tools: calls parsed as they end
        self.started: set[int] = set()
        self.offsets: dict[int, int] = {}  # text_offset of the next logprob entry
        self.pending: dict[int, list[Any]] = {}  # logprobs of tokens whose text is held back

    def chunks(self, choice: Choice) -> Iterator[dict[str, Any]]:
        i = choice.index
        if i not in self.started:
            self.started.add(i)
            yield from self.fmt.start_chunks(i)
        if choice.logprobs:
            self.pending.setdefault(i, []).extend(choice.logprobs)
        if not choice.text and choice.finish_reason is None:
            return
        text, reason, calls = choice.text, choice.finish_reason, []
        tools = getattr(self.fmt, "tools", None)
        if tools is not None:
            ts = self.tool_streams.setdefault(i, ToolStream(tools))
            text, calls = ts.feed(text, final=reason is not None)
            reason = _tool_finish(tools, reason, ts.emitted)
            if not text and not calls and reason is None:
                return
        logprobs = None
        if choice.logprobs is not None:
            new = self.pending.pop(i, [])
            logprobs = self.fmt.logprobs(new, self.offsets.get(i, 0))
            self.offsets[i] = self.offsets.get(i, 0) + sum(len(e.token) for e in new)
        if calls:
            first = self.tool_streams[i].emitted - len(calls)
            yield from self.fmt.tool_call_chunks(i, calls, first)  # type: ignore[attr-defined]
            if not text and reason is None and logprobs is None:
                return
        yield self.fmt.delta_chunk(i, text, reason, logprobs)


def _tool_finish(tools: Tools, reason: str | None, calls: int) -> str | None:
    """OpenAI's finish_reason once calls were made: "tool_calls" (a named, forced function
    ends with "stop", as OpenAI's does)."""
    if reason == "stop" and calls and tools.choice != "named":
        return "tool_calls"
    return reason


class OpenAIServer:
    """Request handlers plus the state they share (engine wrapper, limits, metrics)."""

    def __init__(self, engine: Any, config: ServerConfig) -> None:
        self.config = config
        self.engine = AsyncEngine(engine, max_prompt_tokens=config.max_prompt_tokens,
                                  stream_queue_limit=config.stream_queue_limit)
        self.max_model_len: int = engine.max_model_len
        self.cache_tokens = _cache_tokens(engine)
        self.served_model_name: str = config.served_model_name or engine.model_name
        keys = [config.api_key] if isinstance(config.api_key, str) else config.api_key
        self.api_keys = None if keys is None else ApiKeys(keys)
        self.max_concurrent = config.max_concurrent
        self.max_tokens_limit = config.max_tokens_limit or self.max_model_len
        self.max_request_tokens = config.max_request_tokens
        self.max_request_bytes = config.max_request_bytes
        self.body_timeout = config.body_timeout
        self.metrics = ServerMetrics(self.served_model_name)
        self.in_flight = 0
        self.created = int(time.time())

    # --- plain endpoints -------------------------------------------------------------------

    async def health(self) -> Response:
        """200 only while the engine thread runs and takes commands."""
        if self.engine.is_alive:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    async def models(self) -> Response:
        card = {
            "id": self.served_model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "pagedkv",
            "max_model_len": self.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics_endpoint(self) -> Response:
        try:
            stats = await self.engine.call(lambda engine: engine.stats())
        except EngineDeadError as exc:
            raise error_for(exc) from None
        text = self.metrics.render(stats, self.in_flight)
        return PlainTextResponse(text, media_type=METRICS_CONTENT_TYPE)

    # --- generation ------------------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, ResponseFormat, "cmpl")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, ChatCompletionRequest, ChatResponseFormat, "chatcmpl")

    async def _generate(
        self, request: Request, model_cls: type, fmt_cls: type[ResponseFormat], prefix: str
    ) -> Response:
        req = parse_request(model_cls, await request.body())
        self._check_request(req)
        constraint = request_constraint(req.model_extra)
        tools, prompts = self._tools(req)
        if tools is not None and tools.forced:
            if constraint[0] is not None:
                raise ApiError(400, f"'{constraint[1]}' cannot be combined with tool_choice "
                               f"'{tools.choice}' (the call is constrained already)",
                               param=constraint[1])
            try:
                constraint = (tools.constraint(), "tool_choice")
            except GrammarError as exc:  # the tools' schemas make too large a grammar
                raise ApiError(400, f"'tools': {exc}", param="tools") from None
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        tracker = _Tracker(self.metrics, GENERATION_PATHS[request.url.path])
        stream = await self._add(request, request_id, req, constraint, prompts)
        fmt = fmt_cls(request_id, self.served_model_name, req.logprobs_count() or 0)
        fmt.tools = tools if tools is not None and tools.in_prompt else None
        if req.stream:
            return StreamingResponse(
                self._sse_events(stream, fmt, req, tracker),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return JSONResponse(fmt.full(await self._collect(stream, request, tracker)))

    def _check_request(self, req: Any) -> None:
        if req.model is not None and req.model != self.served_model_name:
            raise ApiError(
                404, f"The model '{req.model}' does not exist; this server serves "
                f"'{self.served_model_name}'", param="model", code="model_not_found",
            )
        check_supported(req.model_extra, chat=isinstance(req, ChatCompletionRequest), n=req.n)
        check_consistent(req)
        req.engine_prompts()  # batch / echo refusals before touching the engine
        req.stop_list()
        requested = req.requested_max_tokens()
        if requested is not None and requested > self.max_tokens_limit:
            raise ApiError(
                400, f"max_tokens={requested} is over this server's limit of "
                f"{self.max_tokens_limit}", param="max_tokens",
            )
        self._check_request_tokens(req, requested)

    def _check_request_tokens(self, req: Any, requested: int | None) -> None:
        """n x max_tokens (x prompts) within --max-request-tokens: one request cannot ask
        for an unbounded amount of decoding (without max_tokens, `_params_factory` gives each
        sample at most the cap / choices)."""
        prompts = len(req.engine_prompts())
        choices = prompts * req.n
        cap = self.max_request_tokens
        per = "" if prompts == 1 else f" x {prompts} prompts"
        field = ("max_completion_tokens" if getattr(req, "max_completion_tokens", None)
                 else "max_tokens")
        if choices > cap:
            raise ApiError(400, f"n ({req.n}){per} is over this server's limit of {cap} "
                           "generated tokens per request (--max-request-tokens)", param="n")
        if requested is not None and choices * requested > cap:
            raise ApiError(
                400, f"n ({req.n}) x {field} ({requested}){per} = {choices * requested} "
                f"tokens is over this server's limit of {cap} generated tokens per request "
                f"(--max-request-tokens): lower n or {field}", param=field)

    def _tools(self, req: Any) -> tuple[Tools | None, list[Any] | None]:
        """A chat request's tools and, when tools or tool messages shape the prompt, its
        prompt (else None: the plain messages)."""
        if not isinstance(req, ChatCompletionRequest):
            return None, None
        tools = tools_of(req.model_extra, self.config.tool_call_parser)
        has_tool_messages = any(m.role == "tool" or (m.model_extra or {}).get("tool_calls")
                                for m in req.messages)
        if tools is None and not has_tool_messages:
            return None, None
        takes = template_takes_tools(getattr(self.engine.engine, "tokenizer", None))
        return tools, [prompt_messages(req.messages, tools, takes, self.config.tool_call_parser)]

    def _params_factory(self, req: Any, structured: Any = None) -> Callable[[int], Any]:
        share = max(1, self.max_request_tokens // (len(req.engine_prompts()) * req.n))

        def make(prompt_len: int) -> Any:
            max_tokens = req.requested_max_tokens()
            if max_tokens is None and isinstance(req, ChatCompletionRequest):
                # as much as the context and the whole KV cache leave (at least 1: a prompt
                # that fills either is then refused by the engine with the real reason)
                room = min(self.max_model_len, self.cache_tokens or self.max_model_len)
                if not getattr(self.engine.engine, "context_shift", False):  # the context slides
                    room -= prompt_len
                max_tokens = max(1, min(self.max_tokens_limit, room, share))
            elif max_tokens is None:
                max_tokens = min(COMPLETIONS_DEFAULT_MAX_TOKENS, share)
            return SamplingParams(**req.sampling_kwargs(max_tokens),
                                  structured_outputs=structured)

        return make

    async def _add(self, request: Request, request_id: str, req: Any,
                   constraint: tuple[Any, str | None] = (None, None),
                   prompts: list[Any] | None = None) -> Any:
        """The request's stream; several prompts are one engine request each, added to the
        engine in one command (they reach the scheduler together), read as one stream.
        `constraint`: (StructuredOutputsParams, the field it came from) or (None, None);
        `prompts`: the engine prompts when tools shaped them (else the request's own)."""
        prompts = prompts or req.engine_prompts()
        ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        stops = req.stop_list()
        tenant = request.scope.get(TENANT_KEY)
        try:
            streams = await self.engine.add_all(
                list(zip(ids, prompts, strict=True)), self._params_factory(req, constraint[0]),
                cache_salt=cache_salt(tenant, req.cache_salt),
                holdback=max((len(s) for s in stops), default=1) - 1, tenant=tenant,
            )
        except GrammarError as exc:  # the constraint does not compile
            raise ApiError(400, f"'{constraint[1]}': {exc}", param=constraint[1]) from None
        except RequestTooLongError as exc:
            param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None
        except InvalidParamsError as exc:
            raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from None
        except EngineDeadError as exc:
            raise error_for(exc) from None
        for stream in streams:
            self._track(request, stream)
        return streams[0] if len(prompts) == 1 else MergedStream(request_id, streams, req.n)

    def _track(self, request: Request, stream: RequestStream) -> None:
        """The guard aborts the stream's request if the HTTP request ends before the engine
        does, and drops the connection if the client falls too far behind."""
        request.scope.setdefault(STREAMS_KEY, []).append(stream)
        cutoff = request.scope.get(CUTOFF_KEY)
        if cutoff is not None:
            loop = asyncio.get_running_loop()
            stream.on_drop = lambda: cutoff.reschedule(loop.time())

    async def _collect(self, stream: RequestStream, request: Request, tracker: _Tracker) -> Update:
        acc = Accumulator()
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while True:
            try:
                async with asyncio.timeout(DISCONNECT_POLL_S):  # no task per update (wait_for)
                    update = await stream.get()
            except TimeoutError:
                update = None
            except Exception as exc:
                raise error_for(exc) from None
            if time.monotonic() >= next_check:
                # Nothing is written while a non-streamed request runs, so ask the socket.
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise ApiError(499, "client disconnected")
            if update is not None:
                tracker.on_update(update)
                acc.add(update)
                if update.finished:
                    return acc.final()

    async def _sse_events(
        self, stream: RequestStream, fmt: ResponseFormat, req: Any, tracker: _Tracker
    ) -> AsyncIterator[str]:
        # A client disconnect cancels this generator at `await stream.get()`; the guard
        # then aborts the engine request.
        text = _StreamText(fmt)
        acc = Accumulator()
        try:
            while not stream.finished:
                update = await stream.get()
                tracker.on_update(update)
                acc.add(update)
                for choice in update.choices:
                    for chunk in text.chunks(choice):
                        yield _sse(chunk)
            if req.include_usage() and acc.last is not None:
                yield _sse(fmt.usage_chunk(acc.final()))
        except Exception as exc:
            err = error_for(exc)
            self.metrics.errors[err.status] += 1
            yield _sse(err.body())
        yield "data: [DONE]\n\n"


def _cache_tokens(engine: Any) -> int | None:
    """Tokens one sequence can hold in the engine's whole KV cache (None when it does not say;
    with KV groups each token takes a block slot in every group)."""
    cache = getattr(engine, "cache", None)
    capacity = getattr(cache, "token_capacity", None)
    if isinstance(capacity, int):
        return capacity
    blocks, size = getattr(cache, "num_blocks", None), getattr(cache, "block_size", None)
    return blocks * size if isinstance(blocks, int) and isinstance(size, int) else None


def build_app(engine: Any, config: ServerConfig | None = None, /, **options: Any) -> FastAPI:
    """The FastAPI app; the engine thread starts and stops with the app's lifespan.

    `config` (or the defaults) with `options`: any ServerConfig field as a keyword
    (`api_key=..., max_concurrent=8`); an unknown one raises UnknownOptionError. The fields
    host, port, header_timeout, shutdown_timeout and log_level are serve()'s (uvicorn's).

    log_stats_interval > 0: log one stats line per that many seconds while busy.

    api_key: None (no auth), one key, or several keys (each a tenant: its requests are
    salted in the prefix cache, so tenants never see each other's cached blocks). An empty
    key raises ValueError: it would silently disable authentication.
    """
    config = ServerConfig.build(config, **options)
    log_stats_interval = config.log_stats_interval
    api_key = config.api_key
    server = OpenAIServer(engine, config)
    server.engine.chat_content_as_text = config.chat_content_special_tokens == "text"

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        stats_task = (asyncio.ensure_future(log_stats(server.engine, log_stats_interval))
                      if log_stats_interval > 0 else None)
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            # Runs after uvicorn drained (or cancelled) the connections: abort the rest.
            await asyncio.to_thread(server.engine.stop)

    app = FastAPI(title="pagedkv", lifespan=lifespan)
    app.state.server = server
    app.add_api_route("/health", server.health, methods=["GET"])
    app.add_api_route("/v1/models", server.models, methods=["GET"])
    app.add_api_route("/metrics", server.metrics_endpoint, methods=["GET"])
    app.add_api_route("/v1/completions", server.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", server.chat_completions, methods=["POST"])
    add_kv_routes(app, server, admin_key=api_key if isinstance(api_key, str | None) else
                  next(iter(api_key), None))
    add_utility_routes(app, server)
    add_worker_routes(app, server)
    add_dashboard(app, server)
    app.add_middleware(Guard, server=server)
    _add_error_handlers(app, server)
    return app


def _add_error_handlers(app: FastAPI, server: OpenAIServer) -> None:
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        server.metrics.errors[exc.status] += 1
        return JSONResponse(exc.body(), status_code=exc.status)

    async def http_error(request: Request, exc: Exception) -> Response:
        # Unknown routes and wrong methods, in the same error shape as everything else.
        assert isinstance(exc, StarletteHTTPException)
        err = ApiError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    async def unexpected(request: Request, exc: Exception) -> Response:
        # Anything else: logged with its traceback, answered as a JSON 500 (never text).
        logger.error("unexpected error serving %s", request.url.path,
                     exc_info=(type(exc), exc, exc.__traceback__))
        err = error_for(exc)
        server.metrics.errors[err.status] += 1
        return JSONResponse(err.body(), status_code=err.status)

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


# --- running it ------------------------------------------------------------------------------


class _H11(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus a header deadline on every request of a connection:
    from the moment the connection is idle (just made, or a response just completed) the
    client has `header_timeout` seconds to deliver a complete request header, else the
    connection is closed. So idle sockets and slow-header clients (slowloris) cannot pile up,
    on a fresh connection or a kept-alive one (uvicorn's keep-alive timer alone would not do:
    it is cancelled by the first byte that arrives, however slowly the rest follows).

    "No complete header yet" is read from h11's state, not from `self.cycle` (which stays set
    after a response): the client's side is IDLE (no Request event since the cycle began), or
    ours is DONE/MUST_CLOSE (the response ended and the client never moved on, e.g. it is still
    dribbling the body of a request answered early). A request being read or answered,
    however long its stream, is never cut here (its body has `body_timeout`).

    The server always runs this class (`_uvicorn_config` passes it as `http=`), so uvicorn
    never picks httptools even where it is installed: the rule has no httptools gap."""

    header_timeout = ServerConfig.header_timeout

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._arm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may already start a pipelined request: fine
        if not self.transport.is_closing():
            self._arm_header_timer()

    def _arm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
        self._header_timer = self.loop.call_later(self.header_timeout, self._drop_if_idle)

    def _awaiting_header(self) -> bool:
        conn = self.conn
        return conn.their_state is h11.IDLE or conn.our_state in (h11.DONE, h11.MUST_CLOSE)

    def _drop_if_idle(self) -> None:
        self._header_timer = None
        if self._awaiting_header() and not self.transport.is_closing():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def _uvicorn_config(app: ASGIApp, *, header_timeout: float = ServerConfig.header_timeout,
                    **kwargs: Any) -> uvicorn.Config:
    protocol = type("H11", (_H11,), {"header_timeout": header_timeout})
    kwargs.setdefault("access_log", False)
    return uvicorn.Config(app, http=protocol, timeout_keep_alive=5, **kwargs)


class _GracefulServer(uvicorn.Server):
    """Shutdown on SIGTERM/SIGINT: stop accepting, let requests in flight finish for up to
    `drain_after` seconds, then end the rest with an OpenAI-style 503 (an error event and
    `[DONE]` for streams) and exit 0. A second signal ends them with the 503 at once and
    forces the exit shortly after. (uvicorn itself would re-raise the signal, exiting with
    143/130, and cancel the responses mid-stream.)"""

    def __init__(self, config: uvicorn.Config, *, drain: Callable[[], None],
                 drain_after: float) -> None:
        super().__init__(config)
        self._drain = drain
        self._drain_after = drain_after
        self._hurry = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.should_exit:
            self._hurry = True
        self.should_exit = True

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        watchdog = asyncio.ensure_future(self._watch())
        try:
            await super().shutdown(sockets)
        finally:
            watchdog.cancel()

    async def _watch(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._drain_after
        while loop.time() < deadline and not self._hurry:
            await asyncio.sleep(0.05)
        logger.warning("shutdown: ending the requests still in flight with a 503")
        self._drain()
        if self._hurry:
            await asyncio.sleep(HURRY_FLUSH_S)
            self.force_exit = True


def freeze_startup_objects() -> None:
    """Takes every object alive now (the model, tokenizer and app: about 250k for a 1.5B GGUF)
    out of the cyclic garbage collector's view (gc.freeze, as vLLM does once its engine is up).
    They live as long as the process, and a full collection that walks them holds the GIL, so
    every stream stops while it runs: 120 ms a collection with them, under 0.1 ms after the
    freeze (1.5B Q4_K_M file loaded with its server app, Zen 4). Refcounting still frees them."""
    gc.collect()
    gc.freeze()


def serve(engine: Any, config: ServerConfig | None = None, /, **options: Any) -> None:
    """Serves until SIGTERM/SIGINT (see _GracefulServer), then stops the engine thread and
    returns. `config` (or the defaults) with `options`: any ServerConfig field as a keyword
    (host, port, api_key, limits...); an unknown one raises UnknownOptionError."""
    cfg = ServerConfig.build(config, **options)
    app = build_app(engine, cfg)
    configure_logging(cfg.log_level)
    freeze_startup_objects()
    server: OpenAIServer = app.state.server
    uv = _uvicorn_config(
        app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
        header_timeout=cfg.header_timeout,
        timeout_graceful_shutdown=cfg.shutdown_timeout + DRAIN_GRACE_S,
    )
    _GracefulServer(
        uv,
        drain=lambda: server.engine.drain(ShuttingDownError("the server is shutting down")),
        drain_after=cfg.shutdown_timeout,
    ).run()


class ServerThread:
    """uvicorn in a daemon thread on a free local port (tests, in-process benchmarks)."""

    def __init__(self, app: ASGIApp, host: str = ServerConfig.host, log_level: str = "warning",
                 header_timeout: float = ServerConfig.header_timeout) -> None:
        # Binding here (port 0) and handing uvicorn the socket avoids a free-port race.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        config = _uvicorn_config(app, log_level=log_level, timeout_graceful_shutdown=5,
                                 header_timeout=header_timeout)
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> ServerThread:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_serve(
    args: argparse.Namespace, engine_factory: Callable[[argparse.Namespace], Any]
) -> int:
    """Builds the engine with engine_factory(args), serves until SIGTERM/SIGINT, returns the
    exit code. The server options are ServerConfig's fields read from `args` (checked before
    the engine is built). Refuses to start (exit code 2) on an empty API key."""
    config = from_namespace(ServerConfig, args)
    if config.api_key is not None:
        try:
            ApiKeys(config.api_key)
        except ValueError as exc:
            logger.error("refusing to start: %s", exc)
            print(f"pagedkv serve: error: {exc}", flush=True)
            return 2
    engine = engine_factory(args)
    try:
        serve(engine, config)
    finally:
        finish_engine(engine)  # KV snapshot (--kv-snapshot), queued tier writes
    return 0
