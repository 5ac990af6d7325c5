"""StructuredOutputsParams: a request's one output constraint (vLLM's shape; GuidedDecodingParams
is the older name), checked and capped when built. No heavy imports: the engine's
GrammarCompiler (structured.py) compiles it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedkv.errors import GrammarError

MAX_SPEC_BYTES = 64 * 1024  # a schema / regex / grammar / choice list, as UTF-8 text
MAX_CHOICES = 1024
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, dict or text), `regex`, `choice` (a list of
    strings), `grammar` (GBNF as llama.cpp writes it, or Lark), `json_object` (True: any JSON
    object). Checked when built (InvalidParamsError/GrammarError naming the field); whether the
    constraint compiles is checked by the engine's GrammarCompiler."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise GrammarError("structured outputs take exactly one of json, regex, choice, "
                               f"grammar, json_object (got {', '.join(given) or 'none'})",
                               "structured_outputs")
        kind = given[0]
        self._check(kind)
        if len(self.key()[1].encode("utf-8", "surrogatepass")) > MAX_SPEC_BYTES:
            raise GrammarError(f"the {kind} constraint is over {MAX_SPEC_BYTES} bytes", kind)

    def _check(self, kind: str) -> None:
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise GrammarError(f"json schema is not valid JSON: {exc}", kind) from None
            if not isinstance(value, dict):
                raise GrammarError("json schema must be a JSON object", kind)
            self.json = value  # type: ignore[assignment]
        elif kind == "choice":
            if (not isinstance(value, list | tuple) or not value or len(value) > MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in value)):
                raise GrammarError(f"choice must be 1..{MAX_CHOICES} non-empty strings", kind)
            self.choice = list(value)
        elif kind == "json_object":
            if value is not True:
                raise GrammarError("json_object must be true", kind)
        elif not isinstance(value, str) or not value.strip():
            raise GrammarError(f"{kind} must be a non-empty string", kind)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): the compile cache's key."""
        kind = self.kind
        if kind == "json":
            return kind, json.dumps(self.json, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, json.dumps(self.choice)
        if kind == "json_object":
            return kind, "{}"
        return kind, getattr(self, kind)


GuidedDecodingParams = StructuredOutputsParams  # vLLM's older name
