"""`pagedkv serve`'s own options (the engine's options are the CLI's business).

Kept apart from app.py, and free of heavy imports, so that `pagedkv serve --help` answers at
once: neither FastAPI nor torch is loaded to print the help.
"""

from __future__ import annotations

import argparse

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server options of `pagedkv serve` (the engine's options are the CLI's business)."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="name clients pass as 'model' (default: the engine's model name)")
    parser.add_argument("--api-key", action="append", default=None,
                        help="require 'Authorization: Bearer KEY' (all routes but /health); "
                        "repeat for several keys: each key is a tenant, and tenants never "
                        "share prefix-cache blocks")
    parser.add_argument("--max-concurrent", type=int, default=256,
                        help="generation requests in flight before 429")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="longest accepted prompt (default: the model's context)")
    parser.add_argument("--max-tokens-limit", type=int, default=None,
                        help="largest accepted max_tokens (default: the model's context)")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help="largest accepted request body; larger ones get a 413 unread")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a client has to send its request body (else 408)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds a client has to send a complete request header, from the "
                             "connection opening or its previous response ending")
    parser.add_argument("--stream-queue-limit", type=int, default=256,
                        help="updates a stream may fall behind before it is aborted")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds to let in-flight requests finish on SIGTERM; then "
                        "they end with a 503 (a second SIGTERM: at once)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-stats-interval", type=float, default=10.0,
                        help="seconds between stats lines while busy (0: none)")
