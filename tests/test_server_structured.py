"""Structured outputs through the real server on the real model, driven by the real `openai`
client: `chat.completions.parse` with a pydantic model on many concurrent prompts, streaming,
n > 1, every field spelling (OpenAI, vLLM, llama-server), and bad constraints refused with a 400
naming the field before any engine work."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

from pagedkv.engine import LLMEngine
from pagedkv.server import ServerThread, build_app

pytestmark = pytest.mark.slow


class Pet(BaseModel):
    name: str = Field(max_length=20)
    species: Literal["cat", "dog", "bird", "fish"]
    age: int = Field(ge=0, le=40)
    vaccinated: bool


SUBJECTS = ["a grumpy old cat", "a puppy that loves balls", "a parrot that talks", "a goldfish",
            "my neighbour's dog", "a stray kitten", "a canary", "a retired police dog",
            "a very fat cat", "a koi in a pond", "a sheepdog", "a budgie",
            "a cat named after a planet", "a three-legged dog", "a singing bird", "a clownfish",
            "a lazy beagle", "a black cat", "an owl", "a betta fish"]
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(smollm2):  # noqa: ANN001, ANN201
    engine = LLMEngine(smollm2, num_blocks=512, max_num_seqs=32)
    with ServerThread(build_app(engine, served_model_name="smol")) as thread:
        yield thread.url, engine


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "smol", "max_tokens": 16, **body}, timeout=120)


def test_parse_with_pydantic_model_on_many_prompts(server) -> None:  # noqa: ANN001
    url, _ = server
    client = _client(url)

    def ask(subject: str) -> Pet:
        r = client.chat.completions.parse(
            model="smol", response_format=Pet, temperature=0, max_tokens=80,
            messages=[{"role": "user", "content": f"Describe {subject} as JSON."}])
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        return r.choices[0].message.parsed

    with ThreadPoolExecutor(len(SUBJECTS)) as pool:  # concurrent: one batch in the engine
        pets = list(pool.map(ask, SUBJECTS))
    assert all(isinstance(p, Pet) for p in pets)  # parse() validated each against the model


def test_stream_and_n_with_json_schema(server) -> None:  # noqa: ANN001
    url, _ = server
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}},
              "required": ["answer"], "additionalProperties": False}
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    for chunk in _client(url).chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "What is 2 + 2?"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "sum", "schema": schema, "strict": True}},
            n=2, temperature=1.0, seed=3, max_tokens=30, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert sorted(texts) == [0, 1]
    for i, text in texts.items():
        assert reasons[i] == "stop" and type(json.loads(text)["answer"]) is int, text


@pytest.mark.parametrize("body, check", [
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
     lambda t: t in ("red", "green", "blue")),
    ({"guided_regex": r"[A-Z][a-z]{2,8}"}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}", t)),
    ({"guided_choice": ["yes", "no"], "guided_decoding_backend": "auto"},
     lambda t: t in ("yes", "no")),
    ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
     lambda t: all(type(v) is int for v in json.loads(t))),
    ({"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                      "required": ["ok"], "additionalProperties": False}},  # llama-server
     lambda t: type(json.loads(t)["ok"]) is bool),
    ({"grammar": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch("x[0-9]{2}", t)),  # GBNF
    ({"response_format": {"type": "json_object"}}, lambda t: isinstance(json.loads(t), dict)),
])
def test_every_spelling_constrains_completions(server, body, check) -> None:  # noqa: ANN001
    url, _ = server
    r = _post(url, "/v1/completions", {"prompt": "My favourite colour is", "max_tokens": 40,
                                       "temperature": 0, **body})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and check(choice["text"]), choice


def test_truncated_json_says_length(server) -> None:  # noqa: ANN001
    url, _ = server
    schema = {"type": "object", "properties": {"greeting": {"type": "string"}},
              "required": ["greeting"]}  # "{}" cannot end it: 3 tokens never finish it
    r = _post(url, "/v1/chat/completions", {"messages": HI, "max_tokens": 3, "response_format": {
        "type": "json_schema", "json_schema": {"name": "g", "schema": schema}}})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["message"]["content"].startswith("{")


BAD = [  # (body, the field the 400 names, words in the message)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                  "schema": {"type": "nope"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"guided_json": {"type": "object", "dependentSchemas": {}}}, "guided_json",
     "dependentSchemas"),
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex", "matches no output"),
    ({"grammar": "root ::= missing"}, "grammar", "not found"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice", "only one"),
    ({"guided_json": {"enum": ["x" * 1000] * 80}}, "guided_json", "bytes"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "outlines"}, "guided_decoding_backend",
     "llguidance"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nope"}}}}}], "tool_choice": "required"},
     "tool_choice", "Invalid type"),  # a forced call's schema is compiled like any other
]


@pytest.mark.parametrize("body, field, words", BAD)
def test_bad_constraint_is_a_400_before_engine_work(server, body, field, words) -> None:  # noqa: ANN001
    url, engine = server
    before = engine.stats().prompt_tokens_total
    r = _post(url, "/v1/chat/completions", {"messages": HI, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and words in err["message"], err
    assert engine.stats().prompt_tokens_total == before  # nothing was added


def test_one_clients_bad_grammar_never_fails_another(server) -> None:  # noqa: ANN001
    url, _ = server
    good = {"messages": HI, "max_tokens": 8, "temperature": 0}
    bad = {**good, "guided_regex": "("}
    with ThreadPoolExecutor(6) as pool:
        rs = list(pool.map(lambda b: _post(url, "/v1/chat/completions", b), [good, bad] * 3))
    assert [r.status_code for r in rs] == [200, 400] * 3


# --- tool calling on the real model: required / named always parse ----------------------------

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"], "additionalProperties": False}}}


def _check_call(call, name: str | None = None) -> None:  # noqa: ANN001
    args = json.loads(call.function.arguments)
    assert call.id.startswith("call_") and call.type == "function"
    if call.function.name == "get_weather":
        assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    else:
        assert call.function.name == "add" and all(type(args[k]) is int for k in "ab")
    assert name is None or call.function.name == name


def test_tool_choice_required_and_named(server) -> None:  # noqa: ANN001
    url, _ = server
    client = _client(url)
    asks = ["What is the weather in Oslo?", "Add 2 and 40.", "Is it raining in Rome?"]
    for ask in asks:
        r = client.chat.completions.create(
            model="smol", messages=[{"role": "user", "content": ask}], tools=[WEATHER, ADD],
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=60)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1
        _check_call(c.message.tool_calls[0])
    r = client.chat.completions.create(
        model="smol", messages=[{"role": "user", "content": asks[0]}], tools=[WEATHER, ADD],
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0,
        max_tokens=60)
    c = r.choices[0]
    assert c.finish_reason == "stop" and len(c.message.tool_calls) == 1  # OpenAI's for named
    _check_call(c.message.tool_calls[0], "add")


def test_streamed_tool_calls(server) -> None:  # noqa: ANN001
    url, _ = server
    calls: dict[int, dict] = {}
    reason = None
    content = ""
    for chunk in _client(url).chat.completions.create(
            model="smol", messages=[{"role": "user", "content": "Weather in Paris and Rome?"}],
            tools=[WEATHER], tool_choice="required", temperature=0, max_tokens=90,
            stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            slot["id"] = tc.id or slot["id"]
            slot["name"] += (tc.function.name or "") if tc.function else ""
            slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
        reason = chunk.choices[0].finish_reason or reason
    assert reason in ("tool_calls", "length") and calls and not content.strip()
    for slot in calls.values():  # every call that was sent is whole and valid
        assert slot["id"].startswith("call_") and slot["name"] == "get_weather"
        assert set(json.loads(slot["arguments"])) == {"city", "unit"}


# --- tool_choice="auto" on the real model: the model decides ---------------------------------

CITY = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _few_shot(city: str) -> list[dict]:
    """Three earlier turns answered by a call: SmolLM2-135M follows the pattern on its own."""
    msgs: list[dict] = []
    for i, prev in enumerate(["London", "Rome", "Berlin"]):
        call = {"id": f"c{i}", "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": prev})}}
        msgs += [{"role": "user", "content": f"What is the weather in {prev}?"},
                 {"role": "assistant", "content": None, "tool_calls": [call]}]
    return [*msgs, {"role": "user", "content": f"What is the weather in {city}?"}]


def test_tool_choice_auto_the_model_calls_or_answers(server) -> None:  # noqa: ANN001
    url, _ = server
    client = _client(url)
    c = client.chat.completions.create(model="smol", messages=_few_shot("Paris"), tools=[CITY],
                                       tool_choice="auto", temperature=0, max_tokens=60).choices[0]
    assert c.finish_reason == "tool_calls" and not c.message.content
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    args, reason, content = "", None, ""
    for chunk in client.chat.completions.create(model="smol", messages=_few_shot("Lima"), tools=[CITY],
                                                tool_choice="auto", temperature=0, max_tokens=60,
                                                stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        args += "".join(tc.function.arguments or "" for tc in delta.tool_calls or [] if tc.function)
        reason = chunk.choices[0].finish_reason or reason
    assert reason == "tool_calls" and not content.strip() and json.loads(args) == {"city": "Lima"}
    # no pattern to follow: the same model, tools offered, answers in words
    c = client.chat.completions.create(model="smol", messages=HI, tools=[CITY], tool_choice="auto",
                                       temperature=0, max_tokens=20).choices[0]
    assert c.finish_reason in ("stop", "length") and not c.message.tool_calls and c.message.content.strip()
