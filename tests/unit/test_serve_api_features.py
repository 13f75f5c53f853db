"""The OpenAI features of issue 38 through the HTTP layer with a fake engine (in process, no
model), read back by the official `openai` client, streamed and not: n choices, tool calls
parsed out of the model's Hermes text, malformed calls as content, what reaches the engine
(structured output, adapters, the new sampling fields), /v1/models with adapters, and the
generated table of OpenAI parameters. The real model's side is tests/unit/test_serve_structured.py
and tests/integration/test_serve_openai_features.py."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient
from test_serve_api_unit import MAX_MODEL_LEN, MODEL, FakeEngine, chat_body

from duoka.data.tokenizer import load_tokenizer
from duoka.serve.api import build_app
from duoka.serve.async_engine import AsyncEngine
from duoka.serve.openai_parameters import PARAMETERS, REFUSED, reference_markdown
from duoka.serve.protocol import ChatRequest, CompletionRequest
from duoka.serve.server_metrics import ServeMetrics

ROOT = Path(__file__).resolve().parents[2]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ADAPTERS = (("alpha", "/models/alpha"), ("beta", "/models/beta"))


class Served:
    def __init__(self, tokenizer):
        self.engine = FakeEngine(tokenizer)
        # Qwen2.5's system prompt with tools is long in a 600-token vocabulary: a longer context.
        self.engine.max_model_len = MAX_MODEL_LEN * 16
        self.async_engine = AsyncEngine(self.engine, 64, ServeMetrics(MODEL), log=lambda m: None)
        app = build_app(self.async_engine, tokenizer, MODEL, self.engine.max_model_len, {}, adapters=ADAPTERS)
        self.http = TestClient(app)
        self.client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=self.http,
                                    max_retries=0)

    def close(self):
        self.http.close()
        self.async_engine.close()


@pytest.fixture(scope="module")
def s(qwen25_tokenizer_dir):
    served = Served(load_tokenizer(qwen25_tokenizer_dir))  # Qwen2.5's template: tools in the Hermes format
    yield served
    served.close()


@pytest.fixture(autouse=True)
def fresh(s):
    s.engine.scripted = None
    s.engine.added.clear()


def _assemble(stream) -> tuple[dict[int, str], dict[int, dict[int, dict]], dict[int, str]]:
    """Per choice: the content, the tool calls (index -> id, name, arguments), the finish reason."""
    content, calls, finish = {}, {}, {}
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content[choice.index] = content.get(choice.index, "") + (delta.content or "")
            for call in delta.tool_calls or []:
                slot = calls.setdefault(choice.index, {}).setdefault(call.index, {"arguments": ""})
                if call.id:
                    slot["id"], slot["name"] = call.id, call.function.name
                slot["arguments"] += call.function.arguments or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    return content, calls, finish


@pytest.mark.parametrize("before", ["", "Let me look that up.\n"])
def test_a_hermes_tool_call_comes_back_as_tool_calls(s, before):
    s.engine.scripted = before + CALL
    body = s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
                                            tools=TOOLS, max_tokens=200)
    choice = body.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or "") == before.strip()
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    content, calls, finish = _assemble(s.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS, max_tokens=200, stream=True))
    assert finish == {0: "tool_calls"} and content[0].strip() == before.strip()
    assert json.loads(calls[0][0]["arguments"]) == {"city": "Paris"} and calls[0][0]["name"] == "get_weather"


@pytest.mark.parametrize("text", ['<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
                                  '<tool_call>\n{"name": "get_weather", "arguments": nonsense}\n</tool_call>',
                                  '<tool_ca'])
def test_malformed_model_output_is_plain_content(s, text):
    s.engine.scripted = text
    body = s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                            max_tokens=200)
    assert body.choices[0].message.content == text and not body.choices[0].message.tool_calls
    assert body.choices[0].finish_reason == "stop"
    content, calls, finish = _assemble(s.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS, max_tokens=200, stream=True))
    assert content[0] == text and finish == {0: "stop"}


def test_tool_choice_none_leaves_tool_text_alone(s):
    s.engine.scripted = CALL
    body = s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                            tool_choice="none", max_tokens=200)
    assert body.choices[0].message.content == CALL and body.choices[0].finish_reason == "stop"


def test_a_tool_result_renders_through_the_template(s):
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    body = s.client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=4)
    assert body.choices[0].finish_reason == "length"
    prompt = s.engine.tokenizer.decode(s.engine.prompts[-1])
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt, prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt, prompt
    assert '"name": "get_weather"' in prompt.split("<|im_end|>")[0]  # the tools, in the system prompt


def test_forced_tool_calls_and_response_formats_reach_the_engine_as_grammars(s):
    s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                     tool_choice="required", max_tokens=4)
    s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=4)
    s.client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                     response_format={"type": "json_object"})
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    s.client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body={
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    kinds = [params.structured.kind for _, params in s.engine.added]
    assert kinds == ["tool_call", "tool_call", "json_object", "json_schema"]
    assert json.loads(s.engine.added[3][1].structured.spec) == schema
    forced = json.loads(s.engine.added[1][1].structured.spec)
    assert "get_weather" in json.dumps(forced)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_with_seeds_and_summed_usage(s, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=3, seed=7,
                  temperature=0.9)
    if stream:
        chunks = list(s.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        content, _, finish = _assemble(chunks)
        usage = chunks[-1].usage
        assert sorted(content) == [0, 1, 2] and finish == {0: "length", 1: "length", 2: "length"}
    else:
        body = s.client.chat.completions.create(**kwargs)
        assert [c.index for c in body.choices] == [0, 1, 2]
        usage = body.usage
    seeds = [params.seed for _, params in s.engine.added]
    assert seeds == [7, 8, 9]
    assert usage.completion_tokens == 15 and usage.prompt_tokens == usage.total_tokens - 15


def test_new_sampling_fields_reach_the_engine(s):
    s.client.completions.create(model=MODEL, prompt="hi", max_tokens=4, logit_bias={"17": -100, "18": 5},
                                extra_body={"min_p": 0.1, "repetition_penalty": 1.2, "min_tokens": 2})
    params = s.engine.added[-1][1]
    assert dict(params.logit_bias) == {17: -100.0, 18: 5.0}
    assert (params.min_p, params.repetition_penalty, params.min_tokens) == (0.1, 1.2, 2)


def test_adapters_are_models(s):
    listed = s.client.models.list().data
    assert [(m.id, getattr(m, "parent", None)) for m in listed] == [(MODEL, None), ("alpha", MODEL), ("beta", MODEL)]
    s.client.completions.create(model="beta", prompt="hi", max_tokens=2)
    assert s.engine.loras[-1] == "beta"
    s.client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert s.engine.loras[-1] is None
    assert s.client.models.retrieve("beta").parent == MODEL
    with pytest.raises(openai.NotFoundError) as e:  # OpenAI's answer for a model it does not have
        s.client.completions.create(model="gamma", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    assert "alpha" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        s.client.models.retrieve("gamma")


def test_every_parameter_is_listed_and_the_docs_hold_the_table():
    listed = {p.name for p in PARAMETERS}
    fields = set(ChatRequest.model_fields) | set(CompletionRequest.model_fields)
    assert fields - listed == set() and listed - fields == set()
    assert reference_markdown() in (ROOT / "docs" / "serving.md").read_text(), \
        "run: python -m duoka.serve.openai_parameters --update docs/serving.md"


@pytest.mark.parametrize("param", [p for p in PARAMETERS if p.status == REFUSED], ids=lambda p: p.name)
def test_refused_parameters_get_a_400_naming_them(s, param):
    values = {"best_of": 3, "suffix": "x", "use_beam_search": True}
    path, body = ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}) if "chat" not in \
        param.endpoints else ("/v1/chat/completions", chat_body())
    r = s.http.post(path, json={**body, param.name: values[param.name]})
    assert r.status_code == 400 and r.json()["error"]["param"] == param.name, r.text
