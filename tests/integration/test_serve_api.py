"""`duoka serve` end to end: the real server in a subprocess, driven by the official `openai`
client (and raw HTTP where a client would refuse to send the malformed request).

One server for the whole module, started with a tiny KV cache (24 blocks of 16 tokens, 384
tokens in all, for a 256-token context): every test that sends concurrent requests then
also runs through preemption, and one process start is all the module pays. The last test
sends it SIGTERM and checks the drain.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch

from duoka.data.tokenizer import load_tokenizer
from duoka.host.ports import free_port
from duoka.hub import bundled_model_dir

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-123"
MODEL = "tiny"
MAX_MODEL_LEN = 256
NUM_KV_BLOCKS = 24
START_TIMEOUT_S = 90


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.url = f"http://127.0.0.1:{port}"
        self.auth = {"Authorization": f"Bearer {KEY}"}
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=60)

    def post(self, path: str, **kwargs) -> httpx.Response:
        kwargs.setdefault("headers", self.auth)
        return httpx.post(self.url + path, timeout=60, **kwargs)

    def metrics(self) -> dict[str, float]:
        """name{labels} -> value, for the duoka_serve_* samples."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("duoka_serve_"):
                name, value = line.rsplit(" ", 1)
                base, _, labels = name.partition("{")
                rest = [kv for kv in re.findall(r'\w+="[^"]*"', labels) if not kv.startswith("model_name=")]
                out[base + (f"{{{','.join(rest)}}}" if rest else "")] = float(value)
        return out

    def stderr(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "duoka.cli", "serve", "--device", "cpu", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(NUM_KV_BLOCKS), "--api-key", KEY,
           "--served-model-name", MODEL, "--grace", "20"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    s = Server(proc, port, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{s.stderr()}"
        assert time.monotonic() < deadline, f"the server did not start in {START_TIMEOUT_S} s:\n{s.stderr()}"
        if "serving " in s.stderr():  # the ready line comes once uvicorn listens
            break
        time.sleep(0.1)
    assert httpx.get(s.url + "/health", timeout=5).status_code == 200
    yield s
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(bundled_model_dir())


def chat(server, messages, **kwargs):
    return server.client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def user(text):
    return [{"role": "user", "content": text}]


def wait_for(condition, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------------------- outputs
def test_ready_line_names_model_address_and_capacity(server):
    assert f"serving {MODEL} on http://127.0.0.1:{server.port} (KV cache: {NUM_KV_BLOCKS * 16} tokens" in server.stderr()


def test_streamed_text_equals_non_streamed_and_usage_is_exact(server, tokenizer):
    messages = [{"role": "system", "content": "You answer in one line."}, {"role": "user", "content": "What is a list?"}]
    plain = chat(server, messages, max_tokens=24, extra_body={"ignore_eos": True})
    chunks = list(chat(server, messages, max_tokens=24, stream=True, stream_options={"include_usage": True},
                       extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) == {None}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
        plain.usage.prompt_tokens, plain.usage.completion_tokens, plain.usage.total_tokens)
    assert usage.prompt_tokens_details.cached_tokens > 0  # the same prompt a second time: its full blocks are cached

    expected_prompt = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    assert plain.usage.prompt_tokens == expected_prompt
    assert plain.usage.completion_tokens == 24
    assert plain.usage.total_tokens == expected_prompt + 24

    completion = server.client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16, temperature=0)
    streamed = list(server.client.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=16,
                                                     temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
    assert completion.usage.prompt_tokens == len(tokenizer.encode("def add(a, b):"))
    assert completion.usage.completion_tokens <= 16


def test_concurrent_greedy_requests_equal_solo_through_preemption(server):
    prompts = [f"Write item {i} of a list of {'fruit' if i % 2 else 'tools'}:" for i in range(16)]

    def run(prompt):
        r = chat(server, user(prompt), max_tokens=40, extra_body={"ignore_eos": True})
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens

    solo = [run(p) for p in prompts]
    before = server.metrics()["duoka_serve_num_preemptions_total"]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(run, prompts))
    assert together == solo
    assert all(tokens == 40 for _, _, tokens in together)
    # 16 x ~70 tokens in a 384-token cache: the batch cannot fit without preempting.
    assert server.metrics()["duoka_serve_num_preemptions_total"] > before


def test_stop_strings_and_finish_reasons(server):
    prompt = user("Tell me about the sea.")
    full = chat(server, prompt, max_tokens=30, extra_body={"ignore_eos": True})
    text = full.choices[0].message.content
    assert full.choices[0].finish_reason == "length"
    stop = text[8:11]
    assert stop.strip(), text  # the test needs visible text to stop on
    cut = chat(server, prompt, max_tokens=30, stop=[stop, "never-appears"], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]
    streamed = list(chat(server, prompt, max_tokens=30, stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text[:text.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_shared_prefix_hits_the_prefix_cache_with_unchanged_outputs(server):
    system = {"role": "system", "content": "You are a terse assistant for the harbour office. " * 8}
    questions = ["When does the ferry leave?", "Where is the fish market?", "Is the lighthouse open?"]
    before = server.metrics()
    first = [chat(server, [system, *user(q)], max_tokens=12) for q in questions]
    again = [chat(server, [system, *user(q)], max_tokens=12) for q in questions]
    after = server.metrics()
    assert [r.choices[0].message.content for r in again] == [r.choices[0].message.content for r in first]
    hits = after["duoka_serve_prefix_cache_hits_total"] - before["duoka_serve_prefix_cache_hits_total"]
    queries = after["duoka_serve_prefix_cache_queries_total"] - before["duoka_serve_prefix_cache_queries_total"]
    prefix_tokens = first[0].usage.prompt_tokens - 20  # the system prompt's full blocks, at least
    assert hits >= 4 * (prefix_tokens // 16) * 16, (hits, queries)  # the 2nd and 3rd questions, and all 3 repeats
    assert all(r.usage.prompt_tokens_details.cached_tokens > 0 for r in first[1:] + again)


def test_metrics_series(server):
    m = server.metrics()
    assert m["duoka_serve_time_to_first_token_seconds_count"] > 0
    assert m["duoka_serve_inter_token_latency_seconds_count"] > 0
    assert m["duoka_serve_e2e_request_latency_seconds_count"] > 0
    assert m['duoka_serve_request_success_total{finished_reason="length"}'] > 0
    assert m['duoka_serve_request_success_total{finished_reason="stop"}'] > 0
    assert m["duoka_serve_generation_tokens_total"] > 0 and m["duoka_serve_prompt_tokens_total"] > 0
    assert m["duoka_serve_num_requests_running"] == 0 and m["duoka_serve_kv_cache_usage_perc"] == 0


# ---------------------------------------------------------------- bad input
BAD = [
    ("/v1/chat/completions", "{not json", "bad JSON"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "empty messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, "messages of the wrong type"),
    ("/v1/chat/completions", {"model": MODEL, "messages": user("hi"), "max_tokens": "8"}, "max_tokens a string"),
    ("/v1/chat/completions", {"model": MODEL, "messages": user("hi"), "max_tokens": 1000}, "beyond the context"),
    ("/v1/chat/completions", {"model": MODEL, "messages": user("hi"), "max_tokens": 0}, "max_tokens < 1"),
    ("/v1/chat/completions", {"model": MODEL, "messages": user("hi"), "temperature": -1}, "temperature < 0"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     "temperature NaN"),
    ("/v1/chat/completions", {"model": MODEL, "messages": user("hi"), "logprobs": True, "top_logprobs": 21},
     "too many top_logprobs"),
    ("/v1/chat/completions", {"model": MODEL, "messages": user("hi"), "n": 17}, "n > 16"),
    ("/v1/chat/completions", {"model": MODEL, "messages": user("hi"), "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "a schema xgrammar refuses"),
    ("/v1/chat/completions", {"model": MODEL, "messages": user("hi"), "tool_choice": "required"},
     "tool_choice required without tools"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"999999": 5}},
     "a logit_bias id beyond the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": [[1, 2], [3, 999_999]]},
     "a batch of prompts, one with a token id outside the vocabulary"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens 0 without echo"),
    ("/v1/completions", {"model": MODEL, "prompt": [999_999]}, "a token id outside the vocabulary"),
]


@pytest.mark.parametrize("path, body, why", BAD, ids=[why for _, _, why in BAD])
def test_bad_requests_get_400_with_an_openai_error(server, path, body, why):
    if isinstance(body, str):
        r = server.post(path, content=body, headers={**server.auth, "Content-Type": "application/json"})
    else:
        r = server.post(path, json=body)
    assert r.status_code == 400, (why, r.status_code, r.text)
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"]


def test_context_error_names_the_numbers_and_the_fix(server):
    with pytest.raises(openai.BadRequestError) as e:
        chat(server, user("hi"), max_tokens=1000)
    message = e.value.body["message"]
    assert str(MAX_MODEL_LEN) in message and "1000" in message and "lower max_tokens to" in message


def test_unknown_route_and_missing_key(server):
    r = server.post("/v1/embeddings", json={"input": "x"})
    assert r.status_code == 404 and r.json()["error"]["message"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": user("hi")},
                       headers=headers, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # probes need no key
    assert [m.id for m in server.client.models.list().data] == [MODEL]


def test_models_by_id_and_an_unknown_model_as_openai_answers(server, tokenizer):
    """GET /v1/models/{id}: the model object, with the vocabulary `duoka bench serve --url` draws
    prompt ids from; a model the server does not serve: 404 model_not_found (NotFoundError)."""
    card = server.client.models.retrieve(MODEL)
    assert (card.id, card.max_model_len, card.vocab_size) == (MODEL, MAX_MODEL_LEN, tokenizer.vocab_size)
    with pytest.raises(openai.NotFoundError) as e:
        server.client.chat.completions.create(model="gpt-4o", messages=user("hi"), max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and repr(MODEL) in e.value.body["message"]
    with pytest.raises(openai.NotFoundError):
        server.client.models.retrieve("Qwen/Qwen2.5-0.5B-Instruct")


# ---------------------------------------------------------------- disconnects and shutdown
# Probes GET /health on one connection every 20 ms until a line arrives on stdin; prints each
# probe's seconds. Standard library only: it starts in ~50 ms.
HEALTH_PROBE = """
import http.client, select, sys, time
conn = http.client.HTTPConnection("127.0.0.1", int(sys.argv[1]), timeout=10)
print("ready", flush=True)
times = []
while not select.select([sys.stdin], [], [], 0.02)[0]:
    t = time.monotonic()
    try:
        conn.request("GET", "/health")
        conn.getresponse().read()
    except OSError:  # timed out: the time says so
        conn.close()
    times.append(time.monotonic() - t)
print(" ".join(map(str, times)))
"""


def test_a_huge_prompt_is_refused_while_the_server_keeps_serving(server):
    """A 15 MB prompt (under the 16 MiB body cap) is tokenized off the event loop and judged
    from a prefix: it is refused with context_length_exceeded while /health answers within
    100 ms and a stream in flight keeps flowing (once: /health 17 s, every stream stopped).
    The request goes out through a raw socket (sendall releases the GIL) and the probes come
    from a process of their own: this process's GIL would otherwise delay them, whatever the
    server does. Parsing the 15 MB body still holds the server's event loop for ~40 ms."""
    gaps = []
    streaming = threading.Event()

    def stream():
        last = None
        body = {"model": MODEL, "prompt": "The", "max_tokens": 200, "stream": True, "temperature": 0,
                "ignore_eos": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.auth, timeout=60) as r:
            for _ in r.iter_lines():
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                streaming.set()

    huge = ("The quick brown fox jumps over the lazy dog. " * 340_000)[:15_000_000]
    body = json.dumps({"model": MODEL, "prompt": huge, "max_tokens": 4}).encode()
    request = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: {server.auth['Authorization']}"
               f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
               ).encode() + body
    answer = []

    def send():  # sendall and recv release the GIL
        with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
            sock.sendall(request)
            while chunk := sock.recv(65536):
                answer.append(chunk)

    reader = threading.Thread(target=stream)
    reader.start()
    assert streaming.wait(30)
    # The probe in a process of its own: it waits for no GIL of this one.
    probe = subprocess.Popen([sys.executable, "-c", HEALTH_PROBE, str(server.port)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert probe.stdout.readline().strip() == "ready"
    sender = threading.Thread(target=send)
    sender.start()
    sender.join()
    out, _ = probe.communicate("stop\n", timeout=30)
    health = [float(x) for x in out.split()]
    reader.join()
    head, _, text = b"".join(answer).partition(b"\r\n\r\n")
    assert b" 400 " in head.split(b"\r\n")[0], head[:200]
    error = json.loads(text)["error"]
    assert error["code"] == "context_length_exceeded" and "15,000,000 characters" in error["message"]
    assert health and max(health) < 0.1, f"/health took up to {max(health):.3f} s: {health}"
    assert gaps and max(gaps) < 1.0, f"the stream in flight stalled for {max(gaps):.2f} s"


def test_a_client_that_disconnects_frees_its_blocks(server):
    aborted = 'duoka_serve_request_success_total{finished_reason="abort"}'
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 220, "ignore_eos": True, "temperature": 0,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.auth, timeout=30) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert all(line.startswith("data: ") or not line for line in got)
        assert server.metrics()["duoka_serve_kv_cache_usage_perc"] > 0
    # Closed after a few tokens: the request is aborted, not run to its 220 tokens.
    wait_for(lambda: server.metrics()[aborted] == before[aborted] + 1)
    after = server.metrics()
    assert after["duoka_serve_kv_cache_usage_perc"] == 0 and after["duoka_serve_num_requests_running"] == 0
    assert after["duoka_serve_generation_tokens_total"] - before["duoka_serve_generation_tokens_total"] < 220

    # Not streamed: the server watches for the disconnect too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**body, "stream": False}, headers=server.auth, timeout=0.3)
    wait_for(lambda: server.metrics()[aborted] == before[aborted] + 2)
    assert server.metrics()["duoka_serve_kv_cache_usage_perc"] == 0


def test_serve_with_an_adapter_answers_with_the_merged_model_s_tokens(in_process, monkeypatch, tmp_path):
    """`duoka serve --adapter DIR` as the CLI runs it, up to the engine in its own process (the
    HTTP layer is the module server's, untouched by an adapter): the base that
    adapter_config.json names, the adapter merged at load, served under the adapter's name;
    greedy tokens equal to those of the model `duoka export --merge` writes. Under --tp it is
    refused before any process starts."""
    import duoka.launch.serving as launch_serving
    from duoka.models.lora import LoRAArgs
    from duoka.models.qwen2.hf_adapter import load_hf_model
    from duoka.models.qwen2.peft import save_adapter
    from duoka.serve.config import EngineConfig
    from duoka.serve.engine import LLMEngine
    from duoka.serve.params import SamplingParams
    from duoka.train.export import merge_adapter_folder

    base = bundled_model_dir()
    lora = LoRAArgs(rank=4, alpha=8)
    model, _ = load_hf_model(base, lora=lora)
    gen = torch.Generator().manual_seed(0)
    trained = {n: (torch.randn(p.shape, generator=gen) * 0.3 if ".lora_b." in n else p.detach())
               for n, p in model.named_parameters() if p.requires_grad}  # B away from 0: a visible change
    adapter = save_adapter(trained, lora, model.args, tmp_path / "adapter", str(base), [base / "tokenizer.json"])
    merged = merge_adapter_folder(adapter, tmp_path / "merged", dtype="float32")
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = "Return the"

    def tokens(engine) -> list[int]:
        engine.add_request("r", engine.tokenizer.encode(prompt), greedy)
        out = []
        while engine.has_unfinished():
            for delta in engine.step():
                out += delta.new_token_ids
        return out

    served = {}

    def serve(engine, **options):  # the CLI's server, with the engine it would serve
        engine = engine()
        try:
            served.update(tokens=tokens(engine), name=options["served_model_name"], model=engine.model_name)
        finally:
            engine.shutdown()
        return 0

    monkeypatch.setattr(launch_serving, "serve", serve)  # where the CLI's launch calls it
    flags = ["--device", "cpu", "--num-kv-blocks", "24", "--max-model-len", "256"]
    proc = in_process("serve", "--adapter", str(adapter), *flags)
    assert proc.returncode == 0, proc.stderr
    assert f"adapter {adapter} on {base}" in proc.stderr
    assert served["name"] == served["model"] == str(adapter)
    options = dict(device="cpu", num_kv_blocks=24, max_model_len=256)
    quiet = dict(log=lambda message: None)
    assert served["tokens"] == tokens(LLMEngine(EngineConfig(model=merged, **options), **quiet))
    # the adapter changed the model:
    assert served["tokens"] != tokens(LLMEngine(EngineConfig(model=base, **options), **quiet))

    proc = in_process("serve", "--adapter", str(adapter), "--tp", "2", *flags)
    assert proc.returncode == 2 and "--adapter with --tp 2" in proc.stderr
    assert f"duoka export {adapter} --merge --out DIR" in proc.stderr


def test_sigterm_drains_in_flight_requests_and_exits_0(server):
    """Runs last: it stops the module's server."""
    body = {"model": MODEL, "prompt": "The harbour at dawn", "max_tokens": 200, "ignore_eos": True,
            "temperature": 0, "stream": True}
    started = [threading.Event(), threading.Event()]
    results: list = [None, None]

    def stream(i):
        texts, finish = [], None
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.auth, timeout=60) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                started[i].set()
                chunk = json.loads(line[6:])
                texts.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0]["finish_reason"] or finish
        results[i] = ("".join(texts), finish)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(30)
    server.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "draining" in server.stderr())
    r = server.post("/v1/completions", json={"model": MODEL, "prompt": "late", "max_tokens": 4})
    assert r.status_code == 503 and r.headers["retry-after"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    for t in threads:
        t.join(60)
    assert server.proc.wait(30) == 0, server.stderr()
    assert [finish for _, finish in results] == ["length", "length"]  # both finished, none cut off
    assert results[0][0] == results[1][0] and results[0][0]
    assert "Traceback" not in server.stderr()
