"""Issue 48: prompt logprobs on the bundled tiny model in fp32, equal to transformers' own
log-softmax (1e-4): the engine's chunked prefill under preemption, and the OpenAI API in
process (echo with logprobs over a prompt list, max_tokens 0, n, vLLM's prompt_logprobs on chat,
return_tokens_as_token_ids), with the prefix cache on (a cached prefix is computed again for
such a request, and still serves the others) and off."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import Qwen2ForCausalLM

from duoka.hub import bundled_model_dir
from duoka.serve.api import build_app
from duoka.serve.async_engine import AsyncEngine
from duoka.serve.config import EngineConfig
from duoka.serve.engine import LLMEngine
from duoka.serve.params import SamplingParams
from duoka.serve.server_metrics import ServeMetrics

ATOL = 1e-4
MODEL = "tiny"
# A step budget below the prompts' lengths: every prompt is prefilled in chunks.
BUDGET = 24
TEXTS = ["The quick brown fox jumps over the lazy dog, and the dog does not move at all; it sleeps on.",
         "def f(x):\n    return x ** 2  # squares its input, nothing else, for every x it is given",
         "Grouped-query attention shares each key and value head across several query heads."]


def quiet(_message):
    pass


@pytest.fixture(scope="module")
def reference():
    """prompt ids -> transformers' fp32 log-softmax [len, vocab] (row p scores token p + 1)."""
    model = Qwen2ForCausalLM.from_pretrained(bundled_model_dir(), dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return logprobs


def engine_config(**overrides) -> EngineConfig:
    fields = {"device": "cpu", "dtype": "float32", "max_model_len": 256, "num_kv_blocks": 64,
              "max_num_batched_tokens": BUDGET}
    return EngineConfig(**{**fields, **overrides})


class Served:
    def __init__(self, **overrides):
        self.engine = LLMEngine(engine_config(**overrides), log=quiet)
        self.async_engine = AsyncEngine(self.engine, 64, ServeMetrics(MODEL), log=quiet)
        app = build_app(self.async_engine, self.engine.tokenizer, MODEL, self.engine.max_model_len, {})
        self.http = TestClient(app)
        self.tokenizer = self.engine.tokenizer

    def post(self, path: str, **body) -> dict:
        r = self.http.post(path, json={"model": MODEL, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()

    def close(self):
        self.http.close()
        self.async_engine.close()


@pytest.fixture(scope="module", params=[True, False], ids=["prefix-cache", "no-prefix-cache"])
def served(request):
    s = Served(enable_prefix_caching=request.param)
    yield s
    s.close()


def check_entries(ids: list[int], values: list, tops: list, want: torch.Tensor, k: int) -> None:
    """Completions' token_logprobs and top_logprobs (tokens as ids) of a prompt against the reference."""
    assert values[0] is None and tops[0] is None
    got = torch.tensor(values[1:len(ids)])
    torch.testing.assert_close(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=ATOL, rtol=0)
    for p in range(1, len(ids)):
        best = want[p - 1].topk(k)
        listed = {int(name.removeprefix("token_id:")): v for name, v in tops[p].items()}
        for t, v in zip(best.indices.tolist(), best.values.tolist()):
            assert abs(listed[t] - v) < ATOL, (p, t)
        assert set(listed) <= set(best.indices.tolist()) | {ids[p]}  # the prompt's token is always listed


def test_echo_logprobs_of_a_prompt_list_equal_transformers(served, reference):
    prompts = [served.tokenizer.encode(t) for t in TEXTS]
    assert all(len(p) > BUDGET for p in prompts)
    if served.engine.blocks.enable_prefix_caching:  # the first prompt's prefix is in the cache before it is scored
        warm = served.post("/v1/completions", prompt=prompts[0], max_tokens=1)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    body = served.post("/v1/completions", prompt=prompts, max_tokens=2, echo=True, logprobs=3, ignore_eos=True,
                       return_tokens_as_token_ids=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # scored prompts are computed whole
    for ids, choice in zip(prompts, body["choices"]):
        want = reference(ids)
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 2
        assert lp["tokens"][:len(ids)] == [f"token_id:{t}" for t in ids]
        assert choice["text"].startswith(served.tokenizer.decode(ids))
        check_entries(ids, lp["token_logprobs"], lp["top_logprobs"], want, 3)
        first = int(lp["tokens"][len(ids)].removeprefix("token_id:"))
        assert first == want[-1].argmax().item()  # greedy after the echoed prompt
    if served.engine.blocks.enable_prefix_caching:  # the scored prompts still fill the cache for the others
        again = served.post("/v1/completions", prompt=prompts[1], max_tokens=1)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_max_tokens_0_scores_only(served, reference):
    body = served.post("/v1/completions", prompt=TEXTS[:2], max_tokens=0, echo=True, logprobs=1)
    assert body["usage"]["completion_tokens"] == 0
    for text, choice in zip(TEXTS, body["choices"]):
        ids = served.tokenizer.encode(text)
        assert choice["text"] == text and choice["finish_reason"] == "length"
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None
        assert lp["text_offset"][0] == 0
        want = reference(ids)
        got = torch.tensor(lp["token_logprobs"][1:])
        torch.testing.assert_close(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=ATOL, rtol=0)


def test_n_choices_of_each_prompt_show_the_same_prompt(served, reference):
    prompts = [served.tokenizer.encode(t) for t in TEXTS[1:]]
    body = served.post("/v1/completions", prompt=prompts, n=2, max_tokens=3, echo=True, logprobs=0, seed=5,
                       temperature=1.0, return_tokens_as_token_ids=True)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    for j, ids in enumerate(prompts):
        a, b = choices[2 * j]["logprobs"], choices[2 * j + 1]["logprobs"]
        assert a["token_logprobs"][:len(ids)] == b["token_logprobs"][:len(ids)]
        check_entries(ids, b["token_logprobs"], b["top_logprobs"], reference(ids), 0)
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))


def test_prompt_logprobs_on_chat_in_vllm_format(served, reference):
    messages = [{"role": "user", "content": TEXTS[0]}]
    body = served.post("/v1/chat/completions", messages=messages, max_tokens=1, prompt_logprobs=2,
                       return_tokens_as_token_ids=True)
    ids = served.tokenizer.encode(served.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                       tokenize=False), add_special_tokens=False)
    prompt_lps = body["prompt_logprobs"]
    assert len(prompt_lps) == len(ids) == body["usage"]["prompt_tokens"] and prompt_lps[0] is None
    want = reference(ids)
    for p, step in enumerate(prompt_lps[1:], start=1):
        assert str(ids[p]) in step and len(step) in (2, 3)  # the prompt's token and the top 2
        for t, entry in step.items():
            assert entry["decoded_token"] == f"token_id:{t}"
            assert abs(entry["logprob"] - want[p - 1, int(t)].item()) < ATOL
            assert entry["rank"] == int((want[p - 1] > want[p - 1, int(t)]).sum()) + 1


def test_streamed_echo_starts_with_the_prompt(served):
    plain = served.post("/v1/completions", prompt=TEXTS[2], max_tokens=3, echo=True, logprobs=1)
    with served.http.stream("POST", "/v1/completions", json={"model": MODEL, "prompt": TEXTS[2], "max_tokens": 3,
                                                               "echo": True, "logprobs": 1, "temperature": 0,
                                                               "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    chunks = [json.loads(e)["choices"][0] for e in events]
    assert chunks[0]["text"].startswith(TEXTS[2])
    assert "".join(c["text"] for c in chunks) == plain["choices"][0]["text"]
    streamed = [v for c in chunks for v in c["logprobs"]["token_logprobs"]]
    want = plain["choices"][0]["logprobs"]["token_logprobs"]
    assert streamed[0] is None and want[0] is None
    torch.testing.assert_close(torch.tensor(streamed[1:]), torch.tensor(want[1:]), atol=ATOL, rtol=0)


def test_preempted_prompts_keep_every_row_once(reference):
    """A cache too small for three scored prompts at once: preemption recomputes them, and each
    prompt row's logprob still comes once and equals transformers'."""
    engine = LLMEngine(engine_config(num_kv_blocks=12, block_size=8, max_model_len=96, max_num_batched_tokens=40),
                       log=quiet)
    prompts = [engine.tokenizer.encode(t + " " + t) for t in TEXTS]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1,
                                                       ignore_eos=True))
    firsts = {}
    while engine.has_unfinished():
        for out in engine.step():
            firsts.setdefault(out.request_id, out)
    assert engine.stats().num_preemptions > 0
    for i, ids in enumerate(prompts):
        entries = firsts[str(i)].prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        want = reference(ids)
        assert [e.token_id for e in entries[1:]] == ids[1:]
        got = torch.tensor([e.logprob for e in entries[1:]])
        torch.testing.assert_close(got, want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], atol=ATOL, rtol=0)
        assert [e.top[0][0] for e in entries[1:]] == want[:-1].argmax(-1).tolist()
