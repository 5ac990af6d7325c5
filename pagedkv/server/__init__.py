"""OpenAI-compatible serving over an LLMEngine: `build_app`, `serve`, and the CLI hooks."""

from pagedkv.server.app import ServerThread, add_serve_args, build_app, run_serve, serve
from pagedkv.server.async_engine import AsyncEngine

__all__ = ["AsyncEngine", "ServerThread", "add_serve_args", "build_app", "run_serve", "serve"]
