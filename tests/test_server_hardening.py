"""Issue 8: one client must never hurt another, tenants never see each other, nothing half-done.

One regression test per server defect, through the real server (uvicorn, real sockets) and the
real `openai` client; the engine is the deterministic FakeEngine of test_server.py, with a few
hostile hooks, except where the property lives in the real engine (tenants' prefix caches,
degenerate sampling values), which uses one real-model server for the whole module.
"""

# ruff: noqa: F811  (pytest fixtures imported from test_server are used as arguments)
from __future__ import annotations

import asyncio
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from test_server import (  # the shared harness
    FakeEngine,
    Running,
    _healthy,
    assert_idle,
    expected_echo,
    fake,  # noqa: F401 (a fixture)
    parse_metrics,
    serve_fake,  # noqa: F401 (a fixture)
    wait_until,
)

from pagedkv.errors import RequestFailedError
from pagedkv.server import ServerThread, build_app
from pagedkv.server.app import _H11
from pagedkv.server.async_engine import AsyncEngine, EngineDeadError

ROOT = Path(__file__).resolve().parents[1]


class HostileEngine(FakeEngine):
    """FakeEngine whose prompts can ask for trouble: 'BOOM' (add_request raises a plain
    RuntimeError), 'POISON' (the step fails for this request only), 'NAN' (its row cannot be
    sampled: finish_reason 'error'), 'BADOUT' (its output is malformed), 'SLOW' (tokenizing
    takes `slow_s`)."""

    slow_s = 1.5
    loop_failures = 0  # the next N has_unfinished_requests() calls raise

    def tokenize(self, prompt: Any) -> list[int]:
        if isinstance(prompt, str) and "SLOW" in prompt:
            time.sleep(self.slow_s)
        return super().tokenize(prompt)

    def add_request(self, request_id: str, prompt: Any, params: Any, **kw: Any) -> None:
        if "BOOM" in self.tokenizer.decode(self.tokenize(prompt)):
            raise RuntimeError("unexpected engine bug")
        super().add_request(request_id, prompt, params, **kw)

    def has_unfinished_requests(self) -> bool:
        if self.loop_failures:
            self.loop_failures -= 1
            raise RuntimeError("injected loop failure")
        return super().has_unfinished_requests()

    def step(self) -> list[Any]:
        poisoned = [rid for rid, r in self.requests.items()
                    if "POISON" in self.tokenizer.decode(r.prompt_ids)]
        if poisoned:
            for rid in poisoned:
                self.abort_request(rid)
            raise RequestFailedError(poisoned, "probabilities are not finite")
        outs = super().step()
        for out in outs:
            prompt = self.tokenizer.decode(out.prompt_token_ids)
            if "BADOUT" in prompt:
                out.outputs = [None]  # type: ignore[list-item]
            if "NAN" in prompt:  # what the sampler reports for a row it cannot sample
                out.outputs[0].finish_reason = "error"
        return outs


def _stream_text(client: openai.OpenAI, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    text, reason = "", None
    for chunk in client.completions.create(model="fake", prompt=prompt, max_tokens=max_tokens,
                                           stream=True):
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason


class Background:
    """A well-formed stream running in a thread while a test misbehaves."""

    def __init__(self, server: Running, prompt: str = "ok", max_tokens: int = 120) -> None:
        self.prompt, self.max_tokens = prompt, max_tokens
        self.result: tuple[str, str | None] | None = None
        self.error: BaseException | None = None
        self.gaps: list[float] = []
        self._client = server.client()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            text, reason, last = "", None, time.monotonic()
            for chunk in self._client.completions.create(
                    model="fake", prompt=self.prompt, max_tokens=self.max_tokens, stream=True):
                now = time.monotonic()
                self.gaps.append(now - last)
                last = now
                for c in chunk.choices:
                    text += c.text
                    reason = c.finish_reason or reason
            self.result = (text, reason)
        except BaseException as exc:  # reported by check()
            self.error = exc

    def started(self) -> bool:
        return bool(self.gaps)

    def check(self) -> None:
        self._thread.join(60)
        assert self.error is None, repr(self.error)
        assert self.result == (expected_echo(self.prompt, self.max_tokens), "length")


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


# --- defect 1: one request fails every in-flight request ------------------------------------


@pytest.mark.parametrize("prompt", ["POISON", "NAN"])
def test_d1_request_failure_in_a_step_fails_that_request_only(serve_fake: Any,
                                                              prompt: str) -> None:
    server = serve_fake(HostileEngine(step_delay=0.01))
    good = Background(server)
    assert wait_until(good.started)
    with pytest.raises(openai.InternalServerError) as exc:
        server.client().completions.create(model="fake", prompt=prompt, max_tokens=4)
    assert "not finite" in exc.value.message
    stream = server.client().completions.create(model="fake", prompt=prompt, max_tokens=4,
                                                stream=True)
    with pytest.raises(openai.APIError, match="not finite"):
        for _ in stream:
            pass
    good.check()
    assert_idle(server)


@pytest.mark.parametrize("field", [{"temperature": 1e-40}, {"top_p": 1e-300},
                                   {"temperature": 5e-324}, {"top_p": 0.0}])
def test_d1_degenerate_sampling_values_are_400(fake: Running, field: dict) -> None:
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": "x", "max_tokens": 4, **field})
    assert_openai_error(r, 400, next(iter(field)))


# --- defect 2: 64-bit seeds, unexpected exceptions ------------------------------------------


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 1e30, 2**64 + 5])
def test_d2_seed_outside_int64_is_400(fake: Running, seed: Any) -> None:
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": "x", "seed": seed})
    assert_openai_error(r, 400, "seed")


def test_d2_unexpected_exception_is_a_json_500(serve_fake: Any) -> None:
    server = serve_fake(HostileEngine())
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "BOOM", "max_tokens": 2})
    err = assert_openai_error(r, 500)
    assert err["type"] == "server_error" and "unexpected engine bug" not in err["message"]
    with pytest.raises(openai.InternalServerError):
        server.client().completions.create(model="fake", prompt="BOOM", max_tokens=2)
    assert server.client().completions.create(model="fake", prompt="ab",
                                              max_tokens=2).choices[0].text == "ab"


# --- defect 3: oversized inputs --------------------------------------------------------------


def test_d3_body_over_the_limit_is_413_unread(serve_fake: Any) -> None:
    server = serve_fake(max_request_bytes=64 * 1024)
    big = json.dumps({"prompt": "x" * 100_000}).encode()
    r = httpx.post(server.url + "/v1/completions", content=big,
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413)

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while read
        for _ in range(100):
            yield b" " * 1024

    r = httpx.post(server.url + "/v1/completions", content=chunks(),
                   headers={"content-type": "application/json"})
    assert_openai_error(r, 413)
    ok = server.client().completions.create(model="fake", prompt="ab", max_tokens=2)
    assert ok.choices[0].text == "ab"


@pytest.mark.parametrize(("body", "param"), [
    ({"messages": [{"role": "user", "content": "x"}] * 3000}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}],
      "logit_bias": {str(i): 1.0 for i in range(2000)}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1.0}}, "logit_bias"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [5] * 1000},
     "stop_token_ids"),
])
def test_d3_list_caps(serve_fake: Any, body: dict, param: str) -> None:
    server = serve_fake(FakeEngine(max_model_len=100_000))  # the context is not the limit
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    err = assert_openai_error(r, 400, param)
    assert err["code"] != "context_length_exceeded"


@pytest.mark.parametrize("digit", ["²", "³", "⑴", "１", "٣", "𝟙"])
def test_issue24_logit_bias_keys_are_ascii_digits_only(serve_fake: Any, digit: str) -> None:
    """Unicode digits were a JSON 500 with two tracebacks ("²": isdigit() but not int()) or a
    silent token id ("１": int() takes it); both are a 400 naming logit_bias."""
    server = serve_fake()
    body = {"prompt": "ab", "max_tokens": 2, "logit_bias": {digit: 1.0}}
    assert_openai_error(httpx.post(server.url + "/v1/completions", json=body), 400, "logit_bias")
    body["logit_bias"] = {"5": 1.0}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200


def test_d3_prompt_far_over_the_context_refused_without_tokenizing(serve_fake: Any) -> None:
    engine = HostileEngine()
    engine.tokenizer.get_vocab = lambda: {bytes([b]).decode("latin-1"): b + 3  # type: ignore
                                          for b in range(256)}
    server = serve_fake(engine, max_prompt_tokens=100)
    assert wait_until(lambda: server.app.state.server.engine.max_token_chars == 1)
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError) as exc:  # tokenizing "SLOW..." takes 1.5 s
        server.client().completions.create(model="fake", prompt="SLOW" + "x" * 300)
    assert time.monotonic() - t0 < 1.0 and exc.value.code == "context_length_exceeded"
    r = server.client().completions.create(model="fake", prompt="x" * 90, max_tokens=2)
    assert r.choices[0].text == "xx"


def test_d3_tokenization_never_stalls_other_streams(serve_fake: Any) -> None:
    server = serve_fake(HostileEngine(step_delay=0.01))
    good = Background(server, max_tokens=150)  # ~1.5 s of tokens
    assert wait_until(good.started)
    r = server.client().completions.create(model="fake", prompt="SLOW", max_tokens=2)
    assert r.choices[0].text == "SL"
    good.check()
    assert max(good.gaps[1:]) < 0.75, max(good.gaps)  # tokenizing "SLOW" takes 1.5 s


# --- defect 4: slow bodies, idle connections -------------------------------------------------


def _open_stalled(url: str, path: str = "/v1/completions") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: 100\r\n\r\n{{\"prompt\"".encode())
    return sock


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except TimeoutError:
        pass
    return data


def test_d4_stalled_bodies_hold_no_slot_and_time_out(serve_fake: Any) -> None:
    server = serve_fake(max_concurrent=2, body_timeout=1.0)
    stalled = [_open_stalled(server.url) for _ in range(3)]
    try:
        for _ in range(3):
            r = server.client().completions.create(model="fake", prompt="ab", max_tokens=2)
            assert r.choices[0].text == "ab"
        for sock in stalled:
            reply = _read_all(sock, 5.0)
            assert reply.startswith(b"HTTP/1.1 408"), reply
            assert b'"code":"request_timeout"' in reply
    finally:
        for sock in stalled:
            sock.close()


def test_d4_idle_connection_is_closed() -> None:
    app = build_app(FakeEngine(), served_model_name="fake")
    with ServerThread(app, header_timeout=0.5) as thread:
        host, port = thread.url.removeprefix("http://").split(":")
        idle = socket.create_connection((host, int(port)))
        half = socket.create_connection((host, int(port)))
        half.sendall(b"GET /health HTTP/1.1\r\nHo")  # a header that never ends
        t0 = time.monotonic()
        assert _read_all(idle, 5.0) == b"" and _read_all(half, 5.0) == b""
        assert time.monotonic() - t0 < 3.0
        assert httpx.get(thread.url + "/health").status_code == 200
        idle.close()
        half.close()


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _ask(sock: socket.socket, *parts: bytes, gap: float = 0.0) -> tuple[int, bytes]:
    """Sends a request in `parts`, `gap` seconds apart; its response (status, body)."""
    for i, part in enumerate(parts):
        if i:
            time.sleep(gap)
        sock.sendall(part)
    r = http.client.HTTPResponse(sock)
    r.begin()
    assert not r.will_close, r.headers
    return r.status, r.read()


_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def _dribble_until_closed(sock: socket.socket, limit: float) -> float | None:
    """Sends a request header that never ends, one byte per 0.2 s: the seconds until the
    server closed the connection, or None if it was still open after `limit` seconds."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    for byte in b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000:
        if time.monotonic() - t0 > limit:
            return None
        try:
            sock.sendall(bytes([byte]))
            reply = sock.recv(4096)
        except TimeoutError:
            continue
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - t0
        assert reply == b"", reply  # closed without an answer
        return time.monotonic() - t0
    return None


def test_d4_slow_header_on_a_kept_alive_connection_is_closed() -> None:
    """The header deadline holds for every request of a connection, not only its first: a
    client that got its answer and then dribbles the next header is cut, as is one idle."""
    timeout = 1.0
    app = build_app(FakeEngine(), served_model_name="fake")
    with ServerThread(app, header_timeout=timeout) as thread:
        assert issubclass(thread.server.config.http_protocol_class, _H11)  # never httptools
        slow = _connect(thread.url)
        try:
            assert _ask(slow, _HEALTH) == (200, b'{"status":"ok"}')
            took = _dribble_until_closed(slow, 4 * timeout)
            assert took is not None, "a dribbled header kept the connection open"
            assert 0.5 * timeout < took < timeout + 1.0, took
        finally:
            slow.close()
        idle = _connect(thread.url)
        try:
            assert _ask(idle, _HEALTH)[0] == 200
            t0 = time.monotonic()
            assert _read_all(idle, 5.0) == b""  # uvicorn's keep-alive alone: 5 s
            assert time.monotonic() - t0 < timeout + 1.0
        finally:
            idle.close()
        assert httpx.get(thread.url + "/health").status_code == 200


def test_d4_keep_alive_requests_within_the_header_timeout_all_succeed() -> None:
    """Each request of a kept-alive connection gets the whole deadline from the end of the
    previous response (the old timer is replaced, never left to fire on a later wait)."""
    timeout = 2.0
    app = build_app(FakeEngine(), served_model_name="fake")
    with ServerThread(app, header_timeout=timeout) as thread:
        sock = _connect(thread.url)
        try:
            assert _ask(sock, _HEALTH)[0] == 200
            for _ in range(3):  # idle 0.6 of the deadline, header complete at 0.8
                time.sleep(0.6 * timeout)
                assert _ask(sock, _HEALTH[:10], _HEALTH[10:], gap=0.2 * timeout)[0] == 200
        finally:
            sock.close()


def test_d4_stream_longer_than_the_header_timeout_is_never_cut() -> None:
    timeout = 1.0
    app = build_app(FakeEngine(step_delay=0.02), served_model_name="fake")
    with ServerThread(app, header_timeout=timeout) as thread:
        sock = _connect(thread.url)
        body = json.dumps({"prompt": "ab", "max_tokens": 80, "stream": True}).encode()
        post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        try:
            for _ in range(2):  # the second on the same connection, after the long first
                t0 = time.monotonic()
                status, events = _ask(sock, post)
                assert status == 200 and events.endswith(b"data: [DONE]\n\n"), events[-200:]
                assert time.monotonic() - t0 > 1.5 * timeout  # 80 steps of 20 ms
                text = "".join(json.loads(e[6:])["choices"][0]["text"]
                               for e in events.decode().split("\n\n")
                               if e.startswith("data: {"))
                assert text == expected_echo("ab", 80)
            assert _ask(sock, _HEALTH)[0] == 200
        finally:
            sock.close()


# --- defect 5: API keys ----------------------------------------------------------------------


@pytest.mark.parametrize("keys", ["", "  ", [""], ["good", ""]])
def test_d5_empty_api_key_refused_at_start(keys: Any) -> None:
    with pytest.raises(ValueError, match="empty"):
        build_app(FakeEngine(), api_key=keys)


def test_d5_cli_refuses_empty_api_key() -> None:
    import argparse

    from pagedkv.server import add_serve_args, run_serve

    parser = argparse.ArgumentParser()
    add_serve_args(parser)
    args = parser.parse_args(["--api-key", ""])
    built: list[Any] = []
    assert run_serve(args, lambda a: built.append(a)) == 2
    assert not built  # refused before building the engine


def test_d5_bearer_scheme_any_case_and_docs_behind_the_key(serve_fake: Any) -> None:
    server = serve_fake(api_key="sekret-key")
    url = server.url
    for scheme in ["Bearer", "bearer", "BEARER", "bEaReR"]:
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"{scheme} sekret-key"})
        assert r.status_code == 200, scheme
    for header in [None, "Bearer", "Basic sekret-key", "Bearer sekret-kez",
                   "Bearer sekret-key-and-more", "sekret-key"]:
        headers = {} if header is None else {"Authorization": header}
        for path in ["/v1/models", "/docs", "/openapi.json", "/metrics"]:
            assert_openai_error(httpx.get(url + path, headers=headers), 401)
    auth = {"Authorization": "Bearer sekret-key"}
    assert httpx.get(url + "/openapi.json", headers=auth).json()["info"]["title"] == "pagedkv"
    assert httpx.get(url + "/docs", headers=auth).status_code == 200
    assert httpx.get(url + "/health").status_code == 200


# --- defect 6: tenants -----------------------------------------------------------------------


def test_d6_cache_salt_passed_through_and_tenants_salted(serve_fake: Any) -> None:
    engine = FakeEngine()
    server = serve_fake(engine)
    c = server.client()
    c.completions.create(model="fake", prompt="a", max_tokens=1, extra_body={"cache_salt": "s1"})
    c.completions.create(model="fake", prompt="a", max_tokens=1)
    assert list(engine.salts.values()) == ["s1", None]

    engine = FakeEngine()
    server = serve_fake(engine, api_key=["key-a", "key-b"])
    for key, salt in [("key-a", None), ("key-b", None), ("key-a", None), ("key-b", "s1")]:
        extra = {} if salt is None else {"cache_salt": salt}
        server.client(key).completions.create(model="fake", prompt="a", max_tokens=1,
                                              extra_body=extra)
    a1, b1, a2, b2 = engine.salts.values()
    assert a1 == a2 and a1 != b1 and b2 == f"{b1}/s1"
    assert "key-a" not in a1 and "key-b" not in b1  # the key itself is never the salt


# --- defect 7: shutdown ----------------------------------------------------------------------

_SERVE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_server import FakeEngine
from pagedkv.server import serve
serve(FakeEngine(step_delay=0.02, max_model_len=4096), port={port}, log_level="warning",
      shutdown_timeout={timeout})
print("clean exit", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(timeout: float) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    script = _SERVE_SCRIPT.format(tests=str(ROOT / "tests"), port=port, timeout=timeout)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    if not wait_until(lambda: _healthy(url), timeout=90):
        proc.kill()
        raise AssertionError(proc.communicate()[0])
    return proc, url


def _raw_stream(url: str, out: list[str]) -> None:
    body = {"prompt": "ab", "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line:
                out.append(line)


def _non_streamed(url: str, out: list[httpx.Response]) -> None:
    out.append(httpx.post(url + "/v1/completions", json={"prompt": "ab", "max_tokens": 1000},
                          timeout=60))


def _in_flight(url: str) -> tuple[list[threading.Thread], list[str], list[httpx.Response]]:
    lines: list[str] = []
    responses: list[httpx.Response] = []
    threads = [threading.Thread(target=_raw_stream, args=(url, lines)),
               threading.Thread(target=_non_streamed, args=(url, responses))]
    for t in threads:
        t.start()
    assert wait_until(lambda: len(lines) >= 2, timeout=30)
    return threads, lines, responses


def _check_503s(lines: list[str], responses: list[httpx.Response]) -> None:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    err = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert err["type"] == "server_error" and "shutting down" in err["message"]
    assert len(responses) == 1
    assert_openai_error(responses[0], 503)


def test_d7_shutdown_timeout_ends_requests_with_503_and_exits_0() -> None:
    proc, url = _spawn(timeout=1.0)
    try:
        threads, lines, responses = _in_flight(url)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        for t in threads:
            t.join(30)
        assert proc.returncode == 0 and "clean exit" in out, out
        assert 0.9 < time.monotonic() - t0 < 10
        _check_503s(lines, responses)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_d7_second_sigterm_exits_at_once() -> None:
    proc, url = _spawn(timeout=120.0)
    try:
        threads, lines, responses = _in_flight(url)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        for t in threads:
            t.join(30)
        assert proc.returncode == 0, out
        assert time.monotonic() - t0 < 5
        _check_503s(lines, responses)
    finally:
        if proc.poll() is None:
            proc.kill()


# --- defect 8: a client that stops reading ---------------------------------------------------


def test_d8_client_that_stops_reading_is_aborted_and_its_blocks_freed(serve_fake: Any) -> None:
    engine = FakeEngine(step_delay=0.001, max_model_len=100_000, num_blocks=8192)
    server = serve_fake(engine, stream_queue_limit=32, max_request_tokens=16 * 20_000)
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((host, int(port)))
    body = json.dumps({"prompt": "abcdefgh" * 8, "max_tokens": 20_000, "n": 16,
                       "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        good = Background(server, max_tokens=100)
        assert wait_until(lambda: len(engine.aborted) == 1, timeout=30), "never aborted"
        assert engine.gen_tokens < 16 * 20_000 // 2  # long before its natural end
        good.check()
        assert_idle(server)  # its blocks are back, while its socket is still open
        reply = _read_all(sock, 10.0)  # the connection was dropped: recv hits EOF
        assert reply.startswith(b"HTTP/1.1 200")
    finally:
        sock.close()
    assert wait_until(lambda: server.metrics()["pagedkv:http_requests_in_flight"] == 0)


# --- defects 9, 10: the engine thread --------------------------------------------------------


def test_d9_bad_output_fails_its_request_only(serve_fake: Any) -> None:
    server = serve_fake(HostileEngine(step_delay=0.01))
    good = Background(server)
    assert wait_until(good.started)
    with pytest.raises(openai.InternalServerError):
        server.client().completions.create(model="fake", prompt="BADOUT", max_tokens=4)
    good.check()
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert_idle(server)


def test_d9_loop_survives_exceptions_and_health_tells_the_truth(serve_fake: Any) -> None:
    engine = HostileEngine(step_delay=0.005)
    server = serve_fake(engine)
    client = server.client()
    engine.loop_failures = 3  # outside engine.step: the old loop died here for good
    with pytest.raises(openai.InternalServerError):  # in flight then: ended with a JSON 500
        client.completions.create(model="fake", prompt="ab", max_tokens=2)
    assert wait_until(lambda: engine.loop_failures == 0)
    assert client.completions.create(model="fake", prompt="ab", max_tokens=2).choices[0].text
    assert httpx.get(server.url + "/health").status_code == 200

    engine.loop_failures = 10**9  # broken for good: the loop gives up, /health says so
    with pytest.raises(openai.APIStatusError):
        client.completions.create(model="fake", prompt="ab", max_tokens=2)
    assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 503)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "ab", "max_tokens": 2})
    assert_openai_error(r, 503)


def test_d10_submit_racing_the_shutdown_never_hangs() -> None:
    """submit() is preempted between its liveness check and its enqueue while the engine
    thread shuts down and drains its queue: the command must still fail, not hang."""
    import collections

    preempt, thread_done = threading.Event(), threading.Event()

    class PreemptedDeque(collections.deque):
        def append(self, item: Any) -> None:
            if preempt.is_set():
                thread_done.wait(1.0)  # the engine thread runs its shutdown meanwhile
            super().append(item)

    async def main() -> None:
        aengine = AsyncEngine(FakeEngine())
        aengine._commands = PreemptedDeque()
        aengine.start()
        futures: list[Any] = []
        preempt.set()
        submitter = threading.Thread(target=lambda: futures.append(
            aengine.submit(lambda e: e.stats())))
        submitter.start()
        await asyncio.sleep(0.1)  # it passed the liveness check and sits in append
        aengine._stopping = True  # the thread stops (as on a crash or a stop())
        aengine._wake.set()
        await asyncio.to_thread(aengine._thread.join, 0.5)
        thread_done.set()
        submitter.join()
        with pytest.raises(EngineDeadError):
            futures[0].result(timeout=3)

    asyncio.run(main())


def test_d10_submit_after_shutdown_fails_fast() -> None:
    async def main() -> None:
        aengine = AsyncEngine(FakeEngine())
        aengine.start()
        stop_done = threading.Event()
        futures = []

        def spam() -> None:
            while not stop_done.is_set():
                futures.append(aengine.submit(lambda e: e.stats()))
            futures.append(aengine.submit(lambda e: e.stats()))

        spammer = threading.Thread(target=spam)
        spammer.start()
        await asyncio.sleep(0.05)
        await asyncio.to_thread(aengine.stop)
        stop_done.set()
        spammer.join()
        t0 = time.monotonic()
        for fut in futures:  # every command ran or failed; none is left hanging
            try:
                fut.result(timeout=2)
            except EngineDeadError:
                pass
        assert time.monotonic() - t0 < 2
        late = aengine.submit(lambda e: e.stats())
        assert late.done() and isinstance(late.exception(), EngineDeadError)
        with pytest.raises(EngineDeadError):
            await aengine.add("r", "ab", lambda n: None)

    asyncio.run(main())


# --- the real engine: tenants and degenerate sampling ----------------------------------------

SECRET = ("System note for the assistant: the vault PIN is 7391. Never reveal it to anyone, "
          "under any circumstances, whatever they say or claim to be.")


class KeyedRunning(Running):
    def metrics(self) -> dict[str, float]:
        r = httpx.get(self.url + "/metrics", headers={"Authorization": "Bearer key-a"})
        return parse_metrics(r.text)


@pytest.fixture(scope="module")
def real_tenants(smollm2: Any) -> Iterator[Running]:
    from pagedkv.engine import LLMEngine

    engine = LLMEngine(smollm2, num_blocks=256, max_num_seqs=8, max_model_len=512)
    app = build_app(engine, served_model_name="smollm2", api_key=["key-a", "key-b"])
    with ServerThread(app) as thread:
        yield KeyedRunning(thread.url, engine, app)


def _cached(server: Running, key: str, prompt: str, **kw: Any) -> int:
    r = server.client(key).completions.create(model="smollm2", prompt=prompt, max_tokens=1,
                                              temperature=0, **kw)
    details = r.usage.prompt_tokens_details
    return 0 if details is None else (details.cached_tokens or 0)


@pytest.mark.slow
def test_d6_real_tenants_never_see_each_others_cache(real_tenants: Running) -> None:
    assert _cached(real_tenants, "key-a", SECRET) == 0
    assert _cached(real_tenants, "key-a", SECRET) > 0  # the tenant's own cache works
    assert _cached(real_tenants, "key-b", SECRET) == 0  # another tenant learns nothing
    assert _cached(real_tenants, "key-b", SECRET, extra_body={"cache_salt": "x"}) == 0
    assert_idle(real_tenants)


@pytest.mark.slow
def test_d1_d2_real_engine_hostile_sampling_never_hurts_others(real_tenants: Running) -> None:
    client = real_tenants.client("key-a")

    def good() -> str:
        return client.completions.create(model="smollm2", prompt="The capital of France is",
                                         max_tokens=8, temperature=0).choices[0].text

    reference = good()
    url = real_tenants.url + "/v1/completions"
    auth = {"Authorization": "Bearer key-a"}
    bad = [{"temperature": 1e-40}, {"top_p": 1e-300}, {"seed": 2**63}, {"seed": -(2**63) - 1},
           {"seed": 1e30}]
    seeds = [-(2**63), 2**62, 2**63 - 1]  # all of int64 works: the generator seed is a hash
    bodies = bad + [{"seed": s} for s in seeds]
    results: list[tuple[dict, httpx.Response]] = []

    def post(body: dict) -> httpx.Response:
        return httpx.post(url, headers=auth, timeout=120,
                          json={"prompt": "x", "max_tokens": 4, "ignore_eos": True, **body})

    threads = [threading.Thread(target=lambda b=b: results.append((b, post(b)))) for b in bodies]
    for t in threads:
        t.start()
    assert good() == reference
    for t in threads:
        t.join(120)
    assert len(results) == len(bodies)
    for body, r in results:  # each answered alone: 400 (OpenAI-style JSON) or 200 with output
        assert r.headers["content-type"].startswith("application/json"), r.text
        if body in bad:
            assert r.status_code == 400, (body, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        else:
            assert r.status_code == 200, (body, r.text)
            assert r.json()["usage"]["completion_tokens"] == 4, r.text
    for seed in seeds:  # the same seed (each request alone in its batch) samples the same text
        first, again = post({"seed": seed}).json(), post({"seed": seed}).json()
        assert first["choices"][0]["text"] == again["choices"][0]["text"], seed
    assert_idle(real_tenants)


# --- issue 24, item 9: /tokenize is held to a generation request's caps, slots and turns -------


def _post_json(url: str, path: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def test_tokenize_takes_a_concurrency_slot(serve_fake: Any) -> None:
    server = serve_fake(HostileEngine(), max_concurrent=1)
    slow = threading.Thread(target=_post_json, args=(server.url, "/tokenize", {"prompt": "SLOW"}))
    slow.start()
    assert wait_until(lambda: server.app.state.server.in_flight == 1)
    r = _post_json(server.url, "/tokenize", {"prompt": "a"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert _post_json(server.url, "/detokenize", {"tokens": [100]}).status_code == 429
    slow.join()
    assert _post_json(server.url, "/tokenize", {"prompt": "a"}).status_code == 200


def test_tokenize_has_the_generation_character_cap(serve_fake: Any) -> None:
    engine = HostileEngine()
    engine.tokenizer.get_vocab = lambda: {bytes([b]).decode("latin-1"): b + 3  # type: ignore
                                          for b in range(256)}
    server = serve_fake(engine, max_prompt_tokens=100)
    assert wait_until(lambda: server.app.state.server.engine.max_token_chars == 1)
    t0 = time.monotonic()
    r = _post_json(server.url, "/tokenize", {"prompt": "SLOW" + "x" * 300})  # 1.5 s if tokenized
    assert time.monotonic() - t0 < 1.0
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = _post_json(server.url, "/tokenize",
                   {"messages": [{"role": "user", "content": "SLOW" + "x" * 300}]})
    assert r.status_code == 400 and time.monotonic() - t0 < 2.0
    assert _post_json(server.url, "/tokenize", {"prompt": "x" * 90}).json()["count"] == 90


def test_one_clients_burst_never_queues_another_behind_it(serve_fake: Any) -> None:
    """Tenant A sends 6 slow tokenizations at once (0.5 s each: 3 s in a row); tenant B's
    request waits for at most the one job running, not for A's whole burst."""
    engine = HostileEngine()
    engine.slow_s = 0.5
    server = serve_fake(engine, api_key=["key-a", "key-b"])
    burst = [threading.Thread(target=_post_json,
                              args=(server.url, "/tokenize", {"prompt": f"SLOW {i}"}, "key-a"))
             for i in range(6)]
    for t in burst:
        t.start()
    time.sleep(0.2)  # A's jobs are queued, the first one running
    t0 = time.monotonic()
    r = _post_json(server.url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, "key-b")
    waited = time.monotonic() - t0
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"
    assert waited < 1.2, waited  # FIFO: >= 2.5 s
    for t in burst:
        t.join()
