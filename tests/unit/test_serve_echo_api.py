"""Issue 48's API shapes against a fake engine (in process, no model): what reaches the engine
for a list of prompts with n (one request per choice, in order, prompt logprobs asked by each
prompt's choice 0 only, the others told to follow it), echo read back by the official `openai`
client with max_tokens 0, tokens named by id, and vLLM's prompt_logprobs. The values against
the real model are tests/unit/test_serve_prompt_logprobs.py."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi.testclient import TestClient
from test_serve_api_unit import MODEL, FakeEngine

from duoka.data.tokenizer import load_tokenizer
from duoka.hub import bundled_model_dir
from duoka.serve.api import build_app
from duoka.serve.async_engine import AsyncEngine
from duoka.serve.server_metrics import ServeMetrics


class RecordingEngine(FakeEngine):
    """FakeEngine that also keeps each request's `after`."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.afters: list[str | None] = []

    def add_request(self, request_id, prompt_ids, params, lora=None, after=None):
        self.afters.append(after)
        super().add_request(request_id, prompt_ids, params, lora=lora, after=after)


@pytest.fixture(scope="module")
def s():
    tokenizer = load_tokenizer(bundled_model_dir())
    engine = RecordingEngine(tokenizer)
    async_engine = AsyncEngine(engine, 64, ServeMetrics(MODEL), log=lambda m: None)
    http = TestClient(build_app(async_engine, tokenizer, MODEL, engine.max_model_len, {}))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)
    yield engine, http, client
    http.close()
    async_engine.close()


def test_a_prompt_list_with_n_is_one_engine_request_per_choice(s):
    engine, http, _ = s
    engine.added.clear()
    engine.afters.clear()
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    r = http.post("/v1/completions", json={"prompt": prompts, "n": 2, "max_tokens": 3, "echo": True, "logprobs": 1,
                                           "seed": 7, "temperature": 0.5})
    body = r.json()
    assert r.status_code == 200, body
    ids = [rid for rid, _ in engine.added]
    assert [rid.rsplit("-", 1)[1] for rid in ids] == [str(i) for i in range(6)]
    assert engine.afters == [None, ids[0], None, ids[2], None, ids[4]]  # each prompt's choice 1 follows its 0
    assert engine.prompts == [p for p in prompts for _ in range(2)]
    assert [params.prompt_logprobs for _, params in engine.added] == [1, None] * 3
    assert [params.seed for _, params in engine.added] == [7, 8] * 3
    assert [c["index"] for c in body["choices"]] == list(range(6))
    for i, choice in enumerate(body["choices"]):
        ids_i = prompts[i // 2]
        lp = choice["logprobs"]
        assert lp["token_logprobs"][:len(ids_i)] == [None, *[-p / 100 for p in range(1, len(ids_i))]]
        assert len(lp["tokens"]) == len(ids_i) + 3
    usage = body["usage"]
    assert usage["prompt_tokens"] == 9 and usage["completion_tokens"] == 18


def test_the_openai_client_scores_a_prompt_with_max_tokens_0(s):
    _, _, client = s
    out = client.completions.create(model=MODEL, prompt=["hello world", "def f(x):"], echo=True, logprobs=1,
                                    max_tokens=0)
    assert [c.text for c in out.choices] == ["hello world", "def f(x):"]
    assert out.usage.completion_tokens == 0 and all(c.finish_reason == "length" for c in out.choices)
    lp = out.choices[0].logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == "hello world" and lp.text_offset[0] == 0
    assert all(len(top) >= 1 for top in lp.top_logprobs[1:])


def test_tokens_named_by_id_and_vllm_prompt_logprobs(s):
    engine, http, _ = s
    body = http.post("/v1/completions", json={"prompt": [20, 21, 22], "max_tokens": 1, "echo": True, "logprobs": 2,
                                              "prompt_logprobs": 2, "return_tokens_as_token_ids": True}).json()
    choice = body["choices"][0]
    assert choice["logprobs"]["tokens"][:3] == ["token_id:20", "token_id:21", "token_id:22"]
    assert set(choice["logprobs"]["top_logprobs"][1]) == {"token_id:21", "token_id:22"}
    assert choice["prompt_logprobs"][0] is None
    assert choice["prompt_logprobs"][1] == {"21": {"logprob": -0.01, "rank": 1, "decoded_token": "token_id:21"},
                                            "22": {"logprob": -1.01, "rank": 2, "decoded_token": "token_id:22"}}
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                                   "logprobs": True, "top_logprobs": 1, "prompt_logprobs": 0,
                                                   "return_tokens_as_token_ids": True}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]
    assert all(len(step) == 1 for step in chat["prompt_logprobs"][1:])  # k = 0: the prompt's own token only
    assert chat["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")


def test_a_streamed_echo_starts_with_the_prompt(s):
    _, http, _ = s
    with http.stream("POST", "/v1/completions", json={"prompt": ["abc", "xyz"], "max_tokens": 2, "echo": True,
                                                        "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    firsts = {}
    for event in events:
        for choice in event["choices"]:
            firsts.setdefault(choice["index"], choice["text"])
    assert firsts[0].startswith("abc") and firsts[1].startswith("xyz")
