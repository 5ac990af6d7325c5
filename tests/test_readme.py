"""Every Python block of the README runs as written, and so does every `curl` line.

Blocks that talk to `http://localhost:8000` run against a real server (the real engine on
the session's model) on a free port: the only change made to them is that address.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()
ADDRESS = "http://localhost:8000"
PY_BLOCKS = re.findall(r"```python\n(.*?)```", TEXT, flags=re.S)
CURL_LINES = [
    line for block in re.findall(r"```sh\n(.*?)```", TEXT, flags=re.S)
    for line in block.replace("\\\n", " ").splitlines() if line.strip().startswith("curl ")
]


def _needs_model(code: str) -> bool:
    return "LLM(" in code or "localhost:8000" in code


def test_top_of_readme_has_the_two_commands() -> None:
    head = TEXT.split("\n```", 2)
    assert "make demo" in head[1] and "make test" in head[1], "the first code block changed"
    assert PY_BLOCKS and CURL_LINES


@pytest.fixture(scope="module")
def server(smollm2: Any) -> Iterator[str]:
    from pagedkv.engine import LLMEngine
    from pagedkv.server import ServerThread, build_app

    engine = LLMEngine(smollm2, num_blocks=256, max_model_len=1024)
    with ServerThread(build_app(engine)) as thread:
        yield thread.url


@pytest.fixture(scope="module")
def admin_server(smollm2: Any) -> Iterator[str]:
    """A server with an admin API key (its value in $ADMIN_KEY): admin-only README lines."""
    from pagedkv.engine import LLMEngine
    from pagedkv.server import ServerThread, build_app

    engine = LLMEngine(smollm2, num_blocks=64, max_model_len=1024)
    with ServerThread(build_app(engine, api_key=ADMIN_KEY)) as thread:
        yield thread.url


ADMIN_KEY = "readme-admin"


@pytest.mark.parametrize(
    "code",
    [pytest.param(c, marks=[pytest.mark.slow] if _needs_model(c) else [],
                  id=f"python-block-{i}") for i, c in enumerate(PY_BLOCKS)],
)
def test_python_block_runs(code: str, request: pytest.FixtureRequest, capsys: Any) -> None:
    if ADDRESS in code:
        code = code.replace(ADDRESS, request.getfixturevalue("server"))
    exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})  # noqa: S102
    assert capsys.readouterr().out.strip(), "a README block should show something"


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
@pytest.mark.parametrize("line", CURL_LINES)
def test_curl_line_runs(line: str, request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("admin_server" if "$ADMIN_KEY" in line else "server")
    cmd = re.sub(r"(?<![\w/])localhost:8000", server.removeprefix("http://"), line)
    out = subprocess.run(["bash", "-c", cmd + " --fail-with-body"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "ADMIN_KEY": ADMIN_KEY})
    assert out.returncode == 0, out.stdout + out.stderr
    body = json.loads(out.stdout)
    assert "error" not in body


def test_license_matches_pyproject() -> None:
    root = README.parent
    assert 'license = { text = "Apache-2.0" }' in (root / "pyproject.toml").read_text()
    text = (root / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_first_screen_numbers_are_the_demos() -> None:
    from pagedkv.demo import paged_vs_contiguous

    lines = "\n".join(paged_vs_contiguous())
    first_screen = TEXT.split("**Hardware")[0]
    for readme, demo in (("median length 318", "median 318"), ("10.8% of 32 GiB", "32.00 GiB"),
                         ("10.8%", "utilization 10.8%"), ("3.5 GiB", "3.51 GiB"),
                         ("98.4%", "utilization 98.4%"), ("9.1x", "9.1x less memory")):
        assert readme in first_screen and demo in lines, (readme, demo)
