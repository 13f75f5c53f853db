"""Issue 38 end to end: `duoka serve` on the bundled tiny model with Qwen2.5's chat template and
two --lora adapters, in a subprocess, driven by the official `openai` client, streamed and
not: a forced tool call parsed into tool_calls whose arguments validate, JSON-schema output
that validates, n choices with seeds, /v1/models with the adapters, an adapter's output equal
to that adapter merged and generated alone, CORS and x-request-id. One server for the module."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import jsonschema
import openai
import pytest

from duoka.host.ports import free_port
from duoka.hub import bundled_model_dir
from duoka.models.qwen2.hf_adapter import read_config

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
START_TIMEOUT_S = 90
ORIGIN = "https://app.example"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "book", "description": "Book a trip", "parameters": SCHEMA}},
         {"type": "function", "function": {"name": "cancel", "parameters": {
             "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, write_adapter):
    root = tmp_path_factory.mktemp("openai")
    folder = root / "model"
    shutil.copytree(bundled_model_dir(), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # Qwen2.5's template (tools) instead
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = (ROOT / "tests" / "fixtures" / "qwen2_5_chat_template.jinja").read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    args = read_config(folder)
    adapters = {"alpha": write_adapter(root / "alpha", args, 4, 8.0, ("q_proj", "v_proj", "down_proj"), seed=1),
                "beta": write_adapter(root / "beta", args, 8, 8.0, ("o_proj", "gate_proj"), seed=2)}
    port = free_port()
    log = root / "server.log"
    cmd = [sys.executable, "-m", "duoka.cli", "serve", str(folder), "--device", "cpu", "--port", str(port),
           "--max-model-len", "512", "--served-model-name", MODEL, "--allowed-origins", ORIGIN,
           *[x for name, path in adapters.items() for x in ("--lora", f"{name}={path}")]]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + START_TIMEOUT_S
    while "serving " not in log.read_text():
        assert proc.poll() is None, f"the server exited:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"not ready in {START_TIMEOUT_S} s:\n{log.read_text()}"
        time.sleep(0.1)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=60)
    yield client, folder, adapters, f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)


def user(text):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_a_forced_tool_call_comes_back_parsed_and_valid(served, choice):
    client = served[0]
    body = client.chat.completions.create(model=MODEL, messages=user("Book me a trip"), tools=TOOLS,
                                          tool_choice=choice, max_tokens=120, temperature=0.8, seed=4)
    [call] = body.choices[0].message.tool_calls
    assert body.choices[0].finish_reason == "tool_calls" and call.id.startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(choice, dict):
        assert call.function.name == "book"
    parts, name = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=user("Book me a trip"), tools=TOOLS,
                                                tool_choice=choice, max_tokens=120, temperature=0.8, seed=4,
                                                stream=True):
        for delta in chunk.choices[0].delta.tool_calls or []:
            name = name or delta.function.name
            parts.append(delta.function.arguments or "")
    assert name == call.function.name and json.loads("".join(parts)) == json.loads(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates(served, stream):
    client = served[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, messages=user("Plan"), response_format=fmt,
                                               max_tokens=80, temperature=1.0, seed=seed, stream=stream)
        text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream else \
            reply.choices[0].message.content
        jsonschema.validate(json.loads(text), SCHEMA)


def test_n_choices_with_a_seed_repeat(served):
    client = served[0]
    ask = dict(model=MODEL, prompt="Once upon a time", max_tokens=12, n=3, seed=11, temperature=1.0)
    first, again = client.completions.create(**ask), client.completions.create(**ask)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1 and first.usage.completion_tokens == 36


def test_adapters_are_listed_and_each_equals_itself_merged(served):
    client, folder, adapters, _ = served
    listed = {m.id: m for m in client.models.list().data}
    assert set(listed) == {MODEL, "alpha", "beta"} and listed["beta"].parent == MODEL
    from duoka.serve.engine import LLM
    from duoka.serve.params import SamplingParams

    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    texts = {}
    for name in ("alpha", "beta", MODEL):
        texts[name] = client.completions.create(model=name, prompt="The river", max_tokens=10, temperature=0,
                                                extra_body={"ignore_eos": True}).choices[0].text
    for name, path in adapters.items():
        merged = LLM(str(folder), adapter=str(path), device="cpu", max_model_len=512, log=lambda m: None)
        assert merged.generate(["The river"], params)[0].text == texts[name]
    assert len(set(texts.values())) == 3  # each adapter changes the output


def test_cors_and_request_id(served):
    url = served[3]
    r = httpx.options(url + "/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"Origin": ORIGIN, "x-request-id": "trace-42"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "trace-42"
    assert r.headers["access-control-allow-origin"] == ORIGIN
