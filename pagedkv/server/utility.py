"""The utility endpoints vLLM also serves: POST /tokenize, POST /detokenize, GET /version.

/tokenize counts exactly what a generation request would: a `prompt` as /v1/completions
tokenizes it, `messages` through the chat template as /v1/chat/completions does. Both are held to
what a generation request is: the same concurrency slot (guard.SLOT_PATHS), the same character
cap before any tokenizing, and the same per-client turns on the preprocessing thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from pagedkv import __version__
from pagedkv.errors import InvalidParamsError, RequestTooLongError
from pagedkv.server.async_engine import EngineDeadError
from pagedkv.server.guard import TENANT_KEY
from pagedkv.server.protocol import ApiError, ChatMessage, parse_request

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.server.app import OpenAIServer

MAX_DETOKENIZE = 1 << 17  # token ids per /detokenize request


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=2048)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE)


def _vocab_size(engine: Any) -> int:
    loaded = getattr(engine, "loaded", None)
    if loaded is not None:
        return int(loaded.config.vocab_size)
    return int(engine.tokenizer.vocab_size)


def _detokenize(engine: Any, ids: list[int]) -> str:
    vocab = _vocab_size(engine)
    if any(not 0 <= t < vocab for t in ids):
        raise InvalidParamsError(f"token ids must lie in [0, {vocab})")
    return engine.tokenizer.decode(ids)


class UtilityRoutes:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    def _check_model(self, model: str | None) -> None:
        name = self.server.served_model_name
        if model is not None and model != name:
            raise ApiError(404, f"The model '{model}' does not exist; this server serves "
                           f"'{name}'", param="model", code="model_not_found")

    async def _call(self, fn: Any, request: Request) -> Any:
        """fn(engine) on the preprocessing thread (never the engine thread's time), in the
        caller's tenant's turn."""
        try:
            return await self.server.engine.preprocess(fn, request.scope.get(TENANT_KEY))
        except RequestTooLongError as exc:
            raise ApiError(400, str(exc), param="prompt", code="context_length_exceeded") from None
        except InvalidParamsError as exc:
            raise ApiError(400, str(exc), param=getattr(exc, "param", None)) from None
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), type="server_error") from None

    async def tokenize(self, request: Request) -> Response:
        req = parse_request(TokenizeRequest, await request.body())
        self._check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError(400, "send exactly one of 'prompt' and 'messages'", param="prompt")
        prompt: Any = req.prompt if req.prompt is not None else [
            {"role": m.role, "content": m.text()} for m in req.messages or []]
        try:
            self.server.engine.check_chars(prompt)  # as a generation request: before tokenizing
        except RequestTooLongError as exc:
            raise ApiError(400, str(exc), param="prompt", code="context_length_exceeded") from None
        ids = await self._call(self.server.engine.tokenizer_call(prompt), request)
        return JSONResponse({"count": len(ids), "max_model_len": self.server.max_model_len,
                             "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        req = parse_request(DetokenizeRequest, await request.body())
        self._check_model(req.model)
        text = await self._call(lambda engine: _detokenize(engine, req.tokens), request)
        return JSONResponse({"prompt": text})

    async def version(self) -> Response:
        return JSONResponse({"version": __version__})


def add_utility_routes(app: FastAPI, server: OpenAIServer) -> None:
    routes = UtilityRoutes(server)
    app.add_api_route("/tokenize", routes.tokenize, methods=["POST"])
    app.add_api_route("/detokenize", routes.detokenize, methods=["POST"])
    app.add_api_route("/version", routes.version, methods=["GET"])
