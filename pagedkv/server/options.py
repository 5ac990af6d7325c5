"""`pagedkv serve`'s own options (the engine's options are the CLI's business).

Kept apart from app.py, and free of heavy imports, so that `pagedkv serve --help` answers at
once: neither FastAPI nor torch is loaded to print the help. The options themselves are
ServerConfig's fields (server/config.py): this module only turns them into arguments.
"""

from __future__ import annotations

import argparse

from pagedkv.options import add_arguments
from pagedkv.server.config import DEFAULT_MAX_REQUEST_BYTES, ServerConfig

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "add_serve_args"]


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Server options of `pagedkv serve`: one argument per ServerConfig field."""
    add_arguments(parser, ServerConfig)
