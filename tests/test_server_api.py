"""OpenAI API surface beyond generation basics: prompt lists, refused unsupported fields, the
sampling extras reaching SamplingParams, /tokenize, /detokenize, /version.

Driven over real HTTP with the `openai` client against test_server's deterministic FakeEngine.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import httpx
import openai
import pytest
from test_server import FakeEngine, Running, serve_fake  # noqa: F401  (serve_fake: a fixture)

from pagedkv.engine import SamplingParams
from pagedkv.errors import InvalidParamsError


class RecordingEngine(FakeEngine):
    """FakeEngine that keeps every request's SamplingParams."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.params: list[SamplingParams] = []

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams) -> None:
        super().add_request(request_id, prompt, params)
        self.params.append(params)


@pytest.fixture
def rec(serve_fake: Any) -> Running:  # noqa: F811
    return serve_fake(RecordingEngine())


def _post(server: Running, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=30)


# --- prompt lists ------------------------------------------------------------------------------


def test_prompt_list_one_choice_per_prompt(rec: Running) -> None:
    client = rec.client()
    r = client.completions.create(model="fake", prompt=["abc", "xy"], max_tokens=4, n=2)
    got = sorted((c.index, c.text) for c in r.choices)
    assert got == [(0, "abca"), (1, "abca"), (2, "xyxy"), (3, "xyxy")]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (5, 16)
    r = client.completions.create(model="fake", prompt=[[100, 101], [120]], max_tokens=3)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == ["aba", "uuu"]


def test_prompt_list_streamed_equals_non_streamed(rec: Running) -> None:
    client = rec.client()
    prompts = ["hello", "ab", "xyz"]
    full = client.completions.create(model="fake", prompt=prompts, max_tokens=6)
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    usage = None
    for chunk in client.completions.create(model="fake", prompt=prompts, max_tokens=6,
                                           stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in full.choices}
    assert all(r == "length" for r in reasons.values()) and len(reasons) == 3
    assert usage is not None and usage.completion_tokens == 18


def test_prompt_list_limits_and_bad_member_change_nothing(rec: Running) -> None:
    r = _post(rec, "/v1/completions", {"prompt": ["a"] * 65, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = _post(rec, "/v1/completions", {"prompt": ["ok", "z" * 300], "max_tokens": 1})
    assert r.status_code == 400  # the second is over the context: no half answer
    m = rec.metrics()
    assert m["pagedkv:num_requests_running"] == 0 and m["pagedkv:num_requests_waiting"] == 0
    assert rec.engine.blocks_used == 0


class StepCountingEngine(FakeEngine):
    """FakeEngine that notes how many steps ran before each add_request; refuses prompt [7]
    on the engine thread (after the server's own checks passed)."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.steps = 0
        self.added_at: dict[str, int] = {}

    def step(self) -> list[Any]:
        self.steps += 1
        return super().step()

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams, *,
                    cache_salt: str | None = None, tenant: str | None = None) -> None:
        if list(prompt) == [7]:
            raise InvalidParamsError("refused by the engine")
        super().add_request(request_id, prompt, params, cache_salt=cache_salt)
        self.added_at[request_id] = self.steps


def test_prompt_list_reaches_the_engine_in_one_step(serve_fake: Any) -> None:  # noqa: F811
    """All prompts of a list are added between the same two steps (so prompts sharing a
    prefix can share its prefill), even while other requests keep the engine stepping."""
    server = serve_fake(StepCountingEngine(step_delay=0.02))
    client = server.client()
    r = client.completions.create(model="fake", prompt=[[100 + i] * 8 for i in range(6)],
                                  max_tokens=2)
    assert len(r.choices) == 6
    assert len(set(server.engine.added_at.values())) == 1
    r = _post(server, "/v1/completions", {"prompt": [[100], [101], [7]], "max_tokens": 2})
    assert r.status_code == 400  # the engine refused the third: the first two are taken back
    aborted = server.engine.aborted
    assert len(aborted) == 2 and {a[-2:] for a in aborted} == {"-0", "-1"}
    m = server.metrics()
    assert m["pagedkv:num_requests_running"] == 0 and m["pagedkv:num_requests_waiting"] == 0
    assert server.engine.blocks_used == 0


# --- unsupported fields ------------------------------------------------------------------------

UNSUPPORTED = [
    ("/v1/completions", "best_of", 3),
    ("/v1/completions", "suffix", "!"),
    ("/v1/completions", "use_beam_search", True),
    ("/v1/completions", "skip_special_tokens", False),
    ("/v1/chat/completions", "functions", [{"name": "f"}]),  # the legacy function calling
    ("/v1/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("/v1/completions", "n_probs", 3),  # llama-server's
    ("/v1/chat/completions", "guided_whitespace_pattern", " "),
]


@pytest.mark.parametrize(("path", "field", "value"), UNSUPPORTED)
def test_unsupported_field_is_a_400_naming_it(rec: Running, path: str, field: str,
                                              value: Any) -> None:
    body: dict[str, Any] = {"max_tokens": 2, field: value}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = _post(rec, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"]
    assert rec.engine.params == []  # nothing reached the engine


def test_off_values_of_unsupported_fields_pass(rec: Running) -> None:
    r = rec.client().chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        response_format={"type": "text"}, user="someone", metadata={"k": "v"},
    )
    assert r.choices[0].message.content == "hi"
    r = rec.client().completions.create(model="fake", prompt="ab", max_tokens=2, best_of=1)
    assert r.choices[0].text == "ab"


SPELLINGS = [  # every way to ask for structured output -> the engine's one constraint
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "n", "schema": {"type": "object"}, "strict": True}}},
     {"json": {"type": "object"}}),
    ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
    ({"guided_json": '{"type": "array"}'}, {"json": {"type": "array"}}),
    ({"guided_regex": "b+", "guided_decoding_backend": "guidance"}, {"regex": "b+"}),
    ({"guided_choice": ["x", "y"]}, {"choice": ["x", "y"]}),
    ({"guided_grammar": 'root ::= "z"'}, {"grammar": 'root ::= "z"'}),
    ({"json_schema": {"type": "string"}}, {"json": {"type": "string"}}),  # llama-server
    ({"grammar": 'root ::= "w"'}, {"grammar": 'root ::= "w"'}),
    ({"grammar": "", "response_format": {"type": "text"}}, None),  # both off
]


@pytest.mark.parametrize(("body", "want"), SPELLINGS)
def test_structured_output_spellings_reach_the_engine(rec: Running, body: dict,
                                                      want: dict | None) -> None:
    from pagedkv.engine import StructuredOutputsParams

    for path, extra in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/v1/completions", {"prompt": "hi"})):
        r = _post(rec, path, {"max_tokens": 2, **extra, **body})
        assert r.status_code == 200, r.text
        got = rec.engine.params[-1].structured_outputs
        assert got == (None if want is None else StructuredOutputsParams(**want))


HI = [{"role": "user", "content": "hi"}]
INCONSISTENT = [  # (body, the field the 400 names): never silently ignored
    ({"messages": HI, "top_logprobs": 2}, "top_logprobs"),
    ({"messages": HI, "top_logprobs": 2, "logprobs": False}, "top_logprobs"),
    ({"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": HI + [{"role": "assistant", "content": "x", "function_call": {"name": "f"}}]},
     "messages"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}, "stream": False},
     "stream_options"),
]


@pytest.mark.parametrize(("body", "field"), INCONSISTENT)
def test_fields_that_would_be_ignored_are_a_400(rec: Running, body: dict, field: str) -> None:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = _post(rec, path, {"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field.split("[")[0] in err["message"]
    assert rec.engine.params == []
    ok = {"max_tokens": 2, **body, "stream": True}  # with their partner field
    if "messages" in body:
        ok["logprobs"] = True
    if field in ("top_logprobs", "stream_options"):
        assert _post(rec, path, ok).status_code == 200


# --- sampling extras -----------------------------------------------------------------------------


def test_sampling_extras_reach_sampling_params(rec: Running) -> None:
    rec.client().chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
        presence_penalty=0.5, frequency_penalty=-0.25, logit_bias={"104": 5, "7": -100},
        extra_body={"repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 2},
    )
    p = rec.engine.params[-1]
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.25, 1.3)
    assert (p.min_p, p.min_tokens) == (0.05, 2)
    assert p.logit_bias == {104: 5.0, 7: -100.0}
    rec.client().completions.create(model="fake", prompt="ab", max_tokens=2)
    p = rec.engine.params[-1]  # absent fields keep SamplingParams' defaults
    assert (p.presence_penalty, p.repetition_penalty, p.min_p, p.min_tokens, p.logit_bias) == (
        0.0, 1.0, 0.0, 0, {})


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", 2.5), ("frequency_penalty", -3), ("repetition_penalty", 0),
    ("min_p", 1.5), ("min_tokens", 99), ("logit_bias", {"5": 1000}), ("logit_bias", {"x": 1}),
    ("presence_penalty", "high"),
])
def test_sampling_extras_out_of_range(rec: Running, field: str, value: Any) -> None:
    r = _post(rec, "/v1/completions", {"prompt": "ab", "max_tokens": 4, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert rec.engine.params == []


# --- utility endpoints ---------------------------------------------------------------------------


def test_tokenize_detokenize_version(rec: Running) -> None:
    r = _post(rec, "/tokenize", {"prompt": "abc"}).json()
    assert r == {"count": 3, "max_model_len": 256, "tokens": [100, 101, 102]}
    chat = [{"role": "user", "content": "hello"}]
    count = _post(rec, "/tokenize", {"messages": chat, "model": "fake"}).json()["count"]
    done = rec.client().chat.completions.create(model="fake", messages=chat, max_tokens=1)
    assert count == done.usage.prompt_tokens  # the same count a generation request uses
    assert _post(rec, "/detokenize", {"tokens": [100, 101, 102]}).json() == {"prompt": "abc"}
    assert httpx.get(rec.url + "/version").json()["version"].startswith("0.")


@pytest.mark.parametrize(("path", "body", "status"), [
    ("/tokenize", {}, 400),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400),
    ("/tokenize", {"prompt": 5}, 400),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404),
    ("/detokenize", {"tokens": [1, 99999]}, 400),
    ("/detokenize", {"tokens": [-1]}, 400),
    ("/detokenize", {"tokens": "abc"}, 400),
    ("/detokenize", {"tokens": [0] * (1 << 17 + 1)}, 400),
])
def test_utility_bad_input(rec: Running, path: str, body: dict[str, Any], status: int) -> None:
    r = _post(rec, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    assert _post(rec, "/tokenize", {"prompt": "ok"}).json()["count"] == 2


# --- metrics -------------------------------------------------------------------------------------


def test_metrics_prometheus_format_vllm_names(rec: Running) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    rec.client().completions.create(model="fake", prompt="abc", max_tokens=3)
    r = httpx.get(rec.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("pagedkv:num_requests_running", "pagedkv:num_requests_waiting",
                 "pagedkv:kv_cache_usage_perc", "pagedkv:prefix_cache_queries",
                 "pagedkv:prefix_cache_hits", "pagedkv:prefix_cache_partial_hits",
                 "pagedkv:num_preemptions",
                 "pagedkv:prompt_tokens", "pagedkv:generation_tokens",
                 "pagedkv:request_success", "pagedkv:time_to_first_token_seconds",
                 "pagedkv:e2e_request_latency_seconds", "pagedkv:kv_cache_evictions",
                 "pagedkv:kv_cache_cow_copies", "pagedkv:kv_cache_fork_shared_blocks"):
        assert name in families, name
    for fam in families.values():
        if fam.type == "gauge":
            assert not fam.name.endswith("_total"), fam.name
        for sample in fam.samples:
            assert sample.labels.get("model_name") == "fake", sample
    gen = families["pagedkv:generation_tokens"]
    assert gen.type == "counter" and gen.samples[0].name == "pagedkv:generation_tokens_total"
    assert gen.samples[0].value == 3


# --- the periodic stats line ---------------------------------------------------------------------


def test_stats_line_only_while_busy() -> None:
    from pagedkv.server.stats_log import StatsLine

    base = FakeEngine().stats()
    line = StatsLine()
    assert line.update(base, 0.0) is None  # first sample: no interval yet
    assert line.update(base, 10.0) is None  # idle: quiet
    busy = dataclasses.replace(base, num_running=3, num_waiting=1, kv_usage=0.25,
                               prompt_tokens_total=200, generation_tokens_total=50,
                               prefix_cache_queries=100, prefix_cache_hits=40)
    text = line.update(busy, 20.0)
    assert text == ("running: 3 reqs, waiting: 1 reqs, KV cache usage: 25.0%, prefix cache hit "
                    "rate: 40.0%, prompt: 20.0 tok/s, generation: 5.0 tok/s")


def test_server_logs_stats_while_busy(serve_fake: Any, caplog: Any) -> None:  # noqa: F811
    caplog.set_level(logging.INFO, logger="pagedkv.server")
    server = serve_fake(FakeEngine(step_delay=0.02), log_stats_interval=0.1)
    server.client().completions.create(model="fake", prompt="abc", max_tokens=30)
    lines = [r.getMessage() for r in caplog.records if "tok/s" in r.getMessage()]
    assert lines and "running: 1 reqs" in "\n".join(lines)


# --- the real engine: the extras change what is generated, as the offline API does --------------


@pytest.fixture(scope="module")
def real_pair(smollm2: Any) -> Any:
    """A real server and an offline LLM over the same weights."""
    from pagedkv import LLM
    from pagedkv.engine import LLMEngine
    from pagedkv.server import ServerThread, build_app

    engine = LLMEngine(smollm2, num_blocks=256, max_model_len=1024)
    with ServerThread(build_app(engine, served_model_name="smollm2")) as thread:
        client = openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0,
                               timeout=120)
        yield client, LLM(smollm2, num_blocks=256, max_model_len=1024)


@pytest.mark.slow
def test_real_sampling_extras_match_offline(real_pair: Any) -> None:
    client, llm = real_pair
    chat = [{"role": "user", "content": "List the days of the week."}]
    plain = client.chat.completions.create(model="smollm2", messages=chat, max_tokens=24,
                                           temperature=0).choices[0].message.content
    cases = [
        dict(presence_penalty=2.0, frequency_penalty=2.0),
        dict(extra_body={"repetition_penalty": 2.0}),
        dict(logit_bias={"28": 100}),  # token 28 forced at every step
    ]
    for kw in cases:
        r = client.chat.completions.create(model="smollm2", messages=chat, max_tokens=24,
                                           temperature=0, **kw)
        fields = {**kw.pop("extra_body", {}), **kw}
        if "logit_bias" in fields:
            fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
        want = llm.generate([chat], SamplingParams(temperature=0, max_tokens=24, **fields))[0]
        assert r.choices[0].message.content == want.text, fields
        assert want.text != plain, f"{fields} changed nothing"
    forced = llm.tokenizer.decode([28] * 24)
    assert want.text == forced


@pytest.mark.slow
def test_real_min_tokens_holds_back_eos(real_pair: Any) -> None:
    client, _ = real_pair
    chat = [{"role": "user", "content": "Reply with the single word: yes"}]
    short = client.chat.completions.create(model="smollm2", messages=chat, max_tokens=64,
                                           temperature=0)
    assert short.choices[0].finish_reason == "stop"  # ended by EOS
    n = short.usage.completion_tokens + 4
    longer = client.chat.completions.create(model="smollm2", messages=chat, max_tokens=n + 8,
                                            temperature=0, extra_body={"min_tokens": n})
    assert longer.usage.completion_tokens >= n


@pytest.mark.slow
def test_real_metrics_count_forks_and_copy_on_write(real_pair: Any) -> None:
    from test_server import parse_metrics

    client, _ = real_pair
    url = str(client.base_url).removesuffix("/v1/")
    client.completions.create(model="smollm2", prompt="Once upon a time there was", n=2,
                              max_tokens=3, temperature=0.8, seed=1)
    m = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
    assert m["pagedkv:kv_cache_fork_shared_blocks_total"] >= 1
    assert m["pagedkv:kv_cache_cow_copies_total"] >= 1  # the shared partial block, written
    assert "pagedkv:kv_cache_evictions_total" in m


@pytest.mark.slow
def test_real_prompt_list_sharing_a_prefix_computes_it_once(real_pair: Any) -> None:
    """A prompt list reaches the scheduler in one step: the prompts sharing a prefix with the
    first are held until it is cached (in-flight dedup), seen on /metrics; the answers are
    those of the offline engine, which has no dedup in play (one prompt at a time)."""
    from test_server import parse_metrics

    client, llm = real_pair
    url = str(client.base_url).removesuffix("/v1/")
    names = ("pagedkv:prefix_dedup_requests_held_total", "pagedkv:prefix_dedup_tokens_saved_total")
    before = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
    doc = "The river Rhine rises in the Alps and flows north to the sea. " * 12
    prompts = [f"{doc}Question {i}: what is the river called? Answer:" for i in range(4)]
    r = client.completions.create(model="smollm2", prompt=prompts, max_tokens=4, temperature=0)
    after = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
    held, saved = (after[k] - before.get(k, 0) for k in names)
    assert held == 3 and saved >= 3 * 128
    want = [llm.generate(p, SamplingParams(temperature=0, max_tokens=4))[0].text for p in prompts]
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want


def test_chat_default_max_tokens_fits_a_small_cache(serve_fake: Any) -> None:  # noqa: F811
    engine = FakeEngine(num_blocks=20, block_size=4)  # 80 tokens: less than the 256 context
    engine.cache.num_blocks, engine.cache.block_size = 20, 4
    server = serve_fake(engine)
    r = server.client().chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}])  # no max_tokens
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 80


@pytest.mark.parametrize("seed", range(8))
def test_merged_stream_loses_nothing_when_a_wait_times_out(seed: int) -> None:
    """The server reads a prompt list under short timeouts (to poll for disconnects); a delta
    a part had already handed over when the timeout struck must still come out."""
    import asyncio
    import random

    from pagedkv.server.async_engine import RequestStream
    from pagedkv.server.batch import MergedStream
    from pagedkv.server.stream import Choice, Update

    steps, rng = 60, random.Random(seed)

    async def main() -> dict[int, str]:
        parts = [RequestStream(f"r-{i}") for i in range(3)]
        merged = MergedStream("r", parts, n=1)

        async def produce() -> None:
            for k in range(steps):
                for p in parts:
                    last = k == steps - 1
                    p._put(Update((Choice(0, f"{k},", (k,), "length" if last else None),),
                                  last, 1, 0))
                    await asyncio.sleep(rng.choice([0, 0, 1e-4]))

        producer = asyncio.ensure_future(produce())
        got = {0: "", 1: "", 2: ""}
        while not merged.finished:
            try:
                update = await asyncio.wait_for(merged.get(), rng.choice([1e-5, 1e-4, 1e-3]))
            except TimeoutError:
                continue
            for c in update.choices:
                got[c.index] += c.text
        await producer
        return got

    want = "".join(f"{k}," for k in range(steps))
    assert asyncio.run(main()) == {0: want, 1: want, 2: want}
