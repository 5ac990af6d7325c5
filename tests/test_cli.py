"""The `pagedkv` command line, end to end in a subprocess.

Every bad command ends with ONE line on stderr, no traceback and a non-zero exit; the cases
that need no model are fast because the checks run before the model loads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return dict(os.environ, HF_HUB_OFFLINE="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedkv.cli", *args], capture_output=True,
                          text=True, timeout=300, env=_env(), input=stdin or "")


def _one_line_error(r: subprocess.CompletedProcess, *words: str) -> None:
    assert r.returncode != 0, r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines, "no error message"
    last = lines[-1]
    assert "Traceback" not in r.stderr, r.stderr
    assert "error" in last, r.stderr
    for w in words:
        assert w in last, (w, r.stderr)


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("generate", "--top-p", "2", "hi"), ("--top-p", "(0, 1]")),
        (("generate", "--temperature", "-1", "hi"), ("--temperature", ">= 0")),
        (("generate", "--block-size", "0", "hi"), ("--block-size", "at least 1")),
        (("generate", "--kv-cache-memory", "lots", "hi"), ("--kv-cache-memory", "lots")),
        (("generate", "--model", "/no/such/model.gguf", "hi"), ("not found", "model.gguf")),
        (("generate", "--model", "meta-llama/Llama-3.2-1B", "hi"),
         ("hub id", "huggingface-cli download meta-llama/Llama-3.2-1B", "--model")),
        (("generate", "--file", "/no/such/prompt.txt"), ("--file", "prompt.txt")),
        (("generate",), ("prompt",)),
        (("bench", "nonsense"), ("invalid choice",)),
        (("serve", "--port", "99999"), ("--port",)),
        (("serve", "--kv-cache-dtype", "q4_0"), ("q4_0", "int8", "fp8_e4m3")),
        (("generate", "--kv-cache-dtype", "int4", "hi"), ("int4", "bfloat16")),
        (("generate", "--activations", "int4", "hi"), ("--activations", "int4")),
        (("generate", "--weights", "float32", "--activations", "int8", "hi"),
         ("activations='int8'", "weights='quantized'")),
        (("generate", "--batch-weights", "int8", "hi"), ("--batch-weights", "int8")),
        (("serve", "--speculative-config", "{bad"), ("--speculative-config", "not valid JSON")),
        (("generate", "--speculative-config", '{"method": "eagle"}', "hi"),
         ("--speculative-config", "'eagle'")),
        (("serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 99}'),
         ("--speculative-config", "num_speculative_tokens", "[1, 15]")),
        (("serve", "--kv-tier-key", "abc"), ("KV tier key", "hex or base64")),
        (("serve", "--kv-tier-key", "00" * 8), ("at least 16 bytes",)),
        (("serve", "--kv-tier-key-file", "/no/such/key"), ("key file", "/no/such/key")),
        (("serve", "--kv-tier-key", "00" * 32, "--kv-tier-key-file", "/k"), ("not both",)),
        (("generate", "--weights", "float32", "--batch-weights", "float32", "hi"),
         ("batch_weights='float32'", "weights='quantized'")),
    ],
)
def test_bad_command_is_one_line_and_nonzero(args: tuple[str, ...], words: tuple[str, ...]) -> None:
    _one_line_error(_cli(*args), *words)


def test_unsupported_architecture_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["BertModel"], "model_type": "bert"}')
    _one_line_error(_cli("generate", "--model", str(tmp_path), "hi"), "unsupported architecture")


def test_debug_shows_the_traceback() -> None:
    r = _cli("generate", "--debug", "--model", "/no/such/model.gguf", "hi")
    assert r.returncode != 0 and "Traceback" in r.stderr and "ModelLoadError" in r.stderr


def test_serve_refuses_a_port_in_use_before_loading() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = _cli("serve", "--port", str(port))
    _one_line_error(r, "in use", str(port), "--port")
    assert "loading" not in r.stderr  # refused before the model load


def test_version_and_help_without_torch() -> None:
    r = _cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("pagedkv 0.")
    # --help must not pay for importing torch (seconds) or the model
    code = ("import sys\nfrom pagedkv.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    main(['generate', '--help'])\nexcept SystemExit:\n    pass\n"
            "try:\n    main(['serve', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, env=_env())
    assert r.returncode == 0, r.stderr
    assert "--kv-cache-memory" in r.stdout and "(default: 1GiB)" in r.stdout
    assert "(default: 16)" in r.stdout  # --block-size
    assert "--api-key" in r.stdout and "--log-stats-interval" in r.stdout  # serve's own


def test_python_api_names() -> None:
    import pagedkv
    from pagedkv import LLM, SamplingParams

    assert LLM.__name__ == "LLM" and SamplingParams(max_tokens=3).max_tokens == 3
    assert {"LLM", "SamplingParams", "PagedKVCache", "KVStorage"} <= set(pagedkv.__all__)


@pytest.mark.slow
def test_generate_streams_greedy_answer_from_stdin(smollm2) -> None:  # noqa: ANN001
    from pagedkv import LLM, SamplingParams

    r = _cli("generate", "--max-tokens", "12", "--kv-cache-memory", "64MiB",
             stdin="What is the capital of France?\n")
    assert r.returncode == 0, r.stderr
    expect = LLM(smollm2, num_blocks=64).generate(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=12))[0].text
    assert r.stdout.strip() == expect.strip()
    err = r.stderr
    assert "threads" in err and "SmolLM2" in err and "GGUF" in err and "KV cache:" in err
    summary = err.strip().splitlines()[-1]
    for part in ("load", "first token", "tok/s", "finish:"):
        assert part in summary, summary


@pytest.mark.slow
def test_prompt_over_the_context_is_one_line() -> None:
    _one_line_error(_cli("generate", "--max-model-len", "8", "--num-blocks", "8",
                         "a prompt well over eight tokens long, for sure " * 3),
                    "context")


@pytest.mark.slow
def test_ctrl_c_ends_generate_on_a_new_line() -> None:
    p = subprocess.Popen(
        [sys.executable, "-m", "pagedkv.cli", "generate", "--max-tokens", "4000", "--raw",
         "--num-blocks", "300", "--temperature", "1", "--seed", "0", "Once upon a time"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        stdin=subprocess.DEVNULL,
        # as from a terminal: under a shell's background job without job control (`(cmd &)`),
        # the test inherits SIGINT ignored, the CLI's Python then installs no handler for it,
        # and the Ctrl-C below would never arrive (the test failed so, 60 s of generation)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = p.stdout.read(1)  # the first streamed character: generation is under way
    p.send_signal(signal.SIGINT)
    rest, err = p.communicate(timeout=120)
    assert first and p.returncode == 130, err
    assert (first + rest).endswith("\n")
    assert "Traceback" not in err
    assert "interrupted" in err.strip().splitlines()[-1]
