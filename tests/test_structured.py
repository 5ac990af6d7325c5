"""Structured outputs in the engine: constraints checked and compiled, masks in the batched
sampler, matchers that follow their sequence through forks, preemption and prefix hits."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.engine import LLM, SamplingParams, StructuredOutputsParams
from pagedkv.engine.sampler import FAILED, Sampler
from pagedkv.engine.structured import GrammarCompiler
from pagedkv.errors import GrammarError, InvalidParamsError

S = StructuredOutputsParams
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPTS = [[{"role": "user", "content": f"Describe {who} as a JSON object."}]
           for who in ("a baker from Paris", "an old sailor", "a child in Rome", "my neighbour",
                       "a famous painter", "a doctor from Oslo")]


def _valid_person(text: str) -> bool:
    obj = json.loads(text)
    return (set(obj) == {"name", "age", "city"} and isinstance(obj["name"], str)
            and len(obj["name"]) <= 24 and type(obj["age"]) is int and 0 <= obj["age"] <= 150
            and obj["city"] in ("Paris", "Rome", "Oslo"))


@pytest.fixture(scope="module")
def llm(smollm2) -> LLM:  # noqa: ANN001
    return LLM(smollm2, num_blocks=256)


@pytest.fixture(scope="module")
def compiler(llm) -> GrammarCompiler:  # noqa: ANN001
    return llm.engine.grammars


# --- the constraint's own checks (no model) ----------------------------------------------------


@pytest.mark.parametrize("kwargs, field", [
    ({}, "structured_outputs"),
    ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs"),
    ({"json": "{not json"}, "json"),
    ({"json": [1, 2]}, "json"),
    ({"regex": ""}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", ""]}, "choice"),
    ({"choice": ["a", 3]}, "choice"),
    ({"grammar": "   "}, "grammar"),
    ({"regex": "a" * 70_000}, "regex"),
    ({"json": {"enum": ["x" * 1000] * 70}}, "json"),
])
def test_bad_constraints_refused(kwargs, field) -> None:  # noqa: ANN001
    with pytest.raises(GrammarError) as e:
        S(**kwargs)
    assert e.value.param == field
    assert isinstance(e.value, InvalidParamsError)


def test_sampling_params_field_and_alias() -> None:
    spec = S(regex="[0-9]+")
    assert SamplingParams(structured_outputs=spec).structured_outputs is spec
    assert SamplingParams(guided_decoding=spec).structured_outputs is spec
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs == \
        S(choice=["a", "b"])
    with pytest.raises(InvalidParamsError):
        SamplingParams(structured_outputs=S(regex="a"), guided_decoding=S(regex="b"))
    with pytest.raises(InvalidParamsError):
        SamplingParams(structured_outputs="json")
    # the cache key ignores the schema's key order
    assert S(json={"type": "object", "required": []}).key() == \
        S(json='{"required": [], "type": "object"}').key()


# --- compiling ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec, words", [
    (S(json={"type": "frobnicate"}), "Invalid type"),
    (S(json={"type": "object", "dependentSchemas": {}}), "dependentSchemas"),  # unsupported
    (S(json={"type": "string", "format": "no-such-format"}), "format"),
    (S(json={"type": "integer", "minimum": 5, "maximum": 2}), "Unsatisfiable"),
    (S(regex="a(b"), "unclosed group"),
    (S(regex=r"[^\s\S]"), "matches no output"),
    (S(grammar="root ::= undefined-rule"), "not found"),
])
def test_compile_errors_name_the_problem(compiler, spec, words) -> None:  # noqa: ANN001
    with pytest.raises(GrammarError, match=re.escape(words)) as e:
        compiler.compile(spec)
    assert e.value.param == spec.kind


def test_compile_cache_is_bounded_lru(llm) -> None:  # noqa: ANN001
    c = GrammarCompiler(llm.tokenizer, llm.engine.loaded.config.vocab_size, [2], cache_size=2)
    a, b = c.compile(S(regex="a+")), c.compile(S(regex="b+"))
    assert c.compile(S(regex="a+")) is a  # a hit, and now the newest
    c.compile(S(regex="c+"))  # evicts b, the least recently used
    assert c.compile(S(regex="a+")) is a
    assert c.compile(S(regex="b+")) is not b
    assert c.compiles == 4


# --- the sampler -------------------------------------------------------------------------------


class _Req:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params


class _Seq:
    def __init__(self, params: SamplingParams, grammar=None) -> None:  # noqa: ANN001
        self.token_ids, self.request, self.generator = [1], _Req(params), None
        self.grammar, self.num_prompt, self.finished = grammar, 1, False


def test_mask_only_touches_constrained_rows(llm, compiler) -> None:  # noqa: ANN001
    tok = llm.tokenizer
    vocab = llm.engine.loaded.config.vocab_size
    x = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0)
    digits = compiler.compile(S(regex="[0-9]{2}")).matcher()
    seqs = [_Seq(greedy), _Seq(greedy, digits), _Seq(greedy)]
    sampler = Sampler([2], compiler)
    adjusted = sampler.adjust(x, seqs)
    assert torch.equal(adjusted[0], x[0]) and torch.equal(adjusted[2], x[2])
    allowed = torch.isfinite(adjusted[1]).nonzero()[:, 0].tolist()
    assert allowed and all(re.fullmatch(r"[0-9]{1,2}", tok.decode([t])) for t in allowed)
    out = sampler(x, seqs)
    assert out[0] == int(x[0].argmax()) and out[2] == int(x[2].argmax())
    assert out[1] in allowed and sampler.mask_rows == 2


def test_matcher_in_error_state_fails_its_row_only(llm, compiler) -> None:  # noqa: ANN001
    vocab = llm.engine.loaded.config.vocab_size
    broken = compiler.compile(S(regex="[0-9]")).matcher()
    assert not broken.accept(llm.tokenizer("x", add_special_tokens=False).input_ids[0])
    assert broken.error
    x = torch.randn(2, vocab)
    out = Sampler([2], compiler)(x, [_Seq(SamplingParams(temperature=0), broken),
                                     _Seq(SamplingParams(temperature=0))])
    assert out == [FAILED, int(x[1].argmax())]


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(seed=st.integers(0, 2**32 - 1),
       choices=st.lists(st.sampled_from(["yes", "no", "maybe", "12", "1234", "ok ok", "N/A"]),
                        min_size=1, max_size=4, unique=True))
def test_choice_property_random_logits(llm, compiler, seed, choices) -> None:  # noqa: ANN001
    """Shadow model: under any logits, the text so far is always a prefix of some choice, and a
    finished text is exactly one of them."""
    tok, vocab = llm.tokenizer, llm.engine.loaded.config.vocab_size
    g = compiler.compile(S(choice=choices)).matcher()
    sampler, gen = Sampler([2], compiler), torch.Generator().manual_seed(seed)
    seq = _Seq(SamplingParams(temperature=1.0), g)
    out: list[int] = []
    for _ in range(12):
        t = sampler(torch.randn(1, vocab, generator=gen) * 4, [seq])[0]
        assert t != FAILED and g.accept(t)
        if t == 2:
            break
        out.append(t)
        text = tok.decode(out)
        assert any(c.startswith(text) for c in choices), (text, choices)
        if g.stopped:
            break
    assert tok.decode(out) in choices


# --- the engine --------------------------------------------------------------------------------


GRAMMAR = 'root ::= answer " because " reason\nanswer ::= "yes" | "no"\nreason ::= [a-z ]{3,30} "."'
SKY = [{"role": "user", "content": "Is the sky blue?"}]
PERSON_GREEDY = SamplingParams(temperature=0, max_tokens=64, structured_outputs=S(json=PERSON))
# name -> (prompt, params): all run as one batch (the fixture below), each test reads its own
CASES = {
    **{f"person{i}": (p, PERSON_GREEDY) for i, p in enumerate(PROMPTS)},
    "sampled": (PROMPTS[0], SamplingParams(temperature=0.9, seed=7, n=3, max_tokens=64,
                                           structured_outputs=S(json=PERSON))),
    "regex": (SKY, SamplingParams(temperature=0, max_tokens=20,
                                  structured_outputs=S(regex=r"[0-9]{3}-[0-9]{4}"))),
    "choice": (SKY, SamplingParams(temperature=0, max_tokens=20,
                                   structured_outputs=S(choice=["yes", "no"]))),
    "gbnf": (SKY, SamplingParams(temperature=0, max_tokens=40,
                                 structured_outputs=S(grammar=GRAMMAR))),
    "lark": (SKY, SamplingParams(temperature=0, max_tokens=20,
                                 structured_outputs=S(grammar='start: "a" "b"+'))),
    "json_object": (SKY, SamplingParams(temperature=0, max_tokens=48,
                                        structured_outputs=S(json_object=True))),
    "length": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=5,
                                          structured_outputs=S(json=PERSON))),
    "stop": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=64, stop=['"city"'],
                                        structured_outputs=S(json=PERSON))),
    "plain": (PROMPTS[1], SamplingParams(temperature=0, max_tokens=24)),
}


@pytest.fixture(scope="module")
def batch(llm) -> dict:  # noqa: ANN001
    outs = llm.generate([p for p, _ in CASES.values()], [q for _, q in CASES.values()])
    assert llm.engine.stats().blocks_used == 0
    return dict(zip(CASES, outs, strict=True))


def test_json_schema_outputs_validate(batch) -> None:  # noqa: ANN001
    for i in range(len(PROMPTS)):
        o = batch[f"person{i}"]
        assert o.finish_reason == "stop" and _valid_person(o.text), o.text
    assert len(batch["sampled"].outputs) == 3  # n > 1: every sample has its own matcher
    for c in batch["sampled"].outputs:
        assert _valid_person(c.text), c.text


def test_regex_choice_grammar_and_json_object(batch) -> None:  # noqa: ANN001
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", batch["regex"].text)
    assert batch["choice"].text in ("yes", "no")
    gbnf = batch["gbnf"]
    assert gbnf.text.startswith(("yes because", "no because"))
    assert gbnf.finish_reason == "length" or re.fullmatch(r"(yes|no) because [a-z ]{3,30}\.",
                                                          gbnf.text)
    assert re.fullmatch("ab+", batch["lark"].text)
    assert isinstance(json.loads(batch["json_object"].text), dict)


def test_max_tokens_and_stop_with_grammar(batch) -> None:  # noqa: ANN001
    o = batch["length"]  # a truncated JSON says so
    assert o.finish_reason == "length" and len(o.token_ids) == 5 and o.text.startswith("{")
    o = batch["stop"]
    assert o.finish_reason == "stop" and '"city"' not in o.text and o.text.startswith("{")
    assert batch["plain"].finish_reason in ("stop", "length")  # unconstrained, same batch


def test_preemption_and_prefix_hits_keep_outputs(smollm2, llm, batch) -> None:  # noqa: ANN001
    """A preempted sequence recomputes its K/V from the same tokens: its matcher, which has
    consumed exactly those, carries on; prefix hits change nothing either."""
    want = [batch[f"person{i}"].token_ids for i in range(3)]
    tight = LLM(smollm2, num_blocks=8, max_num_seqs=3)
    assert [o.token_ids for o in tight.generate(PROMPTS[:3], PERSON_GREEDY)] == want
    assert tight.engine.stats().num_preemptions > 0
    tight.engine.cache.check_invariants()
    hits = llm.engine.stats().prefix_cache_hits
    assert [o.token_ids for o in llm.generate(PROMPTS[:2], PERSON_GREEDY)] == want[:2]
    assert llm.engine.stats().prefix_cache_hits > hits


def test_compile_error_adds_nothing(llm) -> None:  # noqa: ANN001
    eng = llm.engine
    with pytest.raises(GrammarError):
        eng.add_request("bad", "hi", SamplingParams(structured_outputs=S(regex="(")))
    assert not eng.has_unfinished_requests()


def test_a_broken_matcher_ends_its_request_alone(llm) -> None:  # noqa: ANN001
    """One request's matcher in its error state (whatever the cause) ends that request with
    finish_reason "error"; the batch's other requests go on and finish as they would alone."""
    eng = llm.engine
    plain = SamplingParams(temperature=0, max_tokens=12)
    alone = llm.generate(PROMPTS[1], plain)[0].token_ids
    eng.add_request("victim", PROMPTS[0], PERSON_GREEDY)
    eng.add_request("other", PROMPTS[1], plain)
    outs = {o.request_id: o for o in eng.step()}  # both prefilled, one token each
    victim = eng.requests["victim"].seqs[0]
    victim.grammar.m.consume_token(victim.token_ids[-1])  # "{" again: not JSON, error state
    assert victim.grammar.error
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step()})
    assert outs["victim"].finish_reason == "error"
    assert outs["other"].finish_reason in ("stop", "length")
    assert outs["other"].token_ids == alone
    assert eng.stats().blocks_used == 0


# --- masks computed while the forward pass runs (grammar_mask_overlap) ------------------------


def test_masks_computed_during_the_forward_change_nothing(smollm2, batch) -> None:  # noqa: ANN001
    """The whole batch (n > 1 with a seed, every constraint kind, stop, length) and a preempted
    run give the same tokens with the masks computed on the worker during each forward pass."""
    over = LLM(smollm2, num_blocks=256, grammar_mask_overlap="on")
    outs = over.generate([p for p, _ in CASES.values()], [q for _, q in CASES.values()])
    for name, o in zip(CASES, outs, strict=True):
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in batch[name].outputs], name
    s = over.engine.sampler
    assert s.mask_early > 0.8 * s.mask_rows  # all but rows whose matcher changed (forks)
    tight = LLM(smollm2, num_blocks=8, max_num_seqs=3, grammar_mask_overlap="on")
    want = [batch[f"person{i}"].token_ids for i in range(3)]
    assert [o.token_ids for o in tight.generate(PROMPTS[:3], PERSON_GREEDY)] == want
    assert tight.engine.stats().num_preemptions > 0
    over.engine.close()
    tight.engine.close()
    assert over.engine.sampler._pool is None


def test_a_stale_early_mask_is_never_used(llm, compiler) -> None:  # noqa: ANN001
    """Masks computed for a matcher before it consumed another token are dropped."""
    tok, vocab = llm.tokenizer, llm.engine.loaded.config.vocab_size
    x = torch.randn(1, vocab, generator=torch.Generator().manual_seed(1))
    g = compiler.compile(S(regex="1[a-c]")).matcher()
    seq = _Seq(SamplingParams(temperature=0), g)
    sampler = Sampler([2], compiler)
    sampler.prefetch([seq])  # the mask for the start state ("1" only) ...
    sampler._early[1].result()  # (the contract: a matcher advances once the worker is done)
    assert g.accept(tok("1", add_special_tokens=False).input_ids[0])  # ... then the state moves on
    allowed = torch.isfinite(sampler.adjust(x, [seq])[0]).nonzero()[:, 0].tolist()
    assert sorted(tok.decode([t]) for t in allowed) == ["a", "b", "c"]
    assert sampler.mask_early == 0 and sampler.mask_rows == 1
    sampler.prefetch([seq])  # a fresh one is used
    again = torch.isfinite(sampler.adjust(x, [seq])[0]).nonzero()[:, 0].tolist()
    assert again == allowed and sampler.mask_early == 1
    sampler.close()
    sampler.close()


@pytest.mark.parametrize("bad", ["yes", 3, None, ""])
def test_grammar_mask_overlap_takes_only_its_choices(bad) -> None:  # noqa: ANN001
    from pagedkv.engine.config import EngineConfig
    from pagedkv.errors import InvalidParamsError

    with pytest.raises(InvalidParamsError, match="grammar_mask_overlap"):
        EngineConfig.build(grammar_mask_overlap=bad)
