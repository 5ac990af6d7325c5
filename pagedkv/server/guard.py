"""The ASGI middleware in front of every route: API key, request body limits, the concurrency
slot, and abort-on-exit.

Order, for a hostile client's sake: the key is checked first (no body read for a stranger);
the body is then read whole, under a size cap (413, before any parsing) and a deadline (408),
and only then is a concurrency slot taken, so a client that stalls its body holds a socket
but never a slot. Written at the ASGI level (not as a route dependency) because a streamed
response outlives its handler: the slot is held, and the engine request aborted if still
running, until the last byte is sent or the client is gone.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagedkv.server.dashboard import PAGE_PATH
from pagedkv.server.protocol import ApiError

if TYPE_CHECKING:
    from pagedkv.server.app import OpenAIServer

logger = logging.getLogger("pagedkv.server")

GENERATION_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}
# paths that take a concurrency slot: generation, and the tokenizer work that costs as much
SLOT_PATHS = frozenset(GENERATION_PATHS) | {"/tokenize", "/detokenize"}
OPEN_PATHS = frozenset({"/health", PAGE_PATH})  # the dashboard page holds no data
STREAMS_KEY = "pagedkv.streams"  # scope key: the engine requests one HTTP request started
TENANT_KEY = "pagedkv.tenant"  # scope key: the caller's tenant id (None without keys)
CUTOFF_KEY = "pagedkv.cutoff"  # scope key: asyncio.Timeout that drops a client far behind
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})


class Guard:
    def __init__(self, app: ASGIApp, server: OpenAIServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        server = self.server
        scope[TENANT_KEY] = None
        if server.api_keys is not None and scope["path"] not in OPEN_PATHS:
            tenant = server.api_keys.tenant(_header(scope, b"authorization"))
            if tenant is None:
                err = ApiError(401, "Invalid or missing API key", code="invalid_api_key")
                await self._reject(err, scope, receive, send, close=True)
                return
            scope[TENANT_KEY] = tenant
        if scope["method"] in BODY_METHODS:
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            receive = _replay(body, receive)
        if scope["path"] not in SLOT_PATHS:
            await self.app(scope, receive, send)
            return
        if server.in_flight >= server.max_concurrent:
            err = ApiError(429, f"Too many concurrent requests (limit {server.max_concurrent})",
                           type="rate_limit_error", code="rate_limit_exceeded")
            await self._reject(err, scope, receive, send, headers={"Retry-After": "1"})
            return
        server.in_flight += 1
        try:
            await self._run(scope, receive, send)
        finally:
            server.in_flight -= 1
            self._abort_unfinished(scope)

    async def _run(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        cutoff = asyncio.timeout(None)
        scope[CUTOFF_KEY] = cutoff
        try:
            async with cutoff:
                await self.app(scope, receive, send_tracked)
        except TimeoutError:
            if not cutoff.expired():
                raise
            logger.warning("dropped a client that fell too far behind its stream")
            if not started:
                err = ApiError(408, "The client fell too far behind; request aborted",
                               code="client_too_slow")
                await self._reject(err, scope, receive, send, close=True)

    def _abort_unfinished(self, scope: Scope) -> None:
        server = self.server
        for stream in scope.get(STREAMS_KEY, []):  # generation paths only start streams
            if not stream.finished:
                server.engine.abort(stream.request_id)
                server.metrics.finished[(GENERATION_PATHS[scope["path"]], "abort")] += 1

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None after answering 413/408/400 (or the client left)."""
        limit = self.server.max_request_bytes
        declared = _header(scope, b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                err = ApiError(400, "Invalid Content-Length header")
                await self._reject(err, scope, receive, send, close=True)
                return None
            if int(declared) > limit:
                await self._reject(_too_large(limit), scope, receive, send, close=True)
                return None
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.server.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        await self._reject(_too_large(limit), scope, receive, send, close=True)
                        return None
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            err = ApiError(408, f"The request body did not arrive within "
                           f"{self.server.body_timeout:g} s", code="request_timeout")
            await self._reject(err, scope, receive, send, close=True)
            return None

    async def _reject(
        self, err: ApiError, scope: Scope, receive: Receive, send: Send, *,
        headers: dict[str, str] | None = None, close: bool = False,
    ) -> None:
        self.server.metrics.errors[err.status] += 1
        headers = dict(headers or {})
        if close:  # the body may be unread: this connection cannot serve another request
            headers["Connection"] = "close"
        response = JSONResponse(err.body(), status_code=err.status, headers=headers)
        await response(scope, receive, send)


def _too_large(limit: int) -> ApiError:
    return ApiError(413, f"The request body is over this server's limit of {limit} bytes",
                    code="request_too_large")


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive() that hands the app the body already read, then waits for a disconnect."""
    done = False

    async def replay() -> Any:
        nonlocal done
        if not done:
            done = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
