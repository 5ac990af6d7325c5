"""Speculative decoding through the real server and the openai client: outputs as offline
without speculation, per-request acceptance in usage, vLLM's spec_decode counters."""

from __future__ import annotations

from typing import Any

import pytest
from test_server import Running, assert_idle

from pagedkv.engine import LLM, LLMEngine, SamplingParams
from pagedkv.model import default_model_path
from pagedkv.server.app import ServerThread, build_app

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
TEXT = ("The lighthouse keeper climbed the stairs every evening at six, lit the lamp, and "
        "wrote one line in the log: calm sea, clear sky, no ships.")
MESSAGES = [{"role": "user", "content": f"Copy this text exactly:\n\n{TEXT}"}]


@pytest.mark.parametrize("spec", [SPEC, {"method": "draft_model", "num_speculative_tokens": 3,
                                          "adaptive": False}], ids=["ngram", "draft_model"])
def test_server_with_speculative_config(smollm2: Any, spec: dict) -> None:
    ref = LLM(smollm2, num_blocks=256).generate(MESSAGES, SamplingParams(temperature=0,
                                                                       max_tokens=48))[0]
    if spec["method"] == "draft_model":  # the default model drafting for itself
        spec = {**spec, "model": str(default_model_path())}
    engine = LLMEngine(smollm2, num_blocks=256, speculative_config=spec)
    app = build_app(engine, served_model_name="smollm2")
    with ServerThread(app) as thread:
        server = Running(thread.url, engine, app)
        client = server.client()
        r = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=48,
                                           temperature=0)
        assert r.choices[0].message.content == ref.text
        details = r.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
        chunks = list(client.chat.completions.create(
            model="smollm2", messages=MESSAGES, max_tokens=48, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.text
        usage = chunks[-1].usage
        assert usage.completion_tokens == len(ref.token_ids)
        assert usage.completion_tokens_details.accepted_prediction_tokens > 0
        m = server.metrics()
        assert m["pagedkv:spec_decode_num_draft_tokens_total"] >= (
            m["pagedkv:spec_decode_num_accepted_tokens_total"]) > 0
        assert m["pagedkv:spec_decode_num_drafts_total"] > 0
        assert 0 < m["pagedkv:spec_decode_acceptance_rate"] <= 1
        assert_idle(server)
