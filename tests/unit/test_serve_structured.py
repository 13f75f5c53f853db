"""Structured output through the engine (xgrammar token masks) and n choices sharing a prompt,
on the bundled tiny model: every constrained output parses and validates against its schema,
constrained and unconstrained requests share steps without changing each other's tokens, and
a sibling choice reuses its first choice's prompt blocks."""

from __future__ import annotations

import json

import jsonschema
import pytest

from duoka.errors import DuokaError
from duoka.serve.engine import LLM
from duoka.serve.params import SamplingParams, StructuredOutput
from duoka.serve.structured import check_spec
from duoka.serve.tool_calls import TOOL_CALL_PREFIX, TOOL_CALL_SUFFIX

SCHEMAS = [
    {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                      "return": {"type": "boolean"}},
     "required": ["city", "days", "return"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                               "maxItems": 3},
                                      "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                "required": ["ok"]}},
     "required": ["tags", "inner"]},
    {"type": "object", "properties": {"label": {"type": "string", "maxLength": 6}, "score": {"type": "integer", "minimum": -5, "maximum": 5}},
     "required": ["label"]},
]
PROMPTS = ["Plan a trip:", "x"]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, device="cpu", max_model_len=256, num_kv_blocks=96)


def _json_params(schema: dict, temperature: float, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=120, temperature=temperature, seed=seed,
                          structured=StructuredOutput("json_schema", json.dumps(schema), "test"))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_schema(llm, temperature):
    engine = llm.engine
    expected = {}
    for i, prompt in enumerate(PROMPTS):
        for j, schema in enumerate(SCHEMAS):
            rid = f"r{i}-{j}"
            engine.add_request(rid, engine.tokenizer.encode(prompt), _json_params(schema, temperature, seed=i * 7 + j))
            expected[rid] = schema
    texts, reasons = _run(engine)
    for rid, schema in expected.items():
        assert reasons[rid] == "stop", (rid, texts[rid])
        jsonschema.validate(json.loads(texts[rid]), schema)


def test_constrained_rows_leave_the_others_alone(llm):
    """A free request's tokens are the same alone and beside constrained ones (the mask touches
    only its own rows)."""
    free = SamplingParams(max_tokens=24, temperature=1.0, seed=5)
    alone = llm.generate(["Once upon a time"], free)[0].token_ids
    engine = llm.engine
    engine.add_request("free", engine.tokenizer.encode("Once upon a time"), free)
    for j, schema in enumerate(SCHEMAS):
        engine.add_request(f"c{j}", engine.tokenizer.encode("Once upon a time"), _json_params(schema, 1.0, j))
    texts, reasons = _run(engine, ids=True)
    assert texts["free"] == alone
    assert all(reasons[f"c{j}"] == "stop" for j in range(len(SCHEMAS)))


def test_json_object_and_a_forced_tool_call(llm):
    """json_object: an object (biased to close at once, since a random model's free JSON may
    not end); tool_call: the Hermes tags around an object of the call schema."""
    close = llm.engine.tokenizer.encode("}")[0]
    obj = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput("json_object", ""),
                         logit_bias={close: 50.0})
    out = llm.generate(["Give JSON:"], obj)[0]
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text
    call_schema = {"anyOf": [{"type": "object", "properties": {"name": {"const": "get_weather"},
                                                               "arguments": SCHEMAS[0]},
                              "required": ["name", "arguments"], "additionalProperties": False}]}
    call = SamplingParams(max_tokens=120, temperature=0.8, seed=3,
                          structured=StructuredOutput("tool_call", json.dumps(call_schema), "tool_choice"))
    text = llm.generate(["Call a tool"], call)[0].text
    assert text.startswith(TOOL_CALL_PREFIX) and text.endswith(TOOL_CALL_SUFFIX), text
    body = json.loads(text[len(TOOL_CALL_PREFIX):-len(TOOL_CALL_SUFFIX)])
    jsonschema.validate(body, call_schema)


def test_a_finished_grammar_ends_the_request_under_ignore_eos(llm):
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True,
                            structured=StructuredOutput("json_schema", json.dumps(SCHEMAS[0])))
    out = llm.generate(["Trip"], params)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 150
    jsonschema.validate(json.loads(out.text), SCHEMAS[0])


def test_an_invalid_schema_is_refused_before_the_engine():
    with pytest.raises(DuokaError, match="cannot be compiled"):
        check_spec(StructuredOutput("json_schema", '{"type": "object", "properties": {"a": {"type": "nope"}}}'))
    with pytest.raises(DuokaError, match="cannot be compiled"):
        check_spec(StructuredOutput("ebnf", "root ::= ("))


def test_a_sibling_choice_reuses_the_prompt_blocks(llm):
    """The second choice waits for the first one's prompt and finds its full blocks cached."""
    engine = llm.engine
    prompt = engine.tokenizer.encode("a shared prompt that spans a few blocks of the cache " * 3)
    assert len(prompt) > 2 * engine.shape.block_size
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    engine.add_request("first", prompt, params)
    engine.add_request("second", prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=2), after="first")
    cached = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    full_blocks = (len(prompt) - 1) // engine.shape.block_size * engine.shape.block_size
    assert cached == {"first": 0, "second": full_blocks}


def _run(engine, ids: bool = False):
    texts, reasons = {}, {}
    while engine.has_unfinished():
        for out in engine.step():
            if ids:
                texts.setdefault(out.request_id, []).extend(out.new_token_ids)
            else:
                texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    return texts, reasons
