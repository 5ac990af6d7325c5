"""Request fields pagedkv knows but does not implement: a 400 naming the field, never a 200
that quietly behaves differently from what the client asked for.

Tool calling (tools, tool_choice, parallel_tool_calls: server/tools.py) and structured outputs
(response_format, structured_outputs, guided_*, llama-server's json_schema and
grammar) are implemented: server/structured.py reads them. Each entry lists the values that ask for nothing (what a client sends when the feature is
off); those pass. Fields in neither this table nor the request models (e.g. `user`,
`metadata`) are bookkeeping for the client and are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from pagedkv.server.protocol import ApiError

_OFF = (None,)

# field -> values that mean "feature off"
BOTH: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "best_of": (None, 1),  # a best_of equal to n is accepted too (see check_supported)
    "functions": (None, []),
    "function_call": (None, "none"),
    "audio": _OFF,
    "modalities": (None, ["text"]),
    "prediction": _OFF,
    "web_search_options": _OFF,
    "reasoning_effort": _OFF,
    "store": (None, False),
    # vLLM extensions
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "truncate_prompt_tokens": _OFF,
    "prompt_logprobs": _OFF,
    "bad_words": (None, []),
    "allowed_token_ids": _OFF,
    "guided_whitespace_pattern": _OFF,
    "priority": (None, 0),
    "return_tokens_as_token_ids": (None, False),
    "lora_request": _OFF,
    # llama-server extensions
    "n_probs": (None, 0),
    # SGLang extensions (sglang-router sends them to every worker, off)
    "no_stop_trim": (None, False),
    "return_hidden_states": (None, False),
    "lora_path": _OFF,
}
COMPLETIONS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""),
    "tools": (None, []),  # tool calling is chat's
    "tool_choice": (None, "none"),
}
CHAT: dict[str, tuple[Any, ...]] = {
    "echo": (None, False),
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "chat_template": _OFF,
    "chat_template_kwargs": (None, {}),
    "documents": _OFF,
}


def _is_off(value: Any, off: tuple[Any, ...]) -> bool:
    # exact types: True must not pass for 1, nor 0 for False
    return any(value is None if o is None else type(value) is type(o) and value == o for o in off)


# message fields of the legacy function calling (tool_calls and tool_call_id are implemented:
# server/tools.py): a prompt built without them would silently differ from what was sent
MESSAGE_FIELDS = ("function_call",)


def check_consistent(req: Any) -> None:
    """Raise ApiError(400) for fields that only mean something together with another one
    (OpenAI and vLLM refuse these too) and for legacy function-calling message fields."""
    if getattr(req, "top_logprobs", None) is not None and not getattr(req, "logprobs", False):
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true",
                       param="stream_options")
    for i, m in enumerate(getattr(req, "messages", None) or []):
        for name in MESSAGE_FIELDS:
            if (m.model_extra or {}).get(name) is not None:
                raise ApiError(400, f"'messages[{i}].{name}' is not supported by this server "
                               "(use tool_calls)", param="messages",
                               code="unsupported_parameter")


def check_supported(extra: dict[str, Any] | None, *, chat: bool, n: int = 1) -> None:
    """Raise ApiError(400) for the first field in `extra` (a request's fields that the
    request model does not declare) asking for something pagedkv does not do."""
    table = {**BOTH, **(CHAT if chat else COMPLETIONS)}
    for name, value in (extra or {}).items():
        off = table.get(name)
        if off is None or _is_off(value, off):
            continue
        if name == "best_of" and type(value) is int and value == n:
            continue
        raise ApiError(400, f"'{name}' is not supported by this server; leave it out"
                       f"{'' if off == _OFF else f' or send {off[-1]!r}'}", param=name,
                       code="unsupported_parameter")
