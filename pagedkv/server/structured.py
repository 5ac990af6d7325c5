"""The request fields that ask for structured output, as OpenAI, vLLM and llama-server spell
them, turned into the engine's one StructuredOutputsParams.

- OpenAI: `response_format` {"type": "text" | "json_object" | "json_schema", "json_schema":
  {"name", "schema", "strict"}}.
- vLLM: `structured_outputs` {"json" | "regex" | "choice" | "grammar" | "json_object"} and the
  older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (`guided_decoding_backend`: "auto", "guidance" or "llguidance", the one backend here).
- llama-server: `json_schema` (a schema) and `grammar` (GBNF).

At most one field may constrain a request; a malformed one is a 400 naming it. Whether the
constraint compiles is checked by the engine's GrammarCompiler, on the preprocessing thread.
"""

from __future__ import annotations

from typing import Any

from pagedkv.engine.structured_params import KINDS, StructuredOutputsParams
from pagedkv.errors import GrammarError
from pagedkv.server.protocol import ApiError

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex",
          "guided_choice", "guided_grammar", "json_schema", "grammar")
BACKENDS = (None, "auto", "guidance", "llguidance")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def request_constraint(extra: dict[str, Any] | None) -> tuple[StructuredOutputsParams | None,
                                                                   str | None]:
    """(the constraint, the field it came from), or (None, None); ApiError(400) if malformed
    or if two fields constrain the request."""
    extra = extra or {}
    backend = extra.get("guided_decoding_backend")
    if backend not in BACKENDS:
        raise ApiError(400, f"'guided_decoding_backend' {backend!r} is not available; this "
                       "server's backend is llguidance ('auto', 'guidance' or 'llguidance')",
                       param="guided_decoding_backend", code="unsupported_parameter")
    found: list[tuple[StructuredOutputsParams, str]] = []
    for name in FIELDS:
        value = extra.get(name)
        if value is None:
            continue
        try:
            spec = _parse(name, value)
        except GrammarError as exc:
            raise ApiError(400, f"'{name}': {exc}", param=name) from None
        if spec is not None:
            found.append((spec, name))
    if len(found) > 1:
        names = ", ".join(f"'{n}'" for _, n in found)
        raise ApiError(400, f"{names} each constrain the output: send only one",
                       param=found[1][1])
    return found[0] if found else (None, None)


def _parse(name: str, value: Any) -> StructuredOutputsParams | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise GrammarError("must be an object with one of json, regex, choice, grammar, "
                               "json_object")
        unknown = sorted(set(value) - set(KINDS))
        if unknown:
            raise GrammarError(f"unsupported option {unknown[0]!r} (this server takes "
                               f"{', '.join(KINDS)})")
        return StructuredOutputsParams(**value)
    if name in _GUIDED:
        return StructuredOutputsParams(**{_GUIDED[name]: value})
    if name == "json_schema":  # llama-server: the schema itself
        return StructuredOutputsParams(json=value)
    if name == "grammar":  # llama-server: GBNF; "" is off
        if value == "":
            return None
        return StructuredOutputsParams(grammar=value)
    raise AssertionError(name)


def _response_format(value: Any) -> StructuredOutputsParams | None:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise GrammarError("json_schema needs a 'schema' object ({'type': 'json_schema', "
                               "'json_schema': {'name': ..., 'schema': {...}}})")
        if not isinstance(spec.get("strict", False), bool | None):
            raise GrammarError("json_schema.strict must be a boolean")
        return StructuredOutputsParams(json=spec["schema"])  # always enforced, strict or not
    raise GrammarError("type must be 'text', 'json_object' or 'json_schema'")
