"""OpenAI-compatible serving over an LLMEngine: `build_app`, `serve`, and the CLI hooks.

The names are imported on first use: `pagedkv serve --help` reads only `options.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.lazy import lazy_names

_LAZY = {
    "AsyncEngine": "pagedkv.server.async_engine",
    "ServerThread": "pagedkv.server.app",
    "build_app": "pagedkv.server.app",
    "run_serve": "pagedkv.server.app",
    "serve": "pagedkv.server.app",
    "add_serve_args": "pagedkv.server.options",
    "ServerConfig": "pagedkv.server.config",
}

__all__ = ["AsyncEngine", "ServerConfig", "ServerThread", "add_serve_args", "build_app",
           "run_serve", "serve"]

if TYPE_CHECKING:  # pragma: no cover
    from pagedkv.server.app import ServerThread, build_app, run_serve, serve
    from pagedkv.server.async_engine import AsyncEngine
    from pagedkv.server.config import ServerConfig
    from pagedkv.server.options import add_serve_args


__getattr__, __dir__ = lazy_names(__name__, _LAZY, globals())
