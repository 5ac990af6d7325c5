"""Issue 24 item 8 through the real server: one client never starves the others.

`--max-request-tokens` caps n x max_tokens (x prompts) per request (a 400 naming the field; a
request without max_tokens is held to the cap per sample), and the scheduler's fair shares let
another tenant's small request in while a greedy n = max_num_seqs request holds every slot:
its first token comes within a few of the greedy request's decode steps, and the greedy request
still finishes every sample with the output it has alone.
"""

# ruff: noqa: F811  (pytest fixtures imported from test_server are used as arguments)
from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from test_server import expected_echo, serve_fake  # noqa: F401 (a fixture)

from pagedkv.errors import InvalidParamsError
from pagedkv.server import ServerConfig, ServerThread, build_app

# --- the cap ---------------------------------------------------------------------------------


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json={"model": "fake", **body}, timeout=30)


def _error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def test_n_times_max_tokens_over_the_cap_is_a_400_naming_the_fields(serve_fake: Any) -> None:
    url = serve_fake(max_request_tokens=500).url
    msg = _error(_post(url, "/v1/completions", {"prompt": "ab", "n": 8, "max_tokens": 100}),
                 "max_tokens")
    assert "n (8) x max_tokens (100) = 800" in msg and "500" in msg
    msg = _error(_post(url, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "hi"}], "n": 4,
        "max_completion_tokens": 200}), "max_completion_tokens")
    assert "max_completion_tokens (200)" in msg
    msg = _error(_post(url, "/v1/completions", {"prompt": ["ab", "cd"], "n": 2,
                                                 "max_tokens": 200}), "max_tokens")
    assert "x 2 prompts" in msg
    ok = _post(url, "/v1/completions", {"prompt": "ab", "n": 5, "max_tokens": 100})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 5


def test_without_max_tokens_each_sample_gets_its_share_of_the_cap(serve_fake: Any) -> None:
    url = serve_fake(max_request_tokens=40).url
    _error(_post(url, "/v1/completions", {"prompt": "ab", "n": 41}), "n")
    r = _post(url, "/v1/completions", {"prompt": "abcdefgh", "n": 4})  # default 16 -> 10
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] == [expected_echo("abcdefgh", 10)] * 4
    chat = _post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "xy"}],
                                               "n": 8})  # the context would allow far more
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] <= 40


@pytest.mark.parametrize("bad", [0, -1, "x"])
def test_max_request_tokens_must_be_positive(bad: Any) -> None:
    with pytest.raises(InvalidParamsError, match="max_request_tokens"):
        ServerConfig(max_request_tokens=bad)


# --- fair shares on the real model -------------------------------------------------------------

GREEDY_PROMPT = "Write a long story about a dragon who learns to bake bread:"
SMALL_PROMPT = "The capital of France is"
KEYS = {"greedy": "key-greedy", "small": "key-small"}
SLOTS = 8
STEPS_BOUND = 4  # the small request's first token within this many greedy decode steps


def _stream(url: str, key: str, body: dict, stamps: dict[int, list[float]],
            texts: dict[int, str], reasons: dict[int, str]) -> None:
    import json

    with httpx.stream("POST", url + "/v1/completions", timeout=600,
                      headers={"Authorization": f"Bearer {key}"},
                      json={"model": "smollm2", "stream": True, "temperature": 0, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                i = c["index"]
                if c["text"]:
                    stamps.setdefault(i, []).append(time.monotonic())
                texts[i] = texts.get(i, "") + c["text"]
                if c["finish_reason"]:
                    reasons[i] = c["finish_reason"]


def _complete(url: str, key: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(url + "/v1/completions", timeout=300, headers={"Authorization": f"Bearer {key}"},
                   json={"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_small_request_gets_in_while_n_equal_max_num_seqs_holds_every_slot(smollm2: Any) -> None:
    """The issue's attack at max_num_seqs=8: n=8 (every slot), 48 tokens each, from one API
    key; another key's 4-token request arrives mid-way. Before fair shares it waited for all
    48 steps; now its first token comes within STEPS_BOUND of the greedy request's steps (one
    greedy sample is preempted and recomputed from its cached blocks), and all 8 greedy
    samples still end with the text the request produces alone."""
    from pagedkv.engine import LLMEngine

    engine = LLMEngine(smollm2, num_blocks=512, max_num_seqs=SLOTS, max_model_len=512)
    app = build_app(engine, served_model_name="smollm2", api_key=list(KEYS.values()))
    with ServerThread(app) as srv:
        url = srv.url
        alone = _complete(url, KEYS["greedy"], GREEDY_PROMPT, 48)
        small_ref = _complete(url, KEYS["small"], SMALL_PROMPT, 4)
        stamps: dict[int, list[float]] = {}
        texts: dict[int, str] = {}
        reasons: dict[int, str] = {}
        greedy = threading.Thread(target=_stream, args=(
            url, KEYS["greedy"], {"prompt": GREEDY_PROMPT, "n": SLOTS, "max_tokens": 48},
            stamps, texts, reasons))
        greedy.start()
        deadline = time.monotonic() + 300
        while len(stamps.get(0, [])) < 8:
            assert time.monotonic() < deadline and greedy.is_alive()
            time.sleep(0.01)
        assert len(engine.scheduler.running) == SLOTS
        s_stamps: dict[int, list[float]] = {}
        s_texts: dict[int, str] = {}
        s_reasons: dict[int, str] = {}
        t_send = time.monotonic()
        _stream(url, KEYS["small"], {"prompt": SMALL_PROMPT, "max_tokens": 4}, s_stamps,
                s_texts, s_reasons)
        greedy.join(600)
        first = s_stamps[0][0]
        steps_waited = sum(t_send < t < first for t in stamps[0])
        assert steps_waited <= STEPS_BOUND, steps_waited
        assert s_texts[0] == small_ref and s_reasons[0] == "length"
        assert len(stamps[0]) > steps_waited + 8  # the greedy request was still going
        assert [texts[i] for i in range(SLOTS)] == [alone] * SLOTS
        assert all(reasons[i] == "length" for i in range(SLOTS))
        assert engine.stats().fair_preemptions >= 1
