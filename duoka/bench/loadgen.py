"""The client of `duoka bench serve`: a fixed workload sent through a server's OpenAI API
(/v1/completions, streamed), timed at the client as `vllm bench serve` times it.

One process, one asyncio loop, httpx2 streams and one json.loads per server-sent event: a
fast server at 256 streams sends some 20k events a second, and the openai client's pydantic
objects would make the client, not the server, the thing measured.

Definitions (vLLM's, vllm/benchmarks/serve.py, so the figures compare with its tables):
- TTFT: request sent -> first event that carries a choice;
- ITL: the gaps between consecutive choice events, all requests pooled (an event can carry
  several tokens when the server holds back an incomplete character);
- TPOT of a request: (latency - TTFT) / (output tokens - 1), over requests with at least 2;
- latency (E2E): request sent -> last choice event;
- throughput: completed requests, output tokens (the usage event's completion_tokens) and
  prompt + output tokens, each over the wall time from the first request sent to the last
  one finished.
Percentiles interpolate linearly between closest ranks (numpy's and vLLM's default).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx

from duoka.errors import DuokaError

# A request may legitimately stream for minutes (long outputs behind a long queue); only a
# connection that cannot even be opened should fail fast.
CONNECT_TIMEOUT_S = 10.0
# The batch-1 measurement: the prompt length the figure uses, repeated runs, median.
BATCH1_PROMPT_TOKENS = 128
BATCH1_RUNS = 3
# A progress line while a load runs at most this often (a 256-request load on a GPU takes
# minutes; lines per request would flood the log).
PROGRESS_INTERVAL_S = 5.0


@dataclass
class Request:
    prompt: list[int] | str
    max_tokens: int
    model: str | None = None
    """The model to name (an adapter of the server's); None: the run's model."""
    chat: bool = False
    """Sent to /v1/chat/completions as one user message (the prompt must be text)."""
    fields: dict = field(default_factory=dict)
    """More request fields (response_format, tools, ...), added to the body as they are."""


@dataclass
class Result:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0
    sent: float = 0.0  # time.perf_counter() when the request went out
    itl: list[float] = field(default_factory=list)
    usage_missing: bool = False


# ---------------------------------------------------------------- workloads


def random_prompts(requests: int, prompt_min: int, prompt_max: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """The serving peer's prompts (bench/peers/serve_peer.py in the repository): one
    random.Random(seed) draws every length first, uniform in [prompt_min, prompt_max], then
    the ids, uniform in [1, vocab)."""
    if not 1 <= prompt_min <= prompt_max:
        raise DuokaError(f"prompt lengths {prompt_min}..{prompt_max} are not a range of positive lengths",
                         "give 1 <= --prompt-min <= --prompt-max")
    if vocab < 2:
        raise DuokaError(f"a vocabulary of {vocab} ids leaves no id to draw (ids are drawn from [1, vocab))",
                         "give the model's vocab_size with --vocab")
    rng = random.Random(seed)
    lengths = [rng.randint(prompt_min, prompt_max) for _ in range(requests)]
    return [[rng.randrange(1, vocab) for _ in range(n)] for n in lengths]


def read_prompts(path: str | Path, out_len: int) -> list[Request]:
    """A JSONL file, one {"prompt": text or token ids} per line, optionally with its own
    "max_tokens" (else out_len)."""
    path = Path(path)
    if not path.is_file():
        raise DuokaError(f"prompts file {path} does not exist", 'pass a JSONL file with one {"prompt": ...} per line')
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DuokaError(f"{path}:{number} is not JSON ({e.msg})", 'write one {"prompt": ...} object per line')
        prompt = row.get("prompt") if isinstance(row, dict) else None
        ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise DuokaError(f"{path}:{number} has no usable \"prompt\" (a non-empty string or list of token ids)",
                             'write one {"prompt": "text"} or {"prompt": [ids]} object per line')
        max_tokens = row.get("max_tokens", out_len)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise DuokaError(f"{path}:{number} has max_tokens {max_tokens!r}", "give a positive integer or leave it out")
        requests.append(Request(prompt, max_tokens))
    if not requests:
        raise DuokaError(f"prompts file {path} is empty", 'write one {"prompt": ...} object per line')
    return requests


def poisson_arrivals(rate: float, seed: int, requests: int | None = None, duration_s: float | None = None) -> list[float]:
    """Arrival times (seconds from the start) of a Poisson process at `rate` requests/s: exponential
    gaps from a random.Random(seed) of their own, `requests` of them or every one before
    `duration_s`."""
    if not rate > 0 or math.isinf(rate):
        raise DuokaError(f"--request-rate {rate} is not a positive finite rate",
                         "give requests per second, e.g. --request-rate 4 (or --concurrency N instead)")
    rng, t, times = random.Random(seed), 0.0, []
    while True:
        t += rng.expovariate(rate)
        if (requests is not None and len(times) >= requests) or (duration_s is not None and t >= duration_s):
            return times
        times.append(t)


# ---------------------------------------------------------------- statistics


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def spread_ms(values: list[float]) -> dict:
    """{mean, median, p99} in milliseconds; zeros for no values (vLLM's convention)."""
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    return {"mean": 1e3 * sum(values) / len(values), "median": 1e3 * percentile(values, 50),
            "p99": 1e3 * percentile(values, 99)}


def summarize(results: list[Result], wall_s: float) -> dict:
    done = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "errors": [{"error": e, "count": n} for e, n in sorted(errors.items(), key=lambda x: -x[1])[:5]],
        "wall_s": wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / wall_s,
        "output_tokens_per_s": output_tokens / wall_s,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall_s,
        "ttft_ms": spread_ms([r.ttft for r in done]),
        "tpot_ms": spread_ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]),
        "itl_ms": spread_ms([gap for r in done for gap in r.itl]),
        "e2el_ms": spread_ms([r.latency for r in done]),
        "usage_missing": sum(r.usage_missing for r in done),
        "slowest_first_tokens": slowest_first_tokens(done),
    }


# How many of the longest waits for a first token a report lists.
SLOWEST_SHOWN = 5


def slowest_first_tokens(done: list[Result]) -> list[dict]:
    """The longest waits for a first token, longest first, each with when its request went out
    (seconds after the first request): a tail at the start is warm-up (a compile), one spread
    over the run is queueing or steps that hold a long prefill."""
    if not done:
        return []
    t0 = min(r.sent for r in done)
    return [{"ttft_ms": 1e3 * r.ttft, "sent_s": r.sent - t0}
            for r in sorted(done, key=lambda r: -r.ttft)[:SLOWEST_SHOWN]]


# ---------------------------------------------------------------- the client


def _client(url: str, api_key: str | None, connections: int | None) -> httpx.AsyncClient:
    # trust_env off: a proxy from the environment would sit between the benchmark and the server.
    return httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {api_key}"} if api_key else None, trust_env=False,
        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections))


def _error_text(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace").strip()
    return f"HTTP {status}: {message[:300]}"


async def send(client: httpx.AsyncClient, model: str, request: Request) -> Result:
    """One streamed /v1/completions (or chat) request, timed."""
    body = {"model": request.model or model, "max_tokens": request.max_tokens, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **request.fields}
    if request.chat:
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    out = Result(prompt_tokens=len(request.prompt) if isinstance(request.prompt, list) else 0)
    usage = None
    first = last = None
    chunks = 0
    start = out.sent = time.perf_counter()
    try:
        path = "/v1/chat/completions" if request.chat else "/v1/completions"
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                out.error = _error_text(response.status_code, await response.aread())
                return out
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                try:
                    event = json.loads(payload)
                except ValueError:
                    out.error = f"the server sent an event that is not JSON: {payload[:100]!r}"
                    return out
                if event.get("choices"):
                    now = time.perf_counter()
                    if first is None:
                        first = now
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                elif event.get("usage"):
                    usage = event["usage"]
                elif "error" in event:  # a failure after the stream began (an engine error, a drain)
                    err = event["error"]
                    out.error = f"stream error: {err.get('message', err) if isinstance(err, dict) else err}"[:300]
                    return out
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}"[:300] or type(e).__name__
        return out
    if first is None:
        out.error = "the stream ended without a token"
        return out
    out.ok, out.ttft, out.latency = True, first - start, last - start
    if usage:
        out.output_tokens = usage.get("completion_tokens") or 0
        out.prompt_tokens = usage.get("prompt_tokens") or out.prompt_tokens
    else:  # a server that sends no usage event: count events, which undercounts held-back tokens
        out.output_tokens, out.usage_missing = chunks, True
    return out


class Progress:
    """Counts finished requests; hands `report` a line at most every PROGRESS_INTERVAL_S, and
    one for the last request."""

    def __init__(self, total: int, report: Callable[[str], None] | None):
        self.total, self.report = total, report
        self.done = self.failed = self.tokens = 0
        self.start = self.last = time.perf_counter()

    def add(self, result: Result) -> Result:
        self.done += 1
        self.failed += not result.ok
        self.tokens += result.output_tokens
        now = time.perf_counter()
        if self.report is not None and (now - self.last >= PROGRESS_INTERVAL_S or self.done == self.total):
            self.last = now
            self.report(f"{self.done}/{self.total} requests done ({self.failed} failed), {self.tokens:,} output "
                        f"tokens, {now - self.start:.1f} s")
        return result


async def _run(url: str, model: str, requests: list[Request], concurrency: int | None, arrivals: list[float] | None,
               api_key: str | None, progress: Callable[[str], None] | None = None) -> tuple[list[Result], float]:
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    async with _client(url, api_key, concurrency) as client:
        start = time.perf_counter()
        counted = Progress(len(requests), progress)

        async def one(i: int) -> Result:
            if arrivals is not None:
                await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
            if gate is None:
                return counted.add(await send(client, model, requests[i]))
            async with gate:
                return counted.add(await send(client, model, requests[i]))

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        return list(results), time.perf_counter() - start


def run_load(url: str, model: str, requests: list[Request], concurrency: int | None = None,
             arrivals: list[float] | None = None, api_key: str | None = None,
             progress: Callable[[str], None] | None = None) -> dict:
    """Send `requests` (at most `concurrency` in flight; at `arrivals` offsets when given, else
    all at once) and summarize them; `progress` gets a line now and then as they finish."""
    results, wall_s = asyncio.run(_run(url, model, requests, concurrency, arrivals, api_key, progress))
    return summarize(results, wall_s)


def batch1_rate(url: str, model: str, vocab: int, out_len: int, seed: int = 0, api_key: str | None = None) -> dict:
    """One streamed request alone, BATCH1_RUNS times each of out_len and of a quarter of it:
    decode tokens/s = (out_len - short) / (latency(out_len) - latency(short)), the median of
    the runs. The difference of two whole requests cancels the prefill and whatever the first
    event holds (a server that falls behind sends several tokens in one event)."""
    short = out_len // 4
    if short < 1:
        raise DuokaError(f"--batch1 needs at least 4 output tokens (--out-len {out_len})", "raise --out-len")
    prompt = random_prompts(1, BATCH1_PROMPT_TOKENS, BATCH1_PROMPT_TOKENS, vocab, seed)[0]

    async def latency(client, n: int) -> float:
        r = await send(client, model, Request(prompt, n))
        if not r.ok:
            raise DuokaError(f"the batch-1 request failed: {r.error}", "check the server's log")
        if r.output_tokens != n:
            raise DuokaError(f"the batch-1 request of {n} tokens produced {r.output_tokens}",
                             "the server must honour ignore_eos and max_tokens")
        return r.latency

    async def go() -> list[float]:
        rates = []
        async with _client(url, api_key, 1) as client:
            for _ in range(BATCH1_RUNS):
                full, part = await latency(client, out_len), await latency(client, short)
                rates.append((out_len - short) / (full - part))
        return rates

    rates = asyncio.run(go())
    return {"tokens_per_s": percentile(rates, 50), "runs_tokens_per_s": rates, "prompt_tokens": len(prompt),
            "out_len": out_len, "short_len": short}


def server_models(url: str, api_key: str | None = None, timeout_s: float = 10.0) -> list[dict]:
    """GET /v1/models: the served models (id, max_model_len where the server says). A server
    that cannot be reached or does not answer like an OpenAI server is a user error."""
    fix = "start the server first (duoka serve ...), or check --url (scheme, host and port)"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        response = httpx.get(url.rstrip("/") + "/v1/models", headers=headers, timeout=timeout_s, trust_env=False)
    except httpx.HTTPError as e:
        raise DuokaError(f"no server answers at {url} ({type(e).__name__}: {e})", fix) from None
    if response.status_code == 401:
        raise DuokaError(f"{url} wants an API key (401)", "pass --api-key KEY or set $DUOKA_API_KEY")
    try:
        models = response.json()["data"]
        assert isinstance(models, list) and models
    except (ValueError, KeyError, TypeError, AssertionError):
        raise DuokaError(f"{url}/v1/models answered {response.status_code} without a model list",
                         "point --url at an OpenAI-compatible server's base address, without /v1") from None
    return models
