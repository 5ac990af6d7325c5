"""Tool calling for /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls`, the
assistant `tool_calls` and `tool` messages of the input, and the model's calls parsed out of its
text (whole, or streamed as OpenAI tool-call deltas).

Formats (`serve --tool-call-parser`): `hermes` (Qwen 2.5, Hermes, SmolLM2):
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call;
`llama3_json` (Llama 3.x): the whole answer is `{"name": ..., "parameters": {...}}`, calls
separated by `;`.

The prompt: a chat template that reads `tools` gets them (and the messages' tool_calls, their
arguments as objects, as Hugging Face templates expect). A template that ignores them (SmolLM2's)
gets them as text instead: a system section listing the tools and the call format, assistant
calls written out in that format, tool results as a user turn in `<tool_response>` tags (how
Qwen 2.5's template writes them).

`tool_choice`: "none" leaves the tools out of the prompt and parses nothing; "auto" parses what
the model writes (a call to an unknown function stays text); "required" and a named function
are enforced with a grammar (the call always parses): one call, or one or more when
`parallel_tool_calls` is true and the choice is "required". With "auto" and
`parallel_tool_calls: false`, only the first call is returned.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.structured_params import StructuredOutputsParams
from pagedkv.server.protocol import ApiError

MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
START, END = "<tool_call>", "</tool_call>"
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolChat:
    """A chat prompt whose template takes `tools` (AsyncEngine tokenizes it with them)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]


@dataclass
class Tools:
    """One request's tools and how it wants them used."""

    functions: dict[str, dict[str, Any]]  # name -> the request's "function" object
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None
    parallel: bool
    parser: str  # "hermes" | "llama3_json"

    @property
    def in_prompt(self) -> bool:
        return self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def openai_tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": f} for f in self.functions.values()]

    # --- the grammar of required / named --------------------------------------------------------

    def constraint(self) -> StructuredOutputsParams | None:
        if not self.forced:
            return None
        names = [self.named] if self.choice == "named" else list(self.functions)
        key = "arguments" if self.parser == "hermes" else "parameters"
        bodies = [{"type": "object", "properties": {"name": {"const": n},
                                                    key: _parameters(self.functions[n])},
                   "required": ["name", key], "additionalProperties": False} for n in names]
        schema = {**(bodies[0] if len(bodies) == 1 else {"anyOf": bodies}),
                  "x-guidance": _JSON_LAYOUT}
        many = self.parallel and self.choice == "required"
        if self.parser == "hermes":
            lark = ('start: call' + (' ("\\n" call)*' if many else '') + '\n'
                    'call: "<tool_call>\\n" body "\\n</tool_call>"\n')
        else:
            lark = 'start: body' + (' ("; " body)*' if many else '') + '\n'
        return StructuredOutputsParams(grammar=lark + "body: %json " + json.dumps(schema))

    # --- the prompt ---------------------------------------------------------------------------

    def system_text(self) -> str:
        """The tools as text, for a chat template that does not read `tools`."""
        specs = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.openai_tools())
        if self.parser == "hermes":
            how = ("To call a function, answer with a JSON object naming it and giving its "
                   "arguments, inside tool_call tags:\n<tool_call>\n"
                   '{"name": "<function name>", "arguments": {<arguments>}}\n</tool_call>')
        else:
            how = ("To call a function, answer with only a JSON object naming it and giving its "
                   'parameters: {"name": "<function name>", "parameters": {<parameters>}}')
        if self.forced:
            how += "\nYou must call a function now."
        elif not self.parallel:
            how += "\nCall at most one function."
        return ("You can call functions. Their signatures, one JSON object per line, inside "
                f"<tools></tools> tags:\n<tools>\n{specs}\n</tools>\n{how}")

    def write_call(self, name: str, args: Any) -> str:
        """An assistant's earlier call, written out as the model writes calls."""
        if self.parser == "hermes":
            return f"{START}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{END}"
        return json.dumps({"name": name, "parameters": args}, ensure_ascii=False)

    # --- the output ---------------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a whole answer."""
        stream = ToolStream(self)
        content, calls = stream.feed(text, final=True)
        return (content if content.strip() or not calls else None), calls

    def call(self, obj: Any) -> dict[str, Any] | None:
        """An OpenAI tool call from a parsed object, or None if it is not a call to one of the
        request's functions."""
        if not isinstance(obj, dict) or obj.get("name") not in self.functions:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if not isinstance(args, dict):
            return None
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": obj["name"],
                             "arguments": json.dumps(args, ensure_ascii=False)}}


@dataclass
class ToolStream:
    """One choice's text, fed as it streams: content passes through (a tail that could begin a
    call is held back), each complete call comes out once, parsed. `final` flushes the rest;
    text that never formed a valid call comes out as content."""

    tools: Tools
    buf: str = ""
    inside: bool = False
    emitted: int = 0  # calls returned so far
    started: bool = False  # llama3_json: the first non-blank character was seen
    whole_json: bool = False  # llama3_json: the answer is JSON, parsed at the end

    def feed(self, text: str, final: bool = False) -> tuple[str, list[dict[str, Any]]]:
        self.buf += text
        if self.tools.parser == "llama3_json":
            return self._feed_json(final)
        out, calls = "", []
        while True:
            if not self.inside:
                k = self.buf.find(START)
                if k >= 0:
                    out += self.buf[:k]
                    self.buf, self.inside = self.buf[k + len(START):], True
                    continue
                keep = 0 if final else _partial_suffix(self.buf, START)
                out += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                break
            k = self.buf.find(END)
            if k < 0:
                if final:  # an unfinished call: text
                    out += START + self.buf
                    self.buf, self.inside = "", False
                break
            body, self.buf, self.inside = self.buf[:k], self.buf[k + len(END):], False
            call = self._call(body)
            if call is None:
                out += START + body + END
            elif call:
                calls.append(call)
        return out, calls

    def _call(self, body: str) -> dict[str, Any] | None:
        """The call in a block (None: not a call, so text; {}: a call dropped because only one
        may be returned)."""
        try:
            call = self.tools.call(json.loads(body))
        except ValueError:
            return None
        if call is None:
            return None
        if self.emitted and not self.tools.parallel:
            return {}  # a second call where only one may be: dropped
        self.emitted += 1
        return call

    def _feed_json(self, final: bool) -> tuple[str, list[dict[str, Any]]]:
        if not self.started:
            head = self.buf.lstrip()
            if not head and not final:
                return "", []
            self.started = True
            self.whole_json = head.startswith(("{", "<|python_tag|>"))
        if not self.whole_json:
            out, self.buf = self.buf, ""
            return out, []
        if not final:
            return "", []
        text, self.buf = self.buf, ""
        calls = _json_calls(self.tools, text.strip().removeprefix("<|python_tag|>"))
        if calls is None:
            return text, []
        if not self.tools.parallel:
            calls = calls[:1]
        self.emitted = len(calls)
        return "", calls


def _json_calls(tools: Tools, text: str) -> list[dict[str, Any]] | None:
    """llama3_json: objects separated by ';' (or blanks), every one a call, else None."""
    dec, pos, calls = json.JSONDecoder(), 0, []
    while pos < len(text):
        while pos < len(text) and text[pos] in " \t\r\n;":
            pos += 1
        if pos == len(text):
            break
        try:
            obj, pos = dec.raw_decode(text, pos)
        except ValueError:
            return None
        call = tools.call(obj)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of marker."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    params = function.get("parameters")
    return params if isinstance(params, dict) and params else {"type": "object"}


# --- the request -------------------------------------------------------------------------------


def tools_of(extra: dict[str, Any] | None, parser: str) -> Tools | None:
    """The request's Tools (None without tools); ApiError(400) naming the field when malformed."""
    extra = extra or {}
    raw, choice = extra.get("tools"), extra.get("tool_choice")
    parallel = extra.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be a boolean", param="parallel_tool_calls")
    if not raw:
        if choice not in (None, "none"):
            raise ApiError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None
    functions = _functions(raw)
    named = None
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        named = fn.get("name") if isinstance(fn, dict) else None
        if named not in functions:
            raise ApiError(400, "'tool_choice' names no function of 'tools' (send {'type': "
                           "'function', 'function': {'name': ...}})", param="tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise ApiError(400, "'tool_choice' must be 'none', 'auto', 'required' or a named "
                       "function", param="tool_choice")
    return Tools(functions, choice, named, parallel, parser)


def _functions(raw: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of at most {MAX_TOOLS} tools", param="tools")
    out: dict[str, dict[str, Any]] = {}
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        where = f"tools[{i}]"
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise ApiError(400, f"'{where}' must be {{'type': 'function', 'function': {{'name': "
                           "...}}}} with a name of 1-64 letters, digits, '_', '.' or '-'",
                           param="tools")
        if name in out:
            raise ApiError(400, f"'{where}': the function name {name!r} is used twice",
                           param="tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ApiError(400, f"'{where}.function.parameters' must be a JSON schema object",
                           param="tools")
        if not isinstance(fn.get("description", ""), str):
            raise ApiError(400, f"'{where}.function.description' must be a string",
                           param="tools")
        out[name] = {k: fn[k] for k in ("name", "description", "parameters") if k in fn}
    return out


# --- the input messages ------------------------------------------------------------------------


def prompt_messages(messages: list[Any], tools: Tools | None, template_takes_tools: bool,
                    parser: str) -> list[dict[str, Any]] | ToolChat:
    """The engine's chat prompt for messages that may hold tool calls and results."""
    writer = tools or Tools({}, "none", None, True, parser)
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        calls = _message_calls(i, m)
        text = m.text()
        if template_takes_tools:
            msg: dict[str, Any] = {"role": m.role, "content": text}
            if calls:
                msg["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                      "function": {"name": n, "arguments": a}}
                                     for c, n, a in calls]
            extra = m.model_extra or {}
            if m.role == "tool" and isinstance(extra.get("tool_call_id"), str):
                msg["tool_call_id"] = extra["tool_call_id"]
            if m.name is not None:
                msg["name"] = m.name
            out.append(msg)
        elif m.role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            written = [writer.write_call(n, a) for _, n, a in calls]
            out.append({"role": m.role, "content": "\n".join(([text] if text else []) + written)})
    if template_takes_tools:
        return ToolChat(out, tools.openai_tools()) if tools and tools.in_prompt else out
    if tools and tools.in_prompt:
        section = tools.system_text()
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _message_calls(i: int, m: Any) -> list[tuple[dict[str, Any], str, Any]]:
    """An assistant message's tool_calls as (call, name, arguments object); 400 if malformed."""
    raw = (m.model_extra or {}).get("tool_calls")
    if raw is None:
        return []
    where = f"messages[{i}].tool_calls"
    if m.role != "assistant" or not isinstance(raw, list):
        raise ApiError(400, f"'{where}' belongs to an assistant message, as a list",
                       param="messages")
    out = []
    for j, c in enumerate(raw):
        fn = c.get("function") if isinstance(c, dict) else None
        name = fn.get("name") if isinstance(fn, dict) else None
        args = fn.get("arguments") if isinstance(fn, dict) else None
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            parsed = None
        if not isinstance(name, str) or not isinstance(parsed, dict):
            raise ApiError(400, f"'{where}[{j}]' must be {{'type': 'function', 'function': "
                           "{'name': str, 'arguments': a JSON object as a string}}",
                           param="messages")
        out.append((c, name, parsed))
    return out


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template reads `tools`."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template
