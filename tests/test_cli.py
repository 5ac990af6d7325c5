"""The `pagedkv` command line, end to end in a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-m", "pagedkv.cli", *args], capture_output=True,
                          text=True, timeout=300, env=env)


@pytest.mark.slow
def test_generate_streams_greedy_answer(smollm2) -> None:  # noqa: ANN001
    from pagedkv.engine import LLM, SamplingParams

    r = _cli("generate", "What is the capital of France?", "--max-tokens", "12",
             "--kv-cache-memory", "64MiB")
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr
    expect = LLM(smollm2, num_blocks=64).generate(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=12))[0].text
    assert r.stdout.strip() == expect.strip()


def test_cli_rejects_bad_arguments() -> None:
    r = _cli("generate")
    assert r.returncode != 0 and "prompt" in r.stderr
    r = _cli("bench", "nonsense")
    assert r.returncode != 0 and "invalid choice" in r.stderr
