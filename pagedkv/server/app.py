"""OpenAI-compatible HTTP server over an LLMEngine (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions (streamed as SSE or not),
GET /v1/models, GET /health, GET /metrics (Prometheus text), POST /tokenize, POST /detokenize,
GET /version (utility.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import json
import logging
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedkv.engine import SamplingParams
from pagedkv.errors import InvalidParamsError, RequestTooLongError
from pagedkv.server.async_engine import AsyncEngine, Choice, EngineDeadError, RequestStream, Update
from pagedkv.server.batch import MergedStream
from pagedkv.server.dashboard import PAGE_PATH, add_dashboard
from pagedkv.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    ChatResponseFormat,
    CompletionRequest,
    ResponseFormat,
    parse_request,
)
from pagedkv.server.stats_log import configure_logging, log_stats
from pagedkv.server.unsupported import check_supported
from pagedkv.server.utility import add_utility_routes

logger = logging.getLogger("pagedkv.server")

GENERATION_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
OPEN_PATHS = frozenset({"/health", PAGE_PATH})  # the dashboard page holds no data
STREAMS_KEY = "pagedkv.streams"  # scope key: the engine requests one HTTP request started
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks for a vanished client  # OpenAI's default for /v1/completions


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


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
            reason = update.choices[0].finish_reason if update.choices else None
            self.metrics.request_finished(
                self.endpoint, reason or "abort", time.monotonic() - self.start
            )


@dataclass
class _Sent:
    chars: int = 0  # of the choice's text
    tokens: int = 0  # whose logprobs went out
    token_chars: int = 0  # text_offset of the next logprob entry
    done: bool = False


class _StreamText:
    """Turns cumulative choice texts into deltas.

    Holds back the last len(longest stop string) - 1 characters until the choice finishes:
    the engine strips a matched stop string from the text, and text already sent cannot be
    taken back, so without this a streamed answer could differ from the non-streamed one.
    """

    def __init__(self, fmt: ResponseFormat, stops: list[str]) -> None:
        self.fmt = fmt
        self.holdback = max((len(s) for s in stops), default=1) - 1
        self.sent: dict[int, _Sent] = {}

    def chunks(self, choice: Choice) -> Iterator[dict[str, Any]]:
        sent = self.sent.get(choice.index)
        if sent is None:
            sent = self.sent[choice.index] = _Sent()
            yield from self.fmt.start_chunks(choice.index)
        if sent.done:
            return
        end = len(choice.text)
        if choice.finish_reason is None:
            end = max(sent.chars, end - self.holdback)
        text = choice.text[sent.chars:end]
        sent.chars, sent.done = end, choice.finish_reason is not None
        if not text and not sent.done:
            return
        logprobs = None
        if choice.logprobs is not None:
            new = choice.logprobs[sent.tokens:]
            logprobs = self.fmt.logprobs(new, sent.token_chars)
            sent.tokens += len(new)
            sent.token_chars += sum(len(e.token) for e in new)
        yield self.fmt.delta_chunk(choice.index, text, choice.finish_reason, logprobs)


class OpenAIServer:
    """Request handlers plus the state they share (engine wrapper, limits, metrics)."""

    def __init__(
        self,
        engine: Any,
        *,
        served_model_name: str,
        api_key: str | None,
        max_concurrent: int,
        max_prompt_tokens: int | None,
        max_tokens_limit: int | None,
    ) -> None:
        self.engine = AsyncEngine(engine, max_prompt_tokens=max_prompt_tokens)
        self.max_model_len: int = engine.max_model_len
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.max_concurrent = max_concurrent
        self.max_tokens_limit = max_tokens_limit or self.max_model_len
        self.metrics = ServerMetrics(served_model_name)
        self.in_flight = 0
        self.created = int(time.time())

    # --- plain endpoints -------------------------------------------------------------------

    async def health(self) -> Response:
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
            raise ApiError(503, str(exc), type="server_error") from None
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
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        tracker = _Tracker(self.metrics, GENERATION_PATHS[request.url.path])
        stream = await self._add(request, request_id, req)
        fmt = fmt_cls(request_id, self.served_model_name, req.logprobs_count() or 0)
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
        req.engine_prompts()  # batch / echo refusals before touching the engine
        req.stop_list()
        requested = req.requested_max_tokens()
        if requested is not None and requested > self.max_tokens_limit:
            raise ApiError(
                400, f"max_tokens={requested} is over this server's limit of "
                f"{self.max_tokens_limit}", param="max_tokens",
            )

    def _params_factory(self, req: Any) -> Callable[[int], Any]:
        def make(prompt_len: int) -> Any:
            max_tokens = req.requested_max_tokens()
            if max_tokens is None and isinstance(req, ChatCompletionRequest):
                max_tokens = min(self.max_tokens_limit, self.max_model_len - prompt_len)
            elif max_tokens is None:
                max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
            return SamplingParams(**req.sampling_kwargs(max_tokens))

        return make

    async def _add(self, request: Request, request_id: str, req: Any) -> Any:
        """The request's stream; several prompts are one engine request each, merged."""
        prompts = req.engine_prompts()
        if len(prompts) == 1:
            return await self._add_one(request, request_id, req, prompts[0])
        parts = [await self._add_one(request, f"{request_id}-{i}", req, p)
                 for i, p in enumerate(prompts)]
        return MergedStream(request_id, parts, req.n)

    async def _add_one(self, request: Request, request_id: str, req: Any, prompt: Any
                       ) -> RequestStream:
        try:
            stream = await self.engine.add(request_id, prompt, self._params_factory(req))
        except RequestTooLongError as exc:
            param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
            raise ApiError(400, str(exc), param=param, code="context_length_exceeded") from None
        except InvalidParamsError as exc:
            raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from None
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), type="server_error") from None
        # The guard middleware aborts it if the HTTP request ends before the engine does.
        request.scope.setdefault(STREAMS_KEY, []).append(stream)
        return stream

    async def _collect(self, stream: RequestStream, request: Request, tracker: _Tracker) -> Update:
        next_check = time.monotonic() + DISCONNECT_POLL_S
        while True:
            try:
                update = await asyncio.wait_for(stream.get(), timeout=DISCONNECT_POLL_S)
            except TimeoutError:
                update = None
            except EngineDeadError as exc:
                raise ApiError(503, str(exc), type="server_error") from None
            except Exception as exc:
                raise ApiError(500, f"engine error: {exc}", type="server_error") from None
            if time.monotonic() >= next_check:
                # Nothing is written while a non-streamed request runs, so ask the socket.
                next_check = time.monotonic() + DISCONNECT_POLL_S
                if await request.is_disconnected():
                    raise ApiError(499, "client disconnected")
            if update is not None:
                tracker.on_update(update)
                if update.finished:
                    return update

    async def _sse_events(
        self, stream: RequestStream, fmt: ResponseFormat, req: Any, tracker: _Tracker
    ) -> AsyncIterator[str]:
        # A client disconnect cancels this generator at `await stream.get()`; the guard
        # middleware then aborts the engine request.
        text = _StreamText(fmt, req.stop_list())
        update: Update | None = None
        try:
            while not stream.finished:
                update = await stream.get()
                tracker.on_update(update)
                for choice in update.choices:
                    for chunk in text.chunks(choice):
                        yield _sse(chunk)
            if req.include_usage() and update is not None:
                yield _sse(fmt.usage_chunk(update))
        except Exception as exc:
            status = 503 if isinstance(exc, EngineDeadError) else 500
            yield _sse(ApiError(status, str(exc), type="server_error").body())
        yield "data: [DONE]\n\n"


class _Guard:
    """Pure ASGI middleware: API key, concurrency limit, and abort-on-exit.

    Written at the ASGI level (not as a route dependency) because a streamed response
    outlives its handler: the slot must be held, and the engine request aborted if still
    running, until the last byte is sent or the client is gone.
    """

    def __init__(self, app: ASGIApp, server: OpenAIServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        server = self.server
        if server.api_key and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            err = ApiError(401, "Invalid or missing API key", code="invalid_api_key")
            await self._reject(err, scope, receive, send)
            return
        if scope["path"] not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if server.in_flight >= server.max_concurrent:
            err = ApiError(429, f"Too many concurrent requests (limit {server.max_concurrent})",
                           type="rate_limit_error", code="rate_limit_exceeded")
            await self._reject(err, scope, receive, send, {"Retry-After": "1"})
            return
        server.in_flight += 1
        streams: list[RequestStream] = scope.setdefault(STREAMS_KEY, [])
        try:
            await self.app(scope, receive, send)
        finally:
            server.in_flight -= 1
            for stream in streams:
                if not stream.finished:
                    server.engine.abort(stream.request_id)
                    server.metrics.finished[(GENERATION_PATHS[scope["path"]], "abort")] += 1

    def _authorized(self, scope: Scope) -> bool:
        expected = f"Bearer {self.server.api_key}".encode()
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, expected)
        return False

    async def _reject(
        self, err: ApiError, scope: Scope, receive: Receive, send: Send,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.server.metrics.errors[err.status] += 1
        response = JSONResponse(err.body(), status_code=err.status, headers=headers)
        await response(scope, receive, send)


def build_app(
    engine: Any,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_concurrent: int = 256,
    max_prompt_tokens: int | None = None,
    max_tokens_limit: int | None = None,
    log_stats_interval: float = 0.0,
) -> FastAPI:
    """The FastAPI app; the engine thread starts and stops with the app's lifespan.

    log_stats_interval > 0: log one stats line per that many seconds while busy."""
    server = OpenAIServer(
        engine,
        served_model_name=served_model_name or engine.model_name,
        api_key=api_key,
        max_concurrent=max_concurrent,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
    )

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
    add_utility_routes(app, server)
    add_dashboard(app, server)
    app.add_middleware(_Guard, server=server)
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

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


# --- running it ------------------------------------------------------------------------------


class _GracefulServer(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, which makes the process
    exit with 143/130; a drained, cleanly stopped server should exit 0 instead."""

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


def serve(
    engine: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_concurrent: int = 256,
    max_prompt_tokens: int | None = None,
    max_tokens_limit: int | None = None,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    log_stats_interval: float = 10.0,
) -> None:
    """Serves until SIGTERM/SIGINT: then stops accepting, lets in-flight requests finish for
    up to shutdown_timeout seconds, aborts the rest, stops the engine thread and returns."""
    app = build_app(
        engine,
        served_model_name=served_model_name,
        api_key=api_key,
        max_concurrent=max_concurrent,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
        log_stats_interval=log_stats_interval,
    )
    configure_logging(log_level)
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False,
        timeout_graceful_shutdown=shutdown_timeout,
    )
    _GracefulServer(config).run()


class ServerThread:
    """uvicorn in a daemon thread on a free local port (tests, in-process benchmarks)."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", log_level: str = "warning") -> None:
        # Binding here (port 0) and handing uvicorn the socket avoids a free-port race.
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind((host, 0))
        self.url = f"http://{host}:{self._sock.getsockname()[1]}"
        config = uvicorn.Config(app, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=5)
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


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server options of `pagedkv serve` (the engine's options are the CLI's business)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="name clients pass as 'model' (default: the engine's model name)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (all routes but /health)")
    parser.add_argument("--max-concurrent", type=int, default=256,
                        help="generation requests in flight before 429")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest accepted prompt (default: the model's context)")
    parser.add_argument("--max-tokens-limit", type=int, default=None,
                        help="largest accepted max_tokens (default: the model's context)")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds to let in-flight requests finish on SIGTERM")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between stats lines while busy (0: none)")


def run_serve(
    args: argparse.Namespace, engine_factory: Callable[[argparse.Namespace], Any]
) -> int:
    """Builds the engine with engine_factory(args), serves until SIGTERM/SIGINT, returns the
    exit code."""
    engine = engine_factory(args)
    serve(
        engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        max_concurrent=args.max_concurrent,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        log_stats_interval=args.log_stats_interval,
    )
    return 0
