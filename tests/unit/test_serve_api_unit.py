"""The HTTP layer and the engine thread against a fake engine (in process, no model): OpenAI's
formats, every 4xx, 401, 503 + Retry-After, drain, engine failures, metrics. The real
server end to end is tests/integration/test_serve_api.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import openai
import pytest
from fastapi.testclient import TestClient

from duoka.data.tokenizer import load_tokenizer
from duoka.errors import DuokaError
from duoka.hub import bundled_model_dir
from duoka.serve.api import build_app
from duoka.serve.api_responses import Responder
from duoka.serve.async_engine import AsyncEngine, Draining, EngineError, QueueFull
from duoka.serve.engine import EngineStats, RequestLimits
from duoka.serve.params import RequestOutput, SamplingParams, TokenLogprob
from duoka.serve.server_metrics import ServeMetrics

MODEL = "fake-qwen2"
MAX_MODEL_LEN = 256


@dataclass(frozen=True)
class Stats(EngineStats):
    """The engine's stats, preemptions 0 unless given."""
    num_preemptions: int = 0


class FakeEngine:
    """The contract's LLMEngine surface. Each step every running request gets one token:
    token k of a request is 10 + (sum(prompt) + k) % 50, its text the tokenizer's decode; stop
    strings cut the text as the real detokenizer does (simplified: no hold-back). Prompt
    logprobs (on the first output): prompt token p has logprob -p / 100, its alternatives
    token + 1, + 2, ... A request of max_tokens 0 ends at its first step without a token."""

    def __init__(self, tokenizer, max_running: int = 64, step_s: float = 0.0):
        self.model_name = MODEL
        self.tokenizer = tokenizer
        self.max_model_len = MAX_MODEL_LEN
        self.limits = RequestLimits(tokenizer.vocab_size, MAX_MODEL_LEN, 16, 16)
        self.default_params = {"temperature": 0.7}
        self.max_running = max_running
        self.step_s = step_s
        self.fail_steps = 0  # the next this-many steps raise
        self.requests: dict[str, dict] = {}
        self.order: list[str] = []
        self.aborted: list[RequestOutput] = []
        self.abort_calls: list[str] = []
        self.added: list[tuple[str, SamplingParams]] = []
        self.prompts: list[list[int]] = []
        self.loras: list[str | None] = []
        self.thread_ids: set[int] = set()
        self.steps = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.scripted: str | None = None  # when set, every request's output is this text's tokens, then "stop"

    def _touch(self):
        self.thread_ids.add(threading.get_ident())

    def add_request(self, request_id, prompt_ids, params, lora=None, after=None):
        self._touch()
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise DuokaError("too long for the fake cache", "ask for less")
        self.requests[request_id] = {"prompt": list(prompt_ids), "params": params, "out": [], "text": ""}
        self.order.append(request_id)
        self.added.append((request_id, params))
        self.prompts.append(list(prompt_ids))
        self.loras.append(lora)

    def abort(self, request_id):
        self._touch()
        self.abort_calls.append(request_id)
        r = self.requests.pop(request_id, None)
        if r is not None:
            self.order.remove(request_id)
            self.aborted.append(RequestOutput(request_id, [], "", None, True, "abort", len(r["prompt"]),
                                              len(r["out"]), 0))

    def has_unfinished(self):
        return bool(self.requests) or bool(self.aborted)

    def running(self):
        return self.order[:self.max_running]

    def step(self):
        self._touch()
        self.steps += 1
        if self.step_s:
            time.sleep(self.step_s)
        if self.fail_steps:
            self.fail_steps -= 1
            raise RuntimeError("boom (fake step failure)")
        outputs, self.aborted = self.aborted, []
        for rid in list(self.running()):
            r = self.requests[rid]
            params = r["params"]
            k = len(r["out"])
            prompt_lps = self.prompt_logprobs(r["prompt"], params.prompt_logprobs) if k == 0 else None
            if k == 0:
                self.prompt_tokens += len(r["prompt"])
            if params.max_tokens == 0:
                outputs.append(RequestOutput(rid, [], "", None, True, "length", len(r["prompt"]), 0, 0, prompt_lps))
                del self.requests[rid]
                self.order.remove(rid)
                continue
            script = self.tokenizer.encode(self.scripted, add_special_tokens=False) if self.scripted else None
            tok = script[k] if script else 10 + (sum(r["prompt"]) + k) % 50
            r["out"].append(tok)
            self.generation_tokens += 1
            piece = self.tokenizer.decode([tok])
            text = r["text"] + piece
            reason = None
            new_text = piece
            for s in params.stop:
                if s in text:
                    cut = text.index(s)
                    new_text = text[len(r["text"]):cut] if cut > len(r["text"]) else ""
                    reason = "stop"
                    break
            r["text"] = text
            if reason is None and script and len(r["out"]) == len(script):
                reason = "stop"
            if reason is None and len(r["out"]) >= params.max_tokens:
                reason = "length"
            lp = None
            if params.logprobs is not None:
                lp = [TokenLogprob(tok, -0.5, [(tok, -0.5), (tok + 1, -1.5), (tok + 2, float("-inf"))][:params.logprobs])]
            outputs.append(RequestOutput(rid, [tok], new_text, lp, reason is not None, reason, len(r["prompt"]),
                                         len(r["out"]), 0, prompt_lps))
            if reason is not None:
                del self.requests[rid]
                self.order.remove(rid)
        return outputs

    @staticmethod
    def prompt_logprobs(prompt, k):
        if k is None:
            return None
        return [None] + [TokenLogprob(t, -p / 100, [(t + j, -p / 100 - j) for j in range(k)], 1)
                         for p, t in enumerate(prompt) if p]

    def stats(self):
        running = len(self.running())
        used = sum(1 for _ in self.requests)
        return Stats(running, len(self.requests) - running, used / 16, 16, 16, 0, 0, self.prompt_tokens,
                     self.generation_tokens)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_model_dir())


class Served:
    def __init__(self, engine, max_queue=64, api_key=None):
        self.engine = engine
        self.async_engine = AsyncEngine(engine, max_queue, ServeMetrics(MODEL), log=self.log)
        self.logs: list[str] = []
        self.app = build_app(self.async_engine, engine.tokenizer, MODEL, MAX_MODEL_LEN, engine.default_params,
                             api_key=api_key)
        self.client = TestClient(self.app)

    def log(self, message):
        self.logs.append(message)

    def close(self):
        self.client.close()
        self.async_engine.close()


@pytest.fixture
def served(tokenizer):
    made = []

    def make(**kwargs):
        engine_kwargs = {k: kwargs.pop(k) for k in ("max_running", "step_s") if k in kwargs}
        s = Served(FakeEngine(tokenizer, **engine_kwargs), **kwargs)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def chat_body(**extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
            "temperature": 0, **extra}


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ---------------------------------------------------------------- formats
def test_chat_completion_format_and_exact_usage(served, tokenizer):
    s = served()
    r = s.client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion" and body["model"] == MODEL
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["message"]["role"] == "assistant" and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and choice["message"]["content"]
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hello there"}], add_generation_prompt=True)
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)
    assert body["usage"]["completion_tokens"] == 6
    assert body["usage"]["total_tokens"] == len(prompt_ids) + 6
    rid, params = s.engine.added[-1]
    assert rid == body["id"] and params.max_tokens == 6 and params.temperature == 0


def test_chat_stream_equals_non_stream_and_chunk_order(served):
    s = served()
    plain = s.client.post("/v1/chat/completions", json=chat_body()).json()
    with s.client.stream("POST", "/v1/chat/completions",
                         json=chat_body(stream=True, stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == plain["usage"]
    content_chunks = chunks[1:-1]
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI: null everywhere but the last
    assert [c["choices"][0]["finish_reason"] for c in content_chunks] == [None] * (len(content_chunks) - 1) + ["length"]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in content_chunks)
    assert text == plain["choices"][0]["message"]["content"]

    with s.client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
        events = sse_events(r)
    assert "usage" not in events[0] and events[-2]["choices"][0]["finish_reason"] == "length"


def test_openai_client_reads_every_format(served):
    s = served()
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=s.client)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                 {"role": "user", "content": [{"type": "text",
                                                                                               "text": "Hi"}]}],
                                          max_tokens=5, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                                   {"role": "user", "content": "Hi"}],
                                            max_tokens=5, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens == 5
    completion = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, temperature=0)
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    streamed = list(client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, temperature=0,
                                              stream=True))
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "length"
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_prompt_forms(served, tokenizer):
    s = served()
    ids = tokenizer.encode("hello world")
    texts = []
    for prompt in ("hello world", ["hello world"], ids, [ids]):
        r = s.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        texts.append(r.json()["choices"][0]["text"])
    assert len(set(texts)) == 1
    assert [p.temperature for _, p in s.engine.added] == [0.7] * 4  # generation_config's default


def test_stop_strings_and_stop_token_ids_pass_through(served):
    s = served()
    plain = s.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8, "temperature": 0}).json()
    text = plain["choices"][0]["text"]
    stop = text[3]  # one character: the fake detokenizer holds nothing back
    r = s.client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 8, "temperature": 0, "stop": stop,
                                               "stop_token_ids": [5], "seed": 3, "top_k": -1, "ignore_eos": True})
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["choices"][0]["text"] == text[:text.index(stop)]
    _, params = s.engine.added[-1]
    assert params.stop == (stop,) and params.stop_token_ids == (5,) and params.seed == 3 and params.ignore_eos


def test_logprobs_formats(served):
    s = served()
    body = s.client.post("/v1/chat/completions", json=chat_body(logprobs=True, top_logprobs=2, max_tokens=2)).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert [t["logprob"] for t in content[0]["top_logprobs"]] == [-0.5, -1.5]
    assert s.engine.added[-1][1].logprobs == 2
    body = s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "logprobs": 3}).json()
    lp = body["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert lp["token_logprobs"] == [-0.5, -0.5] and lp["text_offset"][0] == 0
    assert -9999.0 in lp["top_logprobs"][0].values()  # -inf is not JSON


def test_max_tokens_defaults_to_the_rest_of_the_context(served, tokenizer):
    s = served()
    r = s.client.post("/v1/completions", json={"prompt": [1, 2, 3], "temperature": 0})
    assert r.status_code == 200
    assert s.engine.added[-1][1].max_tokens == MAX_MODEL_LEN - 3
    s.client.post("/v1/chat/completions", json=chat_body(max_tokens=50, max_completion_tokens=7))
    assert s.engine.added[-1][1].max_tokens == 7  # the newer name wins, as OpenAI says


def test_models_health_metrics(served, tokenizer):
    s = served()
    models = s.client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert models["data"][0]["vocab_size"] == tokenizer.vocab_size  # what duoka bench serve draws prompt ids from
    assert s.client.get("/health").status_code == 200
    s.client.post("/v1/chat/completions", json=chat_body())
    text = s.client.get("/metrics").text
    for name in ("duoka_serve_time_to_first_token_seconds_bucket", "duoka_serve_inter_token_latency_seconds_bucket",
                 "duoka_serve_e2e_request_latency_seconds_count", "duoka_serve_num_requests_running",
                 "duoka_serve_num_requests_waiting", "duoka_serve_kv_cache_usage_perc",
                 "duoka_serve_prefix_cache_queries_total", "duoka_serve_prefix_cache_hits_total",
                 "duoka_serve_prompt_tokens_total", "duoka_serve_generation_tokens_total",
                 "duoka_serve_num_preemptions_total"):
        assert name in text, name
    assert f'duoka_serve_request_success_total{{finished_reason="length",model_name="{MODEL}"}} 1.0' in text
    assert f'duoka_serve_generation_tokens_total{{model_name="{MODEL}"}} 6.0' in text


# ---------------------------------------------------------------- bad requests
BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content.0"),
    ({"messages": [{"role": "user"}]}, "messages.0.content"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "5"}, "max_tokens"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"n": 17}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"stop": ["a", 3]}, "stop"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
]


@pytest.mark.parametrize("change, param", BAD_CHAT, ids=[p for _, p in BAD_CHAT])
def test_bad_chat_requests_get_400(served, change, param):
    s = served()
    r = s.client.post("/v1/chat/completions", json={**chat_body(), **change})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] is not None and error["param"].startswith(param.split(".")[0]), error
    assert not s.engine.added  # nothing reached the engine


def test_an_unknown_model_is_a_404_model_not_found_as_openai_answers(served):
    s = served()
    one = s.client.get(f"/v1/models/{MODEL}")
    assert one.status_code == 200 and one.json() == s.client.get("/v1/models").json()["data"][0]
    for r in (s.client.get("/v1/models/gpt-4"), s.client.get("/v1/models/org/gpt-4"),
              s.client.post("/v1/chat/completions", json={**chat_body(), "model": "gpt-4"}),
              s.client.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})):
        error = r.json()["error"]
        assert r.status_code == 404, r.text
        assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
        assert "'gpt-4'" in error["message"] or "'org/gpt-4'" in error["message"]
        assert repr(MODEL) in error["message"]  # what to name instead
    assert not s.engine.added


def test_context_length_message_names_both_numbers_and_the_fix(served):
    s = served()
    r = s.client.post("/v1/completions", json={"prompt": [1] * 200, "max_tokens": 100})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "256" in error["message"] and "200" in error["message"] and "100" in error["message"]
    assert "lower max_tokens to 56" in error["message"]
    r = s.client.post("/v1/completions", json={"prompt": [1] * 300})
    assert r.status_code == 400 and "300" in r.json()["error"]["message"]


def test_nan_temperature_and_malformed_json(served):
    s = served()
    raw = '{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'
    r = s.client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = s.client.post("/v1/chat/completions", content='{"messages": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = s.client.post("/v1/chat/completions", content="messages=hi",
                      headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = s.client.post("/v1/completions", json=[1, 2])
    assert r.status_code == 400


def test_completion_refusals(served):
    s = served()
    for body, param in [({"prompt": ["a", ""]}, "prompt.1"), ({"prompt": ""}, "prompt"), ({"prompt": [-1]}, "prompt"),
                        ({"prompt": [[1], [2, -1]]}, "prompt.1"), ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({"prompt": "x", "best_of": 2}, "best_of"),
                        ({"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
                        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"prompt": "x", "logprobs": 21}, "logprobs"), ({"prompt": 5}, "prompt")]:
        r = s.client.post("/v1/completions", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"].startswith(param), (body, r.json())


def test_engine_refusal_is_a_400(served):
    s = served()
    s.engine.max_model_len = 8  # the fake engine refuses what the API lets through
    r = s.client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 10})
    assert r.status_code == 400 and "fix: ask for less" in r.json()["error"]["message"]
    assert s.client.get("/health").status_code == 200


def test_unknown_route_and_method(served):
    s = served()
    r = s.client.post("/v1/embeddings", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = s.client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_api_key(served):
    s = served(api_key="sekrit")
    assert s.client.post("/v1/chat/completions", json=chat_body()).status_code == 401
    r = s.client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert s.client.post("/v1/chat/completions", content="{", headers={"Authorization": "Bearer nope"}).status_code == 401
    assert s.client.get("/health").status_code == 200 and s.client.get("/metrics").status_code == 200
    ok = s.client.post("/v1/chat/completions", json=chat_body(), headers={"Authorization": "Bearer sekrit"})
    assert ok.status_code == 200
    for scheme in ("bearer", "BEARER"):  # the scheme's case does not matter (RFC 9110); the key's does
        assert s.client.post("/v1/chat/completions", json=chat_body(),
                             headers={"Authorization": f"{scheme} sekrit"}).status_code == 200
    assert s.client.post("/v1/chat/completions", json=chat_body(),
                         headers={"Authorization": "Bearer SEKRIT"}).status_code == 401
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=s.client)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_a_server_open_beyond_this_machine_without_a_key_is_warned_about():
    """--host 0.0.0.0 without --api-key: anyone who reaches the port can use the model."""
    from duoka.host.ports import free_port
    from duoka.serve.server import serve

    def stop():  # the engine is built after the checks and the warning
        raise DuokaError("stop here")

    for host, key, warned in [("0.0.0.0", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)]:
        logs = []
        with pytest.raises(DuokaError, match="stop here"):
            serve(stop, host=host, port=free_port(), api_key=key, log=logs.append)
        assert any("no --api-key" in line and "--api-key KEY" in line for line in logs) == warned, (host, key, logs)


# ---------------------------------------------------------------- queue, drain, failures
def test_full_queue_gets_503_with_retry_after(served):
    s = served(max_running=0, max_queue=2)  # nothing ever runs: every request waits

    async def scenario():
        ae = s.async_engine
        streams = [await ae.generate(f"r{i}", [1, 2], SamplingParams(max_tokens=2)) for i in range(2)]
        with pytest.raises(QueueFull):
            await ae.generate("r3", [1, 2], SamplingParams(max_tokens=2))
        r = await asyncio.to_thread(s.client.post, "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        for st in streams:
            st.abort()
        return r

    r = asyncio.run(scenario())
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "queue_full"


def test_cancelled_stream_aborts_in_the_engine_thread(served):
    s = served(max_running=0)  # the request waits forever: only the cancel can end it

    async def scenario():
        ae = s.async_engine
        stream = await ae.generate("waits", [1, 2, 3], SamplingParams(max_tokens=200))
        task = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        assert ae.in_flight == 1
        task.cancel()
        for _ in range(500):
            if ae.in_flight == 0:
                break
            await asyncio.sleep(0.01)
        return ae.in_flight

    assert asyncio.run(scenario()) == 0
    assert s.engine.abort_calls == ["waits"] and not s.engine.requests
    assert s.engine.thread_ids == {s.async_engine._thread.ident}  # the engine is only ever touched by its thread
    assert 'finished_reason="abort"' in s.client.get("/metrics").text


def test_drain_finishes_in_flight_refuses_new_and_cuts_off_after_grace(served):
    s = served(step_s=0.01)

    async def scenario():
        ae = s.async_engine
        short = await ae.generate("short", [1], SamplingParams(max_tokens=3))
        long = await ae.generate("long", [2], SamplingParams(max_tokens=100))
        drain = asyncio.ensure_future(ae.drain(grace_s=0.3))
        await asyncio.sleep(0.01)
        with pytest.raises(Draining):
            await ae.generate("late", [1], SamplingParams(max_tokens=2))
        short_outs = [o async for o in short]
        long_outs, error = [], None
        try:
            async for o in long:
                long_outs.append(o)
        except Draining as e:
            error = e
        await drain
        return short_outs, long_outs, error

    short_outs, long_outs, error = asyncio.run(scenario())
    assert short_outs[-1].finish_reason == "length" and len(short_outs) == 3
    assert error is not None and "grace" in str(error) and 0 < len(long_outs) < 100
    assert "long" in s.engine.abort_calls
    r = s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "server_shutting_down"
    assert s.client.get("/health").status_code == 503


def test_a_failed_step_fails_its_requests_and_the_engine_serves_on(served):
    s = served()
    s.engine.fail_steps = 1
    r = s.client.post("/v1/chat/completions", json=chat_body())
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
    assert "engine error" in r.json()["error"]["message"]
    assert any("boom (fake step failure)" in line and "Traceback" in line for line in s.logs)
    assert s.client.post("/v1/chat/completions", json=chat_body()).status_code == 200
    s.engine.fail_steps = 1
    with s.client.stream("POST", "/v1/chat/completions", json=chat_body(stream=True)) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
    assert s.client.get("/health").status_code == 200
    assert 'finished_reason="error"' in s.client.get("/metrics").text


def test_repeated_step_failures_mark_the_engine_dead(served):
    s = served()
    s.engine.fail_steps = 100  # every step fails, even the ones that only hand back the aborts
    assert s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 500
    deadline = time.monotonic() + 5
    while s.async_engine.dead is None and time.monotonic() < deadline:
        time.sleep(0.01)
    r = s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert s.client.get("/health").status_code == 503


def test_engine_error_type_is_raised_to_direct_callers(served):
    s = served()
    s.engine.fail_steps = 1

    async def scenario():
        stream = await s.async_engine.generate("x", [1], SamplingParams(max_tokens=2))
        return [o async for o in stream]

    with pytest.raises(EngineError):
        asyncio.run(scenario())


def test_an_idle_engine_thread_sleeps(served):
    s = served()
    assert s.client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3}).status_code == 200
    steps = s.engine.steps
    time.sleep(0.2)
    assert s.engine.steps == steps == 3  # no step without work: the thread waits on its condition


# ---------------------------------------------------------------- console line
def test_console_line_only_when_something_changed():
    now = [0.0]
    m = ServeMetrics("m", clock=lambda: now[0])
    assert m.console_line() is None
    m.update_engine(Stats(0, 0, 0.0, 16, 16, 0, 0, 0, 0))
    assert m.console_line() is None  # idle from the start: nothing to say
    now[0] = 5.0
    m.update_engine(Stats(2, 1, 0.25, 16, 16, 100, 40, 60, 10))
    line = m.console_line()
    assert line is not None and "running 2, waiting 1" in line and "KV cache 25.0%" in line
    assert "prefix cache hits 40.0%" in line and "tok/s" in line
    now[0] = 10.0
    assert m.console_line() is None  # unchanged
    m.update_engine(Stats(0, 0, 0.0, 16, 16, 100, 40, 60, 30))
    now[0] = 15.0
    line = m.console_line()
    assert "generation 4.0 tok/s" in line and "running 0" in line  # 20 tokens since the quiet check at 10 s


def test_an_oversized_body_is_refused_unread(served):
    import duoka.serve.api as api

    s = served()
    limit = api.MAX_BODY_BYTES
    big = '{"model": "%s", "prompt": "%s"}' % (MODEL, "x" * (limit + 10))
    r = s.client.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(limit // 2**16 + 2):
            yield b"x" * 2**16
        yield b'"}'

    r = s.client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert s.client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_token_without_text_is_still_an_event(tokenizer):
    """A token whose text is held back (part of a character, or a token the tokenizer prints as
    nothing) is an event with empty text, as vLLM sends it: a client's time to first token and
    inter-token latency count tokens, not printed text."""
    class Outputs:  # RequestStream's consumer side, one output per engine step
        def __init__(self, outputs):
            self.outputs = list(outputs)

        async def next_batch(self):
            if not self.outputs:
                raise StopAsyncIteration
            return [self.outputs.pop(0)]

        def abort(self):
            pass

    steps = [RequestOutput("r", [7], "", None, False, None, 3, 1, 0),
             RequestOutput("r", [8], "ab", None, False, None, 3, 2, 0),
             RequestOutput("r", [9], "", None, True, "length", 3, 3, 0)]
    responder = Responder(None, tokenizer, MODEL)
    base = {"id": "r", "object": "x", "created": 0, "model": MODEL}

    async def events(chat: bool):
        name = responder.token_text
        render = responder._chat_render(base, 0, False, False, name) if chat else \
            responder._completion_render(base, 0, False, name, None)
        body = b"".join([e if isinstance(e, bytes) else e.encode()
                         async for e in responder._events([Outputs(steps)], base, False, [render], 1)])
        return [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: {")]

    completion = asyncio.run(events(False))
    assert [(e["choices"][0]["text"], e["choices"][0]["finish_reason"]) for e in completion] == \
        [("", None), ("ab", None), ("", "length")]
    chat = asyncio.run(events(True))
    assert [(e["choices"][0]["delta"], e["choices"][0]["finish_reason"]) for e in chat] == \
        [({"role": "assistant", "content": ""}, None), ({"content": ""}, None), ({"content": "ab"}, None),
         ({}, "length")]
