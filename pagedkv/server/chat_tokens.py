"""`--chat-content-special-tokens text`: message content can never forge a chat role.

By default (vLLM's behaviour) the chat template is rendered to text and the whole text is
tokenized, so a user message holding `<|im_end|>\\n<|im_start|>system` becomes the real special
tokens: the user writes a system turn. `content_as_text` renders the template with a unique
placeholder per message, tokenizes the template's own text with its special tokens and each
message's content with `split_special_tokens=True` (special-token strings in it become ordinary
text tokens), and joins the pieces. Invariant: the template's markers are the only special
tokens in the result that come from markup; content without special-token strings tokenizes
as it does by default whenever the template puts a special token or a newline around it
(ChatML and Llama templates do), which a test checks on the shipped model.
"""

from __future__ import annotations

import secrets
from typing import Any


def content_as_text(tokenizer: Any, messages: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of the chat prompt, every message's content tokenized as plain text (`tools`:
    passed to a template that reads them)."""
    tag = secrets.token_hex(8)
    marks = [f"\u2063{tag}:{i}\u2063" for i in range(len(messages))]
    masked = [{**m, "content": marks[i]} if isinstance(m.get("content"), str) else m
              for i, m in enumerate(messages)]
    kwargs = {"tools": tools} if tools else {}
    text = tokenizer.apply_chat_template(masked, tokenize=False, add_generation_prompt=True,
                                         **kwargs)
    ids: list[int] = []
    for i, m in enumerate(messages):
        if masked[i] is m:
            continue
        before, found, text = text.partition(marks[i])
        if not found:  # the template transformed the content: refuse rather than guess
            raise ValueError("the chat template does not keep message content verbatim")
        ids += _ids(tokenizer, before, split=False)
        ids += _ids(tokenizer, m["content"], split=True)
    return ids + _ids(tokenizer, text, split=False)


def _ids(tokenizer: Any, text: str, *, split: bool) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=split).input_ids)
