"""ServerConfig: every option of `pagedkv serve` that is not the engine's, declared once.

`pagedkv serve`'s server flags (`options.add_serve_args`), `serve()`, `build_app()` and the
AsyncEngine's limits are all built from this dataclass (machinery: `pagedkv/options.py`).
Adding a server option is one field here (plus its check in `_check`, if any).

Invariants: a ServerConfig that exists is valid (checked in `__post_init__`; frozen). A bad
value raises InvalidParamsError naming the field (a ValueError, as before); an empty API key
is refused by `auth.ApiKeys` when the app is built. Imports nothing heavy (`serve --help`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from pagedkv.errors import InvalidParamsError
from pagedkv.options import build, check_positive, check_seconds, invalid, is_int, option

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    """The server's options; field order is the order of `pagedkv serve --help`."""

    host: str = option("127.0.0.1")
    port: int = option(8000, parse=int)
    served_model_name: str | None = option(
        None, "name clients pass as 'model' (default: the engine's model name)")
    api_key: str | Sequence[str] | None = option(
        None, "require 'Authorization: Bearer KEY' (all routes but /health); repeat for several "
              "keys: each key is a tenant, and tenants never share prefix-cache blocks",
        action="append")
    max_concurrent: int = option(256, "generation requests in flight before 429", parse=int)
    max_prompt_tokens: int | None = option(
        None, "longest accepted prompt (default: the model's context)", parse=int)
    max_tokens_limit: int | None = option(
        None, "largest accepted max_tokens (default: the model's context)", parse=int)
    max_request_tokens: int = option(
        16384, "largest n x max_tokens (x prompts) one request may ask for (else 400); a request "
               "without max_tokens gets at most this / (n x prompts) tokens per sample", parse=int)
    max_request_bytes: int = option(
        DEFAULT_MAX_REQUEST_BYTES, "largest accepted request body; larger ones get a 413 unread",
        parse=int)
    body_timeout: float = option(
        30.0, "seconds a client has to send its request body (else 408)", parse=float)
    header_timeout: float = option(
        10.0, "seconds a client has to send a complete request header, from the connection "
              "opening or its previous response ending", parse=float)
    stream_queue_limit: int = option(
        256, "updates a stream may fall behind before it is aborted", parse=int)
    shutdown_timeout: float = option(
        30.0, "seconds to let in-flight requests finish on SIGTERM; then they end with a 503 "
              "(a second SIGTERM: at once)", parse=float)
    chat_content_special_tokens: str = option(
        "parse", "parse (vLLM's behaviour): special-token strings in chat message content (e.g. "
                 "<|im_start|>) become special tokens, so a user can write a system turn; text: "
                 "tokenize content as plain text", choices=("parse", "text"))
    tool_call_parser: str = option(
        "hermes", "how tool calls are written and parsed: hermes (<tool_call>{json}</tool_call>, "
                  "Qwen 2.5 / Hermes / SmolLM2) or llama3_json (a bare {\"name\", \"parameters\"} "
                  "object, Llama 3.x)", choices=("hermes", "llama3_json"))
    log_level: str = option("info")
    log_stats_interval: float = option(
        10.0, "seconds between stats lines while busy (0: none)", parse=float)

    def __post_init__(self) -> None:
        self._check()

    @classmethod
    def build(cls, base: ServerConfig | None = None, /, **options: Any) -> ServerConfig:
        """`base` (or the defaults) with `options`; an unknown name raises UnknownOptionError."""
        return build(cls, base, options)

    def _check(self) -> None:
        if not isinstance(self.host, str) or not self.host:
            raise invalid(InvalidParamsError, f"host must be a host name or address, got "
                                              f"{self.host!r}", "host")
        if not is_int(self.port) or not 0 <= self.port <= 65535:
            raise invalid(InvalidParamsError, f"port {self.port!r} is not a TCP port (0..65535)",
                          "port")
        check_positive(self, InvalidParamsError, "max_concurrent", "max_request_bytes",
                       "stream_queue_limit", "max_request_tokens")
        check_positive(self, InvalidParamsError, "max_prompt_tokens", "max_tokens_limit",
                       optional=True)
        check_seconds(self, InvalidParamsError, "body_timeout", "header_timeout")
        check_seconds(self, InvalidParamsError, "shutdown_timeout", "log_stats_interval",
                      zero=True)
        if self.chat_content_special_tokens not in ("parse", "text"):
            raise invalid(InvalidParamsError, "chat_content_special_tokens is 'parse' or 'text', "
                          f"got {self.chat_content_special_tokens!r}", "chat_content_special_tokens")
        if self.tool_call_parser not in ("hermes", "llama3_json"):
            raise invalid(InvalidParamsError, "tool_call_parser is 'hermes' or 'llama3_json', "
                          f"got {self.tool_call_parser!r}", "tool_call_parser")


__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "ServerConfig"]
