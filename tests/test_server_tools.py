"""Tool calling over the real HTTP server and `openai` client (test_server's echoing FakeEngine
writes what the last user message says, so the model's "calls" are chosen by the test): calls
parsed whole and streamed as OpenAI deltas, tool_choice none / parallel_tool_calls, tool
messages in the input, bad tools a 400; the parser on every split of its input."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_server import FakeEngine, Running, serve_fake  # noqa: F401  (serve_fake: a fixture)

from pagedkv.server.tools import ToolChat, Tools, ToolStream, prompt_messages, tools_of

F = {"type": "function", "function": {"name": "f", "description": "d", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}}}}
G = {"type": "function", "function": {"name": "g"}}
CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'


class PromptEngine(FakeEngine):
    """FakeEngine that keeps every prompt's text."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.prompts: list[str] = []

    def add_request(self, request_id: str, prompt: Any, params: Any, **kw: Any) -> None:
        super().add_request(request_id, prompt, params, **kw)
        self.prompts.append(self.tokenizer.decode(self.tokenize(prompt)))


@pytest.fixture
def srv(serve_fake: Any) -> Running:  # noqa: F811
    return serve_fake(PromptEngine(max_model_len=2048))


def _chat(server: Running, say: str, **kw: Any) -> Any:
    """The fake model writes `say`, then stops (at the '#' it writes next)."""
    return server.client().chat.completions.create(
        model="fake", messages=[{"role": "user", "content": say + "#"}], max_tokens=300,
        stop=["#"], **kw)


def test_auto_call_parsed_from_text(srv: Running) -> None:
    r = _chat(srv, "Sure. " + CALL, tools=[F, G])
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure. "
    (call,) = c.message.tool_calls
    assert call.function.name == "f" and json.loads(call.function.arguments) == {"x": 1}
    assert "<tools>" in srv.engine.prompts[-1] and '"name": "f"' in srv.engine.prompts[-1]


def test_auto_call_streamed_as_deltas(srv: Running) -> None:
    content, calls, reason = "", {}, None
    for chunk in _chat(srv, "Ok " + CALL + CALL.replace('"x": 1', '"x": 2'), tools=[F],
                       stream=True):
        d = chunk.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": tc.id, "name": "", "args": ""})
            slot["name"] += tc.function.name or ""
            slot["args"] += tc.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    assert content == "Ok " and reason == "tool_calls"  # no markup leaks into the content
    assert [json.loads(calls[i]["args"]) for i in (0, 1)] == [{"x": 1}, {"x": 2}]
    assert all(s["id"].startswith("call_") and s["name"] == "f" for s in calls.values())


def test_choice_none_parallel_false_and_unknown_names(srv: Running) -> None:
    r = _chat(srv, CALL, tools=[F], tool_choice="none")
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
    assert "<tools>" not in srv.engine.prompts[-1]  # "none": the tools stay out of the prompt
    r = _chat(srv, CALL + CALL, tools=[F], parallel_tool_calls=False)
    assert len(r.choices[0].message.tool_calls) == 1
    unknown = CALL.replace('"f"', '"nope"')
    r = _chat(srv, unknown, tools=[F])
    assert r.choices[0].message.content == unknown and r.choices[0].finish_reason == "stop"


def test_tool_messages_in_the_input(srv: Running) -> None:
    msgs = [{"role": "user", "content": "x?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "f", "arguments": '{"x": 5}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "25"},
            {"role": "user", "content": "thanks#"}]
    r = srv.client().chat.completions.create(model="fake", messages=msgs, tools=[F],
                                             max_tokens=10, stop=["#"])
    assert r.choices[0].message.content == "thanks"
    prompt = srv.engine.prompts[-1]
    assert '<tool_call>\n{"name": "f", "arguments": {"x": 5}}\n</tool_call>' in prompt
    assert "<tool_response>\n25\n</tool_response>" in prompt


BAD = [
    ({"tools": {"f": 1}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"tools": [F, F]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [F] * 129}, "tools"),
    ({"tools": [F], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tools": [F], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [F], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": ["y" * 1000] * 70}}}}}],
      "tool_choice": "required"}, "tools"),  # the forced call's grammar is over the cap
    ({"tools": [F], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]},
     "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages"),
]


@pytest.mark.parametrize("body, field", BAD)
def test_bad_tools_are_a_400_naming_the_field(srv: Running, body: dict, field: str) -> None:
    full = {"model": "fake", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
            **body}
    r = httpx.post(srv.url + "/v1/chat/completions", json=full, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert srv.engine.prompts == []  # nothing reached the engine


def test_openai_client_tools_error_is_bad_request(srv: Running) -> None:
    with pytest.raises(openai.BadRequestError):
        _chat(srv, "hi", tools=[F], tool_choice={"type": "function", "function": {"name": "z"}})


# --- the parser and the prompt, without a server ------------------------------------------------


def _tools(parser: str = "hermes", parallel: bool = True) -> Tools:
    t = tools_of({"tools": [F, G], "parallel_tool_calls": parallel}, parser)
    assert t is not None
    return t


@settings(max_examples=60, deadline=None)
@given(cuts=st.lists(st.integers(0, 200), max_size=8),
       text=st.sampled_from(["plain text, no call", "a <tool_ca", "pre " + CALL + " post",
                             CALL + "\n" + CALL, "<tool_call>not json</tool_call>x",
                             "<tool_call>{\"name\": \"f\", \"arguments\": {}}", "<<tool_call>" +
                             '{"name": "g", "arguments": {"y": [1, 2]}}</tool_call>']))
def test_stream_parse_equals_whole_parse(cuts: list[int], text: str) -> None:
    """Shadow model: however the text is split into deltas, the content and calls streamed
    are those of parsing it whole."""
    tools = _tools()
    whole_content, whole_calls = ToolStream(tools).feed(text, final=True)
    ts, content, calls = ToolStream(tools), "", []
    bounds = sorted({min(c, len(text)) for c in cuts}) + [len(text)]
    start = 0
    for end in bounds:
        out, new = ts.feed(text[start:end], final=end == len(text) and end == bounds[-1])
        content, calls, start = content + out, calls + new, end
    assert content == whole_content
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]


def test_llama3_json_parser() -> None:
    t = _tools("llama3_json")
    content, calls = t.parse('{"name": "f", "parameters": {"x": 3}}; {"name": "g", "parameters": {}}')
    assert content is None and [c["function"]["name"] for c in calls] == ["f", "g"]
    assert t.parse("hello {}") == ("hello {}", [])
    assert t.parse('{"not": "a call"}') == ('{"not": "a call"}', [])
    one = _tools("llama3_json", parallel=False)
    assert len(one.parse('{"name": "f", "parameters": {}}; {"name": "f", "parameters": {}}')[1]) == 1
    assert t.constraint() is None  # auto: no grammar
    forced = tools_of({"tools": [F], "tool_choice": "required"}, "llama3_json")
    assert forced is not None and '"parameters"' in forced.constraint().grammar


def test_template_that_takes_tools_gets_them(smollm2_tokenizer) -> None:  # noqa: ANN001
    tok = copy.copy(smollm2_tokenizer)
    tok.chat_template = (  # a minimal template that reads tools and tool_calls
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments.x }}{% endfor %}\n{% endfor %}[assistant]")
    from pagedkv.server.protocol import ChatMessage

    msgs = [ChatMessage(role="user", content="q"),
            ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 7}'}}]}),
            ChatMessage.model_validate({"role": "tool", "content": "49", "tool_call_id": "c"})]
    chat = prompt_messages(msgs, _tools(), True, "hermes")
    assert isinstance(chat, ToolChat)
    text = tok.apply_chat_template(chat.messages, tools=chat.tools, tokenize=False)
    assert text.startswith("TOOLS:f;g;") and "CALL f 7" in text and "[tool]49" in text
