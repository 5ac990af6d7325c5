"""OpenAI-compatible request models, the API error type, and response/chunk builders.

Requests are validated strictly (a string where a number belongs is a 400, not silently
coerced) because that is what OpenAI clients expect. Undeclared fields are kept in
`model_extra`: the server refuses those it knows and does not implement (see unsupported.py)
and ignores the rest, so newer clients that send extra bookkeeping options keep working.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pagedkv.server.stream import Choice, TokenLogprob, Update

M = TypeVar("M", bound=BaseModel)

# Caps on what one request may ask for (the body itself is capped by the server).
MAX_MESSAGES = 2048
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024
MIN_TEMPERATURE = 1e-4  # 0 is greedy; tiny positive values overflow logits / T in float32
MIN_TOP_P = 1e-6  # smaller would round to 0 in float32 (nothing left to sample from)
INT64 = (-(2**63), 2**63 - 1)

# --- errors ----------------------------------------------------------------------------------


class ApiError(Exception):
    """An error the server reports to the client as an OpenAI-style JSON body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def parse_request(model: type[M], raw: bytes) -> M:
    """Validate a raw JSON body; every problem becomes a 400 naming the offending field."""
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "json_invalid":
            raise ApiError(400, f"Malformed JSON body: {err['msg']}") from None
        loc = [str(p) for p in err["loc"]]
        param = loc[0] if loc else None
        where = ".".join(loc) or "body"
        raise ApiError(400, f"Invalid value for '{where}': {err['msg']}", param=param) from None


# --- requests --------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool | None = False


class _GenerationRequest(BaseModel):
    """Sampling fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=MIN_TOP_P, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1)  # extension; 0/-1 = off
    seed: int | None = Field(default=None, ge=INT64[0], le=INT64[1])  # OpenAI: int64
    stop: str | list[str] | None = Field(default=None)
    stop_token_ids: list[int] | None = Field(  # extension
        default=None, max_length=MAX_STOP_TOKEN_IDS)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # extension
    ignore_eos: bool = False  # extension
    # ranges are SamplingParams' (its error names the field)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # extension (vLLM)
    min_p: float | None = None  # extension (vLLM)
    min_tokens: int | None = None  # extension (vLLM)
    n: int = Field(default=1, ge=1, le=64)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("temperature")
    @classmethod
    def _not_tiny(cls, t: float | None) -> float | None:
        if t is not None and 0 < t < MIN_TEMPERATURE:
            raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
        return t

    @field_validator("logit_bias")
    @classmethod
    def _bias_entries(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()) or len(key) > 10:  # not "²", "１", "٣"
                raise ValueError("keys must be token ids (ASCII digits)")
            if not -100.0 <= value <= 100.0:
                raise ValueError("biases must lie in [-100, 100]")
        return bias

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        if len(stops) > 16 or any(not s for s in stops):
            raise ApiError(400, "'stop' takes at most 16 non-empty strings", param="stop")
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def logprobs_count(self) -> int | None:
        return None

    def sampling_kwargs(self, max_tokens: int) -> dict[str, Any]:
        """Keyword arguments for SamplingParams; None fields keep the engine's defaults."""
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "seed": self.seed,
            "stop": self.stop_list() or None,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "n": self.n,
        }
        if self.logprobs_count() is not None:
            kwargs["logprobs"] = self.logprobs_count()
        for name in SAMPLING_EXTRAS:
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.logit_bias is not None:  # keys validated as token ids
            kwargs["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
        return kwargs


SAMPLING_EXTRAS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                   "min_tokens", "logit_bias")
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions request
MAX_BATCH_CHOICES = 256  # prompts x n


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False

    def engine_prompts(self) -> list[str | list[int]]:
        """The prompts: one string, one token-id list, or a list of either (a batch: one
        engine request each, their choices numbered prompt * n + sample, as vLLM does)."""
        if self.echo:
            raise ApiError(400, "'echo' is not supported", param="echo")
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ApiError(400, "'prompt' must not be empty", param="prompt")
        if not isinstance(prompt[0], str | list):
            return [list(prompt)]  # type: ignore[arg-type]
        if len(prompt) > MAX_BATCH_PROMPTS or len(prompt) * self.n > MAX_BATCH_CHOICES:
            raise ApiError(400, f"at most {MAX_BATCH_PROMPTS} prompts and {MAX_BATCH_CHOICES} "
                           f"choices (prompts x n) per request", param="prompt")
        if any(not p for p in prompt):
            raise ApiError(400, "'prompt' must not contain an empty prompt", param="prompt")
        return [p if isinstance(p, str) else list(p) for p in prompt]

    def engine_prompt(self) -> str | list[int]:
        """The first prompt (a single-prompt request's only one)."""
        return self.engine_prompts()[0]

    def logprobs_count(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # undeclared fields are kept so unsupported.check_consistent can refuse tool-call fields
    model_config = ConfigDict(strict=True, extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def engine_prompt(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]

    def engine_prompts(self) -> list[list[dict[str, str]]]:
        return [self.engine_prompt()]

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens is the newer name; it wins when both are given.
        return self.max_completion_tokens or self.max_tokens

    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# --- responses -------------------------------------------------------------------------------


def usage(update: Update) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in update.choices)
    out: dict[str, Any] = {
        "prompt_tokens": update.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": update.prompt_tokens + completion,
    }
    if update.cached_tokens:
        out["prompt_tokens_details"] = {"cached_tokens": update.cached_tokens}
        if update.tier_cached_tokens:  # pagedkv extension: of those, loaded from the KV tier
            out["prompt_tokens_details"]["tier_cached_tokens"] = update.tier_cached_tokens
    if update.draft_tokens:  # speculative decoding, in OpenAI's predicted-outputs fields
        out["completion_tokens_details"] = {
            "accepted_prediction_tokens": update.accepted_tokens,
            "rejected_prediction_tokens": update.draft_tokens - update.accepted_tokens,
        }
    return out


class ResponseFormat:
    """Builds the JSON objects of one endpoint (completions or chat) for one request."""

    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, request_id: str, model: str, top_logprobs: int = 0) -> None:
        self.request_id = request_id
        self.model = model
        self.top_logprobs = top_logprobs
        self.created = int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def full(self, update: Update) -> dict[str, Any]:
        body = self._envelope(self.object_full, [self.full_choice(c) for c in update.choices])
        body["usage"] = usage(update)
        return body

    def usage_chunk(self, update: Update) -> dict[str, Any]:
        body = self._envelope(self.object_chunk, [])
        body["usage"] = usage(update)
        return body

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        return {
            "index": choice.index,
            "text": choice.text,
            "logprobs": self.logprobs(choice.logprobs),
            "finish_reason": choice.finish_reason,
        }

    def logprobs(
        self, entries: Sequence[TokenLogprob] | None, text_offset: int = 0
    ) -> dict[str, Any] | None:
        """The legacy completions shape: parallel lists, top alternatives as dicts."""
        if entries is None:
            return None
        offsets = list(itertools.accumulate((len(e.token) for e in entries[:-1]),
                                            initial=text_offset))
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top[: self.top_logprobs]) for e in entries],
            "text_offset": offsets[: len(entries)],
        }

    def start_chunks(self, index: int) -> list[dict[str, Any]]:
        return []

    def delta_chunk(
        self, index: int, text: str, finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return self._envelope(self.object_chunk, [choice])


class ChatResponseFormat(ResponseFormat):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"
    tools: Any = None  # server/tools.Tools when the request offered tools: calls are parsed

    def full_choice(self, choice: Choice) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": choice.text}
        reason = choice.finish_reason
        if self.tools is not None:
            content, calls = self.tools.parse(choice.text)
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                if reason == "stop" and self.tools.choice != "named":
                    reason = "tool_calls"
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self.logprobs(choice.logprobs),
            "finish_reason": reason,
        }

    def tool_call_chunks(self, index: int, calls: list[dict[str, Any]], first: int
                         ) -> list[dict[str, Any]]:
        """OpenAI's tool-call deltas: per call, its id, type and name (arguments ""), then
        its arguments; `first` is the first call's index within the choice."""
        out = []
        for k, call in enumerate(calls, first):
            fn = call["function"]
            head = {"index": k, "id": call["id"], "type": "function",
                    "function": {"name": fn["name"], "arguments": ""}}
            for delta in (head, {"index": k, "function": {"arguments": fn["arguments"]}}):
                choice = {"index": index, "delta": {"tool_calls": [delta]}, "logprobs": None,
                          "finish_reason": None}
                out.append(self._envelope(self.object_chunk, [choice]))
        return out

    def logprobs(
        self, entries: Sequence[TokenLogprob] | None, text_offset: int = 0
    ) -> dict[str, Any] | None:
        if entries is None:
            return None

        def item(token: str, logprob: float) -> dict[str, Any]:
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {"content": [
            {**item(e.token, e.logprob),
             "top_logprobs": [item(t, lp) for t, lp in e.top[: self.top_logprobs]]}
            for e in entries
        ]}

    def start_chunks(self, index: int) -> list[dict[str, Any]]:
        # OpenAI sends the role alone in the first delta of every choice.
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return [self._envelope(self.object_chunk, [choice])]

    def delta_chunk(
        self, index: int, text: str, finish_reason: str | None,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        choice = {"index": index, "delta": delta, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return self._envelope(self.object_chunk, [choice])
