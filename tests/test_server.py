"""The OpenAI-compatible server, driven over real HTTP by the `openai` client.

Most cases run against FakeEngine (deterministic, fast, no model); the `slow` cases at the
end run the real LLMEngine.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from pagedkv.engine import CompletionOutput, EngineStats, RequestOutput, SamplingParams
from pagedkv.errors import InvalidParamsError, RequestTooLongError
from pagedkv.server import ServerThread, build_app

ROOT = Path(__file__).resolve().parents[1]

# --- a deterministic engine ------------------------------------------------------------------


class FakeTokenizer:
    """Byte-level: token id = byte + 3 (0..2 are special; 2 is EOS)."""

    eos_token_id = 2
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - 3 for i in ids if i >= 3).decode("utf-8", "replace")


@dataclass
class _FakeRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    echo: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass
class _FakeCache:
    engine: FakeEngine

    def check_invariants(self) -> None:
        e = self.engine
        assert sum(e.blocks.values()) == e.blocks_used, "block count drifted"
        assert set(e.blocks) <= set(e.running), "a block is held by a request not running"
        assert 0 <= e.blocks_used <= e.num_blocks


class FakeEngine:
    """LLMEngine's interface; generates by echoing the prompt (for chat: the last user
    message) one byte-token per step, each step taking `step_delay` seconds. Blocks are
    reserved for prompt + max_tokens at admission, so leaks and aborts are observable."""

    model_name = "fake-model"

    def __init__(self, *, step_delay: float = 0.002, max_model_len: int = 256,
                 num_blocks: int = 2048, block_size: int = 4, max_num_seqs: int = 64) -> None:
        self.tokenizer = FakeTokenizer()
        self.step_delay = step_delay
        self.max_model_len = max_model_len
        self.num_blocks, self.block_size, self.max_num_seqs = num_blocks, block_size, max_num_seqs
        self.requests: dict[str, _FakeRequest] = {}
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.blocks: dict[str, int] = {}
        self.blocks_used = 0
        self.aborted: list[str] = []
        self.finished = self.prompt_tokens = self.gen_tokens = 0
        self.fail_next_step = False
        self.salts: dict[str, str | None] = {}
        self.threads: set[int] = set()  # every thread that ever called in: must be one
        self.cache = _FakeCache(self)

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def tokenize(self, prompt: Any) -> list[int]:
        """Pure (the server calls it on its preprocessing thread)."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if prompt and all(isinstance(m, dict) for m in prompt):
            text = "".join(f"<{m['role']}>{m['content']}\n" for m in prompt) + "<assistant>"
            return self.tokenizer.encode(text)
        if any(not 0 <= t < FakeTokenizer.vocab_size for t in prompt):
            raise InvalidParamsError("token id out of range")
        return list(prompt)

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *,
                    cache_salt: str | None = None, tenant: str | None = None) -> None:
        self._touch()
        self.salts[request_id] = cache_salt
        ids = self.tokenize(prompt)
        if request_id in self.requests or not ids:
            raise InvalidParamsError("duplicate id or empty prompt")
        if len(ids) >= self.max_model_len:
            raise RequestTooLongError("prompt too long")
        text = self.tokenizer.decode(ids)
        if "<user>" in text:
            text = text.rsplit("<user>", 1)[1].split("\n", 1)[0]
        req = _FakeRequest(request_id, ids, params, self.tokenizer.encode(text) or [3])
        req.outputs = [CompletionOutput(i, "", [], None) for i in range(params.n)]
        self.requests[request_id] = req
        self.waiting.append(request_id)
        self.prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> None:
        self._touch()
        if self.requests.pop(request_id, None) is None:
            return
        self.aborted.append(request_id)
        self._release(request_id)

    def _release(self, request_id: str) -> None:
        for queue in (self.waiting, self.running):
            if request_id in queue:
                queue.remove(request_id)
        self.blocks_used -= self.blocks.pop(request_id, 0)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.requests)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            req = self.requests[self.waiting[0]]
            need = math.ceil((len(req.prompt_ids) + req.params.max_tokens) / self.block_size)
            if self.blocks_used + need > self.num_blocks:
                return
            self.running.append(self.waiting.pop(0))
            self.blocks[req.request_id] = need
            self.blocks_used += need

    def step(self) -> list[RequestOutput]:
        self._touch()
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected failure")
        time.sleep(self.step_delay)
        self._admit()
        outs = []
        for rid in list(self.running):
            req = self.requests[rid]
            for out in req.outputs:
                if out.finish_reason is None:
                    self._advance(req, out)
            done = all(o.finish_reason for o in req.outputs)
            outs.append(RequestOutput(
                rid, None, req.prompt_ids,
                [CompletionOutput(o.index, o.text, list(o.token_ids), o.finish_reason,
                                  None if o.logprobs is None else list(o.logprobs))
                 for o in req.outputs],
                done, 0,
            ))
            if done:
                del self.requests[rid]
                self._release(rid)
                self.finished += 1
        return outs

    def _advance(self, req: _FakeRequest, out: CompletionOutput) -> None:
        p = req.params
        tok = req.echo[len(out.token_ids) % len(req.echo)]
        out.token_ids.append(tok)
        self.gen_tokens += 1
        if p.logprobs is not None:
            out.logprobs = (out.logprobs or []) + [{tok: -0.25, (tok % 250) + 4: -2.0}]
        out.text = self.tokenizer.decode(out.token_ids)
        cuts = [i for i in (out.text.find(s) for s in p.stop) if i >= 0]
        if cuts:
            out.text, out.finish_reason = out.text[: min(cuts)], "stop"
        elif tok in p.stop_token_ids:
            out.finish_reason = "stop"
        elif len(out.token_ids) >= p.max_tokens:
            out.finish_reason = "length"

    def stats(self) -> EngineStats:
        self._touch()
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_usage=self.blocks_used / self.num_blocks, num_blocks=self.num_blocks,
            blocks_used=self.blocks_used, blocks_cached=0,
            blocks_free=self.num_blocks - self.blocks_used, prefix_cache_queries=0,
            prefix_cache_hits=0, prefix_hit_rate=0.0, num_preemptions=0,
            num_requests_finished=self.finished, prompt_tokens_total=self.prompt_tokens,
            generation_tokens_total=self.gen_tokens, cow_copies=0, fork_shared_blocks=0,
            fork_saved_bytes=0, gen_tokens_per_s=0.0,
        )


def expected_echo(text: str, n: int) -> str:
    return (text * (n // len(text) + 1))[:n]


# --- harness ---------------------------------------------------------------------------------


@dataclass
class Running:
    url: str
    engine: Any
    app: Any

    def client(self, api_key: str = "unused") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0,
                             timeout=30)

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=30).text)


def parse_metrics(text: str) -> dict[str, float]:
    """{sample: value}, the model_name label left out of the sample names."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = re.sub(r'(,?)model_name="[^"]*"(,?)',
                          lambda g: "," if g[1] and g[2] else "", name).replace("{}", "")
            values[name] = float(value)
    return values


@pytest.fixture
def serve_fake() -> Iterator[Any]:
    """Factory: serve_fake(engine=None, **build_app kwargs) -> Running; stopped at teardown."""
    started: list[ServerThread] = []

    def start(engine: Any = None, **kwargs: Any) -> Running:
        engine = engine or FakeEngine()
        kwargs.setdefault("served_model_name", "fake")
        app = build_app(engine, **kwargs)
        thread = ServerThread(app)
        started.append(thread)
        return Running(thread.start(), engine, app)

    yield start
    for thread in started:
        thread.stop()


@pytest.fixture
def fake(serve_fake: Any) -> Running:
    return serve_fake(max_prompt_tokens=200, max_tokens_limit=128)


def wait_until(cond: Any, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def assert_idle(server: Running) -> None:
    """No request holds a block, per /metrics and per the engine itself."""
    assert wait_until(lambda: server.metrics()['pagedkv:kv_cache_blocks{state="used"}'] == 0)
    m = server.metrics()
    assert m["pagedkv:num_requests_running"] == 0 and m["pagedkv:num_requests_waiting"] == 0
    aengine = server.app.state.server.engine
    aengine.submit(lambda e: e.cache.check_invariants()).result(timeout=30)


# --- happy paths -----------------------------------------------------------------------------


def test_completion_non_streamed(fake: Running) -> None:
    r = fake.client().completions.create(model="fake", prompt="abc", max_tokens=7,
                                         temperature=0)
    assert r.object == "text_completion" and r.model == "fake" and r.id.startswith("cmpl-")
    assert r.choices[0].text == "abcabca" and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (3, 7, 10)


def test_chat_non_streamed(fake: Running) -> None:
    r = fake.client().chat.completions.create(
        model="fake", max_completion_tokens=5,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == "hihih"
    assert r.usage.completion_tokens == 5 and r.usage.prompt_tokens > 5


def _stream_completion(client: openai.OpenAI, model: str = "fake",
                       **kw: Any) -> tuple[str, str | None, Any]:
    text, reason, usage = "", None, None
    for chunk in client.completions.create(model=model, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason, usage


def _stream_chat(client: openai.OpenAI, model: str = "fake",
                 **kw: Any) -> tuple[str, str | None, Any]:
    text, reason, usage = "", None, None
    for chunk in client.chat.completions.create(model=model, stream=True, **kw):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            reason = c.finish_reason or reason
    return text, reason, usage


@pytest.mark.parametrize("stop", [None, "ca", ["xyz", "bca"]])
def test_streamed_equals_non_streamed(fake: Running, stop: Any) -> None:
    client = fake.client()
    kw = {"prompt": "abc", "max_tokens": 12, "stop": stop}
    full = client.completions.create(model="fake", **kw)
    text, reason, usage = _stream_completion(client, stream_options={"include_usage": True},
                                             **kw)
    assert text == full.choices[0].text and reason == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens
    if stop:
        assert reason == "stop" and not any(s in text for s in ([stop] if isinstance(stop, str)
                                                                   else stop))

    msgs = [{"role": "user", "content": "abc"}]
    full = client.chat.completions.create(model="fake", messages=msgs, max_tokens=12, stop=stop)
    text, reason, usage = _stream_chat(client, messages=msgs, max_tokens=12, stop=stop)
    assert text == full.choices[0].message.content and reason == full.choices[0].finish_reason
    assert usage is None  # not asked for


def test_stream_wire_format(fake: Running) -> None:
    body = {"model": "fake", "messages": [{"role": "user", "content": "ab"}], "max_tokens": 3,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", fake.url + "/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}


def test_n_and_logprobs(fake: Running) -> None:
    client = fake.client()
    r = client.completions.create(model="fake", prompt="xy", max_tokens=4, n=2, logprobs=1)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 8
    lp = r.choices[0].logprobs
    assert lp.tokens == ["x", "y", "x", "y"] and lp.token_logprobs == [-0.25] * 4
    assert lp.text_offset == [0, 1, 2, 3] and all(len(t) == 1 for t in lp.top_logprobs)

    r = client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "q"}],
                                       max_tokens=2, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert [c.token for c in content] == ["q", "q"] and len(content[0].top_logprobs) == 2

    seen: dict[int, str] = {0: "", 1: ""}
    for chunk in client.completions.create(model="fake", prompt="xy", max_tokens=4, n=2,
                                           stream=True):
        for c in chunk.choices:
            seen[c.index] += c.text
    assert seen == {0: "xyxy", 1: "xyxy"}


def test_models_health_metrics(fake: Running) -> None:
    models = fake.client().models.list()
    assert [m.id for m in models.data] == ["fake"]
    assert httpx.get(fake.url + "/health").json() == {"status": "ok"}
    fake.client().completions.create(model="fake", prompt="abc", max_tokens=4)
    m = fake.metrics()
    assert m["pagedkv:generation_tokens_total"] == 4 and m["pagedkv:prompt_tokens_total"] == 3
    assert m["pagedkv:time_to_first_token_seconds_count"] == 1
    assert m['pagedkv:request_success_total{endpoint="completions",finished_reason="length"}'] == 1
    for name in ["pagedkv:kv_cache_usage_perc", 'pagedkv:kv_cache_blocks{state="cached"}',
                 'pagedkv:kv_cache_blocks{state="free"}', "pagedkv:prefix_cache_hit_rate",
                 "pagedkv:num_preemptions_total", "pagedkv:num_requests_waiting"]:
        assert name in m
    assert m["pagedkv:context_shifts_total"] == 0  # the fake never shifts
    text = httpx.get(fake.url + "/metrics").text
    assert "# HELP pagedkv:context_shifts_total Times a sequence filled the context" in text
    assert "# TYPE pagedkv:context_shifts_total counter" in text


# --- bad input -------------------------------------------------------------------------------

_LONG = "z" * 300  # over the fake's 256-token context
BAD_REQUESTS = [
    ("completions", b'{"model": "fake", "prompt": "abc"', 400, None),
    ("completions", b'["not", "an", "object"]', 400, None),
    ("completions", {"prompt": "abc", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"prompt": "abc", "temperature": 2.5}, 400, "temperature"),
    ("completions", {"prompt": "abc", "temperature": -0.1}, 400, "temperature"),
    ("completions", {"prompt": "abc", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "abc", "max_tokens": 129}, 400, "max_tokens"),
    ("completions", {"prompt": "abc", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "abc", "n": True}, 400, "n"),
    ("completions", {"prompt": "abc", "top_p": 0}, 400, "top_p"),
    ("completions", {"prompt": 5}, 400, "prompt"),
    ("completions", {"max_tokens": 3}, 400, "prompt"),
    ("completions", {"prompt": ["a"] * 65}, 400, "prompt"),  # over the batch limit
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "tools": [{"type": "function"}]}, 400, "tools"),
    ("completions", {"prompt": [1, 5000]}, 400, None),
    ("completions", {"prompt": _LONG}, 400, "prompt"),
    ("completions", {"prompt": "y" * 201}, 400, "prompt"),  # over max_prompt_tokens
    ("completions", {"prompt": "y" * 150, "max_tokens": 120}, 400, "prompt"),  # over context
    ("completions", {"prompt": "abc", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": "abc", "stop": [""]}, 400, "stop"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": _LONG}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}],
                          "max_completion_tokens": -1}, 400, "max_completion_tokens"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_REQUESTS)
def test_bad_input_then_good(fake: Running, path: str, body: Any, status: int,
                             param: str | None) -> None:
    url = f"{fake.url}/v1/{path}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json={"model": "fake", **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"] and set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    good = fake.client().completions.create(model="fake", prompt="ok", max_tokens=2)
    assert good.choices[0].text == "ok"


def test_openai_client_error_types(fake: Running) -> None:
    client = fake.client()
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="fake", prompt="x" * 300)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    r = httpx.get(fake.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(fake.url + "/nowhere").status_code == 404


def test_engine_failure_is_reported_and_server_recovers(serve_fake: Any) -> None:
    engine = FakeEngine()
    server = serve_fake(engine)
    client = server.client()
    engine.fail_next_step = True  # read by the engine thread at its next step
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="fake", prompt="abc", max_tokens=3)
    assert client.completions.create(model="fake", prompt="abc", max_tokens=3).choices[0].text
    assert_idle(server)


# --- auth, limits, disconnects ---------------------------------------------------------------


def test_api_key(serve_fake: Any) -> None:
    server = serve_fake(api_key="sekret")
    with pytest.raises(openai.AuthenticationError):
        server.client("wrong").completions.create(model="fake", prompt="a", max_tokens=1)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    r = server.client("sekret").completions.create(model="fake", prompt="a", max_tokens=1)
    assert r.choices[0].text == "a"


def test_concurrency_limit_429(serve_fake: Any) -> None:
    server = serve_fake(FakeEngine(step_delay=0.02), max_concurrent=2)
    client = server.client()
    streams = [client.completions.create(model="fake", prompt="ab", max_tokens=30, stream=True)
               for _ in range(2)]
    for s in streams:
        next(iter(s))  # both are in flight now
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model="fake", prompt="ab", max_tokens=1)
    assert httpx.get(server.url + "/health").status_code == 200  # only generation is limited
    for s in streams:
        assert "".join(c.choices[0].text for c in s if c.choices)
    r = client.completions.create(model="fake", prompt="ab", max_tokens=1)
    assert r.choices[0].text == "a"
    assert server.metrics()['pagedkv:request_errors_total{status="429"}'] == 1


def test_disconnect_mid_stream_aborts(serve_fake: Any) -> None:
    engine = FakeEngine(step_delay=0.01)
    server = serve_fake(engine)
    stream = server.client().completions.create(model="fake", prompt="ab", max_tokens=200,
                                                stream=True)
    it = iter(stream)
    next(it), next(it)
    assert server.metrics()['pagedkv:kv_cache_blocks{state="used"}'] > 0
    t0 = time.monotonic()
    stream.close()
    assert_idle(server)
    assert time.monotonic() - t0 < 1.0  # long before the 200 tokens' natural end (~2 s)
    assert len(engine.aborted) == 1
    assert server.metrics()["pagedkv:http_requests_in_flight"] == 0


def test_disconnect_non_streamed_aborts(serve_fake: Any) -> None:
    engine = FakeEngine(step_delay=0.01)
    server = serve_fake(engine)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", timeout=0.3,
                   json={"prompt": "ab", "max_tokens": 250})
    assert_idle(server)
    assert len(engine.aborted) == 1


def test_engine_used_from_one_thread(serve_fake: Any) -> None:
    engine = FakeEngine()
    server = serve_fake(engine)
    client = server.client()
    threads = [threading.Thread(target=lambda: client.completions.create(
        model="fake", prompt="abc", max_tokens=5)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    server.metrics()
    assert len(engine.threads) == 1
    assert_idle(server)


# --- graceful shutdown -----------------------------------------------------------------------

_SERVE_SCRIPT = """
import sys
sys.path.insert(0, {tests!r})
from test_server import FakeEngine
from pagedkv.server import serve
serve(FakeEngine(step_delay=0.02), port={port}, log_level="warning")
print("clean exit", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_finishes_in_flight_and_exits_0() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    script = _SERVE_SCRIPT.format(tests=str(ROOT / "tests"), port=port)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert wait_until(lambda: _healthy(url), timeout=60), "server did not come up"
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        stream = iter(client.completions.create(model="fake-model", prompt="ab", max_tokens=60,
                                                stream=True))
        text = next(stream).choices[0].text
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(httpx.ConnectError):  # no longer accepting
            httpx.get(url + "/health")
        reasons = []
        for chunk in stream:
            text += chunk.choices[0].text
            reasons.append(chunk.choices[0].finish_reason)
        assert text == expected_echo("ab", 60) and reasons[-1] == "length"
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "clean exit" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_bench_serve_against_fake(serve_fake: Any) -> None:
    from pagedkv.bench.bench_serve import run_serve_bench

    server = serve_fake(FakeEngine(step_delay=0.005, max_model_len=1024))
    result = run_serve_bench(server.url, num_requests=12, concurrency=4, max_tokens=6)
    assert result["completed"] == 12 and result["failed"] == 0, result
    assert result["total_output_tokens"] == 72 and result["model"] == "fake"
    assert 0 < result["median_ttft_ms"] <= result["p99_ttft_ms"]
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0
    assert result["output_throughput"] > 0
    assert_idle(server)


class DroppingServer:
    """A real HTTP/1.1 server on a socket: the first `drops` connections are read and closed
    with no response (a kept-alive connection the server closed as the client reused it); the
    rest get one streamed completion of two chunks, then the connection closes."""

    SSE = (b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": "b"}], '
           b'"usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\ndata: [DONE]\n\n')

    def __init__(self, drops: int) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.drops, self.seen = drops, 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                size = int(re.search(rb"content-length: (\d+)", head, re.I).group(1))
                while len(body) < size:
                    body += conn.recv(65536)
                self.seen += 1
                if self.seen > self.drops:
                    conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                 b"connection: close\r\n\r\n" + self.SSE)


def test_bench_serve_resends_once_after_a_dropped_connection() -> None:
    """A request whose connection the server closed before any response is sent once more and
    counted in `retried`; a second drop fails it (never a third try)."""
    from pagedkv.bench.bench_serve import run_serve_bench

    once = DroppingServer(drops=1)
    r = run_serve_bench(once.url, num_requests=2, concurrency=1, max_tokens=2, prompts=["hi"], model="m")
    assert (r["completed"], r["failed"], r["retried"], r["total_output_tokens"]) == (2, 0, 1, 4), r
    assert once.seen == 3
    twice = DroppingServer(drops=2)
    r = run_serve_bench(twice.url, num_requests=2, concurrency=1, max_tokens=2, prompts=["hi"], model="m")
    assert (r["completed"], r["failed"], r["retried"]) == (1, 1, 1), r
    assert "without sending a response" in r["first_errors"][0] and twice.seen == 3


def test_bench_serve_reads_cached_prompt_tokens_as_untrusted() -> None:
    """usage.prompt_tokens_details.cached_tokens (what each server took from its cache) counts
    only as a non-negative int, and never beyond the request's prompt tokens."""
    from pagedkv.bench.bench_serve import RequestResult, _cached_tokens, summarize

    assert _cached_tokens({"prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}}) == 32
    for bad in ({}, {"prompt_tokens_details": None}, {"prompt_tokens_details": [32]},
                {"prompt_tokens_details": {"cached_tokens": "32"}}, {"prompt_tokens_details": {"cached_tokens": True}},
                {"prompt_tokens_details": {"cached_tokens": -5}}, {"prompt_tokens_details": {"cached_tokens": 3.5}}):
        assert _cached_tokens(bad) == 0, bad
    ok = [RequestResult(ok=True, prompt_tokens=40, cached_tokens=32, output_tokens=2, latency=1.0, ttft=0.5),
          RequestResult(ok=True, prompt_tokens=10, cached_tokens=99, output_tokens=2, latency=1.0, ttft=0.5)]
    s = summarize(ok, 1.0)
    assert (s["total_input_tokens"], s["total_cached_input_tokens"]) == (50, 42)


def test_bench_serve_counts_the_servers_cached_prompt_tokens(real: Running) -> None:
    """The same prompt sent twice: the second request's prompt comes from pagedkv's prefix cache
    but for its last token (whole blocks, then the first request's partial last block), and the
    bench's summary says how many prompt tokens the server did not compute."""
    from pagedkv.bench.bench_serve import run_serve_bench

    prompt = "Bench cache probe: " + " ".join(f"w{i}" for i in range(40))  # a prompt no other test sends
    result = run_serve_bench(real.url, num_requests=2, concurrency=1, max_tokens=2, prompts=[prompt])
    assert result["completed"] == 2, result
    per_request = result["total_input_tokens"] // 2
    assert result["total_cached_input_tokens"] == per_request - 1 > 0, result  # all but 1


def test_bench_serve_peer_warms_both_servers_alike(serve_fake: Any) -> None:
    """--peer: before each level both servers get the same untimed warm-up (that level's
    concurrency in requests of WARMUP_TOKENS tokens), then the measured requests."""
    import argparse

    from pagedkv.bench import bench_serve

    ours, peer = serve_fake(FakeEngine(max_model_len=1024)), serve_fake(FakeEngine(max_model_len=1024))
    ap = argparse.ArgumentParser()
    bench_serve.add_args(ap)
    args = ap.parse_args(["--base-url", ours.url, "--peer", peer.url, "--peer-concurrency", "1,2",
                          "--no-in-process", "--prompt", "abc"])
    args.quick = True  # (the bench command's common flag): 16 tokens, one request per client
    result = bench_serve.run_peer(args)
    assert set(result["clients"]) == {"1", "2"} and str(bench_serve.WARMUP_TOKENS) in result["warmup"]
    for server in (ours, peer):
        m = server.metrics()
        assert m["pagedkv:time_to_first_token_seconds_count"] == 2 * (1 + 2)  # warm-up + measured
        assert m["pagedkv:generation_tokens_total"] == (1 + 2) * (bench_serve.WARMUP_TOKENS + 16)
    for row in result["clients"].values():
        assert row["pagedkv"]["completed"] == row["peer"]["completed"] > 0 and row["ratio"] is not None


def test_serve_freezes_the_objects_alive_at_start_up() -> None:
    """`serve` first takes the objects alive at start-up (model, tokenizer, app) out of the
    cyclic collector's view, so a full collection while serving never walks them (a pause of
    every stream: 120 ms for a 1.5B model's); objects made afterwards are still collected."""
    import gc

    from pagedkv.server.app import freeze_startup_objects

    startup = [[i] for i in range(20_000)]  # lives as long as the process, as a model does
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() >= len(startup)
        assert not any(o is startup for o in gc.get_objects())  # outside every generation
        later = [[0]]
        later.append(later)  # a cycle made while serving
        assert any(o is later for o in gc.get_objects())
    finally:
        gc.unfreeze()


def test_bench_serve_peer_repeats_alternate_and_take_the_median(serve_fake: Any) -> None:
    """--repeats N: each level runs N rounds on both servers (ABBA order), reports every round's
    ratio and their median; a count below 1 is refused by the parser."""
    import argparse
    import statistics

    from pagedkv.bench import bench_serve

    ours, peer = serve_fake(FakeEngine(max_model_len=1024)), serve_fake(FakeEngine(max_model_len=1024))
    ap = argparse.ArgumentParser()
    bench_serve.add_args(ap)
    args = ap.parse_args(["--base-url", ours.url, "--peer", peer.url, "--peer-concurrency", "2",
                          "--no-in-process", "--prompt", "abc", "--repeats", "3", "--peer-max-tokens", "3"])
    args.quick = False
    result = bench_serve.run_peer(args)
    row = result["clients"]["2"]
    assert result["repeats"] == 3 and len(row["ratios"]) == 3
    assert row["ratio"] == round(statistics.median(row["ratios"]), 2)
    for server in (ours, peer):  # warm-up (2 requests) + 3 rounds of max(4, 2 * 2) requests
        assert server.metrics()["pagedkv:time_to_first_token_seconds_count"] == 2 + 3 * 4
    with pytest.raises(SystemExit):
        ap.parse_args(["--repeats", "0"])
    # the in-process reference runs once a round, right after both servers' runs of that round
    seen = []

    def reference() -> dict[str, Any]:
        seen.append(tuple(s.metrics()["pagedkv:time_to_first_token_seconds_count"] for s in (ours, peer)))
        return {"output_throughput": 10.0 + len(seen), "median_tpot_ms": 1.0}

    kw = dict(num_requests=2, concurrency=2, max_tokens=3, prompts=["abc"])
    row = bench_serve._rounds(ours.url, peer.url, kw, 3, reference)
    base = 2 + 3 * 4
    assert seen == [(base + 2, base + 2), (base + 4, base + 4), (base + 6, base + 6)]
    assert row["in_process"]["output_throughput"] == 12.0  # the median run
    assert len(row["tpot_http_over_in_process_rounds"]) == 3
    assert row["tpot_http_over_in_process"] == round(statistics.median(row["tpot_http_over_in_process_rounds"]), 2)


# --- the real engine -------------------------------------------------------------------------


def test_bench_serve_in_process_reference(smollm2: Any) -> None:
    """--peer's in-process reference runs the same requests, `concurrency` at a time."""
    from pagedkv.bench.bench_serve import run_in_process
    from pagedkv.engine import LLMEngine

    engine = LLMEngine(smollm2, num_blocks=64, max_num_seqs=8)
    prompts = ["The quick brown fox", [{"role": "user", "content": "Name a colour."}]]
    result = run_in_process(engine, prompts, concurrency=2, num_requests=5, max_tokens=4)
    assert result["completed"] == 5 and result["total_output_tokens"] == 20, result
    assert result["median_tpot_ms"] > 0 and result["median_step_ms"] > 0
    assert not engine.has_unfinished_requests()
    assert engine.cache.num_free_blocks == 64

def test_bench_serve_in_process_reference_takes_the_servers_modes() -> None:
    """--activations int8 and --kv-cache-dtype float16 reach both the started server's command
    line and the in-process reference, so tpot_http_over_in_process compares like with like."""
    import argparse

    from pagedkv.bench import bench_serve

    ap = argparse.ArgumentParser()
    bench_serve.add_args(ap)
    args = ap.parse_args(["--activations", "int8", "--kv-cache-dtype", "float16", "--peer", "http://127.0.0.1:1"])
    engine = bench_serve.in_process_engine(args, ["hi"], [1], 4)
    assert engine.loaded.activations == "int8"
    assert str(engine.storage.model_layers[0].k.dtype) == "torch.float16"
    with pytest.raises(SystemExit):  # argparse: not a mode
        ap.parse_args(["--activations", "int4"])


def test_bench_serve_in_process_reference_holds_a_hybrid_caches_requests(tmp_path: Path) -> None:
    """The in-process reference has KV blocks for the largest level's requests at once in every
    KV group of a hybrid (sliding-window) cache: all of them decode together, one step a token
    (sized for one group, Gemma 3's reference held a sixth of them and its TPOT doubled)."""
    import argparse

    from tiny_gguf import SPECS, write_tiny_gguf

    from pagedkv.bench import bench_serve

    path = write_tiny_gguf(SPECS["gemma3"], tmp_path / "gemma3.gguf", fast=True)
    ap = argparse.ArgumentParser()
    bench_serve.add_args(ap)
    args = ap.parse_args(["--model", str(path), "--peer", "http://127.0.0.1:1"])
    engine = bench_serve.in_process_engine(args, ["the cat sat on"], [6], 8)
    assert engine.cache.num_groups > 1
    steps = 0
    step = engine.step

    def counted() -> Any:
        nonlocal steps
        steps += 1
        return step()

    engine.step = counted
    result = bench_serve.run_in_process(engine, ["the cat sat on"], concurrency=6, num_requests=6, max_tokens=8)
    assert result["total_output_tokens"] == 48
    assert steps <= 1 + 8 + 2, steps  # the warm-up, then one prefill and 7 decode steps for all six


LOAD_PROMPTS: list[Any] = [
    "The quick brown fox",
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "What colour is grass?"}],
]


@pytest.fixture(scope="module")
def real(smollm2: Any) -> Iterator[Running]:
    from pagedkv.engine import LLMEngine

    engine = LLMEngine(smollm2, num_blocks=1024, max_num_seqs=64, max_model_len=1024)
    app = build_app(engine, served_model_name="smollm2")
    with ServerThread(app) as thread:
        yield Running(thread.url, engine, app)


@pytest.fixture(scope="module")
def offline(smollm2: Any) -> Any:
    """Greedy reference texts from the offline API, keyed by (prompt, max_tokens)."""
    from pagedkv.engine import LLM

    llm = LLM(smollm2, num_blocks=1024, max_model_len=1024)

    def generate(prompts: list[Any], max_tokens: int) -> list[Any]:
        return llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))

    return generate


@pytest.mark.slow
def test_real_streamed_equals_non_streamed_equals_offline(real: Running, offline: Any) -> None:
    client = real.client()
    chat, raw = LOAD_PROMPTS[5], LOAD_PROMPTS[0]
    ref_chat, ref_raw = offline([chat, raw], 10)
    r = client.chat.completions.create(model="smollm2", messages=chat, max_tokens=10,
                                       temperature=0)
    assert r.choices[0].message.content == ref_chat.text
    assert r.usage.prompt_tokens == len(ref_chat.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref_chat.token_ids)
    text, reason, _ = _stream_chat(client, "smollm2", messages=chat, max_tokens=10,
                                   temperature=0)
    assert (text, reason) == (ref_chat.text, ref_chat.finish_reason)

    r = client.completions.create(model="smollm2", prompt=raw, max_tokens=10, temperature=0,
                                  logprobs=2)
    assert r.choices[0].text == ref_raw.text
    assert len(r.choices[0].logprobs.tokens) == len(ref_raw.token_ids)
    word = ref_raw.text.split()[1]  # a stop string inside the answer: cut identically
    text, reason, _ = _stream_completion(client, "smollm2", prompt=raw, max_tokens=10,
                                         temperature=0, stop=[word])
    full = client.completions.create(model="smollm2", prompt=raw, max_tokens=10,
                                     temperature=0, stop=[word])
    assert text == full.choices[0].text and reason == "stop" and word not in text
    assert_idle(real)


async def _load_client(client: openai.AsyncOpenAI, prompt: Any, max_tokens: int,
                       disconnect: bool) -> str | None:
    """Streams one request; returns its text, or None if it hung up after the first chunk."""
    kw: dict[str, Any] = dict(model="smollm2", max_tokens=max_tokens, temperature=0,
                              stream=True)
    if isinstance(prompt, str):
        stream = await client.completions.create(prompt=prompt, **kw)
    else:
        stream = await client.chat.completions.create(messages=prompt, **kw)
    text = ""
    async for chunk in stream:
        for c in chunk.choices:
            text += (c.text if isinstance(prompt, str) else c.delta.content) or ""
        if disconnect and text:
            await stream.close()
            return None
    return text


@pytest.mark.slow
def test_real_load_200_streams_quarter_disconnect(real: Running, offline: Any) -> None:
    import asyncio

    n, max_tokens = 200, 8
    ref = [o.text for o in offline(LOAD_PROMPTS, max_tokens)]
    aborted_before = _aborts(real.metrics())

    async def run() -> list[str | None]:
        async with openai.AsyncOpenAI(base_url=real.url + "/v1", api_key="x", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(
                _load_client(client, LOAD_PROMPTS[i % len(LOAD_PROMPTS)], max_tokens,
                             disconnect=i % 4 == 3)
                for i in range(n)))

    t0 = time.monotonic()
    texts = asyncio.run(run())
    elapsed = time.monotonic() - t0
    for i, text in enumerate(texts):
        if i % 4 == 3:
            assert text is None
        else:
            assert text == ref[i % len(LOAD_PROMPTS)], (i, text)
    assert_idle(real)
    m = real.metrics()
    assert m["pagedkv:http_requests_in_flight"] == 0
    assert _aborts(m) > aborted_before  # most hang-ups land before their request's natural end
    print(f"200 streams in {elapsed:.1f} s")
    assert elapsed < 180, elapsed  # a hang guard; ~30-60 s on 2 shared cores


def _aborts(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if 'finished_reason="abort"' in k)


class _HookedEngine(FakeEngine):
    """A FakeEngine whose steps run a "forward pass": LLMEngine's before_forward hook first."""

    def __init__(self) -> None:
        super().__init__()
        self.before_forward: Any = None
        self.aengine: Any = None
        self.held_at_forward: list[int] = []  # outputs not yet handed over, at each forward

    def step(self) -> list[RequestOutput]:
        if self.requests and self.before_forward is not None:
            self.held_at_forward.append(len(self.aengine._held))
            self.before_forward()
            assert not self.aengine._held  # handed over before the pass
        return super().step()


def test_step_outputs_reach_the_loop_when_the_next_forward_starts() -> None:
    """Each step's deltas wait for the next step's forward pass (the event loop's work then
    runs beside it); the last step's go at once, as no forward follows."""
    import asyncio

    from pagedkv.server.async_engine import AsyncEngine

    async def main() -> tuple[_HookedEngine, list[int], bool]:
        engine = _HookedEngine()
        aengine = engine.aengine = AsyncEngine(engine)
        aengine.start()
        params = lambda n: SamplingParams(max_tokens=5, temperature=0)  # noqa: E731
        stream = await aengine.add("r1", "hello", params)
        ids: list[int] = []
        while not stream.finished:
            update = await asyncio.wait_for(stream.get(), 5)
            ids.extend(t for c in update.choices for t in c.token_ids)
        await asyncio.to_thread(aengine.stop)
        return engine, ids, bool(aengine._held)

    engine, ids, left = asyncio.run(main())
    assert len(ids) == 5 and not left
    assert engine.before_forward is None  # unhooked when the server stopped
    assert engine.held_at_forward == [0, 1, 1, 1, 1]  # the first pass had nothing to hand over


def test_bench_serve_peer_stops_its_server_when_set_up_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The `pagedkv serve` process run_peer starts is stopped whatever fails after it, the
    in-process engine's set-up included (a file with no chat template once left it running)."""
    import argparse

    from pagedkv.bench import bench_serve

    started: list[subprocess.Popen] = []

    def start(*_: Any, **__: Any) -> tuple[subprocess.Popen, str]:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return started[-1], "http://127.0.0.1:9"

    def no_engine(*_: Any, **__: Any) -> None:
        raise RuntimeError("no chat template")

    monkeypatch.setattr(bench_serve, "start_pagedkv", start)
    monkeypatch.setattr(bench_serve, "in_process_engine", no_engine)
    ap = argparse.ArgumentParser()
    bench_serve.add_args(ap)
    args = ap.parse_args(["--peer", "http://127.0.0.1:9", "--peer-concurrency", "1"])
    args.quick = True
    with pytest.raises(RuntimeError, match="no chat template"):
        bench_serve.run_peer(args)
    assert len(started) == 1 and started[0].poll() is not None
