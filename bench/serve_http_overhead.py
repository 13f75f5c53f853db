"""The HTTP layer's host cost per streamed token (issue 24: 256 streams at >= 90% of the engine).

    OMP_NUM_THREADS=1 flock /tmp/serve/cpu.lock python bench/serve_http_overhead.py \
        [--requests 256] [--out-len 256] [--profile py-spy|cprofile|none] [--json OUT]

The engine runs no model: an LLMEngine on the bundled tiny model whose runner (through the
engine's runner_factory) returns ready-made random logits, so a step is the engine's host work
only (schedule, prepare, sample, detokenize) and everything else is the serving layer's.
Workload: `--requests` token-id prompts of 16-64 random ids (loadgen.random_prompts), greedy,
ignore_eos, `--out-len` output tokens each, all at once (loadgen's own request body:
/v1/completions, stream, include_usage).

Three runs, each after a warm-up:
- engine: LLM.generate on the same fake engine, no HTTP, no threads (the ceiling);
- async: the same requests through AsyncEngine and the API's own SSE generator
  (api._Server._completion_events) in one process, no HTTP: the engine thread + the event
  loop's per-token work without the server;
- http: `duoka serve`'s app (AsyncEngine + build_app + uvicorn, as duoka/serve/server.py runs
  them) in a subprocess, loaded by duoka/bench/loadgen.py from this process, so the client
  does not share the server's GIL.
Reported: output tok/s of each, their ratios to the engine, and the server's CPU time per
streamed token by thread (/proc/<pid>/task/<tid>/stat: the event loop's and the engine
thread's), i.e. what each streamed token costs the process. With --profile the server is
sampled by py-spy (both threads, GIL holders only: what takes the GIL from the engine) or
profiled by cProfile (event-loop thread only; its overhead inflates the figures): the top
functions in microseconds per streamed token.

On a 2-core machine the client takes one core and the server the other; absolute figures are
noisy (compare ratios), and OMP_NUM_THREADS=1 keeps torch to the server's core.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from duoka.bench.loadgen import Request, random_prompts, run_load  # noqa: E402
from duoka.serve.params import SamplingParams  # noqa: E402

MAX_SEQS = 256
LOGITS_POOL = 8
PROMPT_MIN, PROMPT_MAX = 16, 64
TICK = os.sysconf("SC_CLK_TCK")


class LogitsRunner:
    """Stands in for ModelRunner: execute returns a copy of ready-made random logits."""

    def __init__(self, vocab: int, seed: int = 0, device_ms: float = 0.0):
        g = torch.Generator().manual_seed(seed)
        self.pool = torch.randn(LOGITS_POOL, MAX_SEQS, vocab, generator=g)
        self.calls = 0
        self.device_s = device_ms / 1000

    def execute(self, inputs):
        rows = len(inputs.logits_indices)
        self.calls += 1
        if self.device_s:  # a GPU step: the engine thread waits without the GIL
            time.sleep(self.device_s)
        return self.pool[self.calls % LOGITS_POOL, :rows].clone()


def fake_runner(model, shape, device, max_model_len, max_num_seqs, cuda_graphs, device_ms: float = 0.0):
    return LogitsRunner(model.args.vocab_size, device_ms=device_ms)


def quiet(_message: str) -> None:
    pass


def engine_options(requests: int, out_len: int, device_ms: float = 0.0) -> dict:
    """Picklable (module-level functions): --engine-process sends them to a spawned process."""
    blocks = requests * -(-(PROMPT_MAX + out_len) // 16) + 64
    return dict(device="cpu", max_num_seqs=MAX_SEQS, num_kv_blocks=blocks,
                runner_factory=functools.partial(fake_runner, device_ms=device_ms), log=quiet)


def workload(requests: int, vocab: int, seed: int) -> list[list[int]]:
    return random_prompts(requests, PROMPT_MIN, PROMPT_MAX, vocab, seed)


def greedy(out_len: int) -> SamplingParams:
    return SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)


def thread_cpu(pid: int, tid: int) -> float:
    """CPU seconds (user + system) of one thread."""
    fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


# ---------------------------------------------------------------- engine alone
def run_engine(a) -> dict:
    from duoka.serve.engine import LLM

    llm = LLM(**engine_options(a.requests, a.out_len, a.device_ms))
    vocab = llm.engine.vocab_size
    llm.generate(workload(8, vocab, 99), greedy(8))  # warm-up
    prompts = workload(a.requests, vocab, a.seed)
    t0, c0 = time.perf_counter(), time.process_time()
    done = llm.generate(prompts, greedy(a.out_len))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    tokens = sum(len(c.token_ids) for c in done)
    return {"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall, "cpu_us_per_token": 1e6 * cpu / tokens}


# ---------------------------------------------------------------- AsyncEngine + SSE generator, no HTTP
def run_async(a) -> dict:
    from duoka.serve.api import _Server
    from duoka.serve.async_engine import AsyncEngine
    from duoka.serve.engine import LLMEngine

    engine = LLMEngine(**engine_options(a.requests, a.out_len, a.device_ms))
    ae = AsyncEngine(engine, 4096)
    server = _Server(ae, engine.tokenizer, engine.model_name, engine.max_model_len, engine.default_params)

    writes, events = [0], [0]  # sends and SSE events: events per send > 1 when the loop fell behind

    async def one(i: int, prompt: list[int], out_len: int) -> int:
        stream = await ae.generate(f"cmpl-{i}", prompt, greedy(out_len))
        n = 0
        async for event in server._completion_events(stream, f"cmpl-{i}", 0, True, False):
            writes[0] += 1
            n += event.count(b"data:") if isinstance(event, bytes) else event.count("data:")
        events[0] += n
        return n

    async def load(prompts, out_len):
        return await asyncio.gather(*(one(i, p, out_len) for i, p in enumerate(prompts)))

    try:
        asyncio.run(load(workload(8, engine.vocab_size, 99), 8))
        prompts = workload(a.requests, engine.vocab_size, a.seed)
        loop_tid, engine_tid = threading_native_ids(ae)
        pid = os.getpid()
        l0, e0, t0 = thread_cpu(pid, loop_tid), thread_cpu(pid, engine_tid), time.perf_counter()
        writes[0] = events[0] = 0
        asyncio.run(load(prompts, a.out_len))
        wall = time.perf_counter() - t0
        loop_cpu, engine_cpu = thread_cpu(pid, loop_tid) - l0, thread_cpu(pid, engine_tid) - e0
    finally:
        ae.close()
    tokens = engine.stats().generation_tokens - 8 * 8
    return {"output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
            "loop_cpu_us_per_token": 1e6 * loop_cpu / tokens, "engine_cpu_us_per_token": 1e6 * engine_cpu / tokens,
            "events_per_write": events[0] / max(writes[0], 1)}


def threading_native_ids(ae) -> tuple[int, int]:
    import threading

    return threading.main_thread().native_id, ae._thread.native_id


# ---------------------------------------------------------------- the server (subprocess)
def serve(port: int, a) -> None:
    """`duoka serve`'s stack on the fake engine, plus two bench routes: /_bench/cpu (the
    threads' CPU seconds) and /_bench/profile (cProfile of the event-loop thread on/off)."""
    import cProfile
    import pstats

    import uvicorn

    from duoka.serve.api import build_app
    from duoka.serve.async_engine import AsyncEngine
    from duoka.serve.engine import LLMEngine
    from duoka.serve.engine_process import EngineProcess
    from duoka.serve.server_metrics import ServeMetrics

    if a.switch_interval:
        sys.setswitchinterval(a.switch_interval)
    options = engine_options(a.requests, a.out_len, a.device_ms)
    engine = EngineProcess(options) if a.engine_process else LLMEngine(**options)
    ae = AsyncEngine(engine, 4096, ServeMetrics(engine.model_name))
    app = build_app(ae, engine.tokenizer, engine.model_name, engine.max_model_len, engine.default_params)
    loop_tid, engine_tid = threading_native_ids(ae)
    profiler = cProfile.Profile()

    @app.get("/_bench/cpu")
    async def cpu():
        pid = os.getpid()
        return {"loop": thread_cpu(pid, loop_tid), "engine": thread_cpu(pid, engine_tid),
                "process": sum(os.times()[:2]), "generation_tokens": engine.stats().generation_tokens}

    @app.get("/_bench/profile")
    async def profile(on: int, tokens: int = 0):
        if on:
            profiler.enable()
            return {}
        profiler.disable()
        rows = []
        for (file, line, name), (cc, nc, tt, ct, callers) in pstats.Stats(profiler).stats.items():
            rows.append((tt, ct, nc, f"{Path(file).name}:{line}({name})"))
        rows.sort(reverse=True)
        return {"top_self": [(f, 1e6 * tt / tokens, 1e6 * ct / tokens, nc) for tt, ct, nc, f in rows[:40]],
                "top_cumulative": [(f, 1e6 * ct / tokens, nc) for tt, ct, nc, f in
                                   sorted(rows, key=lambda r: -r[1])[:40]]}

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    try:
        asyncio.run(server.serve())
    finally:
        ae.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str):
    import httpx2 as httpx

    response = httpx.get(url, timeout=600, trust_env=False)
    response.raise_for_status()
    return response.json() if response.content else None


def run_http(a, vocab: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, __file__, "--serve", str(port), "--requests", str(a.requests), "--out-len", str(a.out_len),
           "--switch-interval", str(a.switch_interval), "--device-ms", str(a.device_ms)] + \
        (["--engine-process"] if a.engine_process else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL if not a.verbose else None)
    spy = None
    try:
        deadline = time.time() + 120
        while True:
            try:
                get(url + "/health")
                break
            except Exception:
                if proc.poll() is not None or time.time() > deadline:
                    raise SystemExit("the bench server did not start")
                time.sleep(0.2)
        model = "duoka-tiny-qwen2"
        warm = [Request(p, 8) for p in workload(8, vocab, 99)]
        run_load(url, model, warm)
        requests = [Request(p, a.out_len) for p in workload(a.requests, vocab, a.seed)]
        before = get(url + "/_bench/cpu")
        if a.profile == "cprofile":
            get(url + "/_bench/profile?on=1")
        elif a.profile == "py-spy":
            spy_out = Path(a.spy_out or f"/tmp/serve_http_overhead-{os.getpid()}.txt")
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(proc.pid), "--rate", str(a.spy_rate), "--gil", "--threads",
                                    "--format", "raw", "--output", str(spy_out), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)  # py-spy attaches
        summary = run_load(url, model, requests)
        after = get(url + "/_bench/cpu")
        tokens = summary["output_tokens"]
        result = {"output_tokens": tokens, "failed": summary["failed"], "wall_s": summary["wall_s"],
                  "output_tok_s": summary["output_tokens_per_s"], "tpot_ms_median": summary["tpot_ms"]["median"],
                  "ttft_ms_median": summary["ttft_ms"]["median"],
                  "loop_cpu_us_per_token": 1e6 * (after["loop"] - before["loop"]) / tokens,
                  "engine_cpu_us_per_token": 1e6 * (after["engine"] - before["engine"]) / tokens,
                  "process_cpu_us_per_token": 1e6 * (after["process"] - before["process"]) / tokens}
        if a.profile == "cprofile":
            result["cprofile"] = get(url + f"/_bench/profile?on=0&tokens={tokens}")
        if spy is not None:
            spy.send_signal(signal.SIGINT)
            spy.wait(timeout=60)
            result["py_spy"] = summarize_spy(spy_out, tokens, a.spy_rate)
    finally:
        if spy is not None and spy.poll() is None:
            spy.kill()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    return result


# ---------------------------------------------------------------- py-spy's samples, per token
GROUPS = (  # the loop thread's samples, by the innermost frame that matches
    ("duoka api: SSE generator (_completion_events, _sse, json)", "api.py"),
    ("duoka async_engine (RequestStream, deliveries)", "async_engine.py"),
    ("uvicorn h11 protocol + h11 (HTTP framing, writes)", "h11"),
    ("starlette StreamingResponse / middleware", "starlette"),
    ("fastapi request handling (per request: body, validation)", "fastapi"),
)


def summarize_spy(path: Path, tokens: int, rate: float) -> dict:
    """py-spy's raw (collapsed) samples: per thread, the top leaf functions and a few groups, in
    microseconds of GIL time per streamed token."""
    per_thread = collections.Counter()
    leaves: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    groups: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread = "engine" if "duoka-engine" in frames[0] else ("loop" if "MainThread" in frames[0] else frames[0])
        n = int(count)
        per_thread[thread] += n
        leaves[thread][frames[-1]] += n
        if thread == "loop":
            for frame in reversed(frames[1:]):  # the innermost group: json under api.py, h11 under starlette
                hit = next((g for g, key in GROUPS if key in frame), None)
                if hit is not None:
                    groups[thread][hit] += n
                    break
            else:
                groups[thread]["other (asyncio loop, selectors, sockets)"] += n

    def us(n):
        return round(1e6 * n / rate / tokens, 2)

    return {"threads_us_per_token": {t: us(n) for t, n in per_thread.items()},
            "loop_groups_us_per_token": {g: us(n) for g, n in groups["loop"].most_common()},
            "top_leaves_us_per_token": {t: [(f, us(n)) for f, n in c.most_common(25)] for t, c in leaves.items()}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--out-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", default="engine,async,http", help="which of engine, async, http to run")
    ap.add_argument("--profile", choices=("none", "py-spy", "cprofile"), default="none")
    ap.add_argument("--spy-out", help="where py-spy's raw samples go")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--switch-interval", type=float, default=0.0,
                    help="sys.setswitchinterval in the server (0: Python's default, 5 ms)")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="each step also sleeps this long (the GPU's share of a step, the GIL released)")
    ap.add_argument("--engine-process", action="store_true",
                    help="the server's engine in a process of its own, as `duoka serve` runs it")
    ap.add_argument("--verbose", action="store_true", help="show the server's stderr")
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)  # internal: the server subprocess
    a = ap.parse_args()
    a.spy_rate = 1000
    if a.serve:
        serve(a.serve, a)
        return
    from duoka.hub import bundled_model_dir
    from duoka.models.qwen2.hf_adapter import read_config

    vocab = read_config(bundled_model_dir()).vocab_size
    runs = a.runs.split(",")
    result = {"requests": a.requests, "out_len": a.out_len, "prompt_tokens": [PROMPT_MIN, PROMPT_MAX],
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cpus": os.cpu_count()}
    if "engine" in runs:
        result["engine"] = run_engine(a)
    if "async" in runs:
        result["async"] = run_async(a)
    if "http" in runs:
        result["http"] = run_http(a, vocab)
    base = result.get("engine", {}).get("output_tok_s")
    print(f"{'run':<8}{'output tok/s':>14}{'vs engine':>11}{'loop us/tok':>13}{'engine us/tok':>15}{'process us/tok':>16}")
    for name in ("engine", "async", "http"):
        r = result.get(name)
        if r is None:
            continue
        ratio = r["output_tok_s"] / base if base else float("nan")
        r["ratio_to_engine"] = ratio
        engine_us = r.get("engine_cpu_us_per_token", r.get("cpu_us_per_token"))
        print(f"{name:<8}{r['output_tok_s']:>14,.0f}{ratio:>11.3f}{r.get('loop_cpu_us_per_token', 0):>13.1f}"
              f"{engine_us:>15.1f}{r.get('process_cpu_us_per_token', 0):>16.1f}")
    http = result.get("http", {})
    if "py_spy" in http:
        spy = http["py_spy"]
        print("py-spy, GIL held, us per streamed token:", json.dumps(spy["threads_us_per_token"]))
        for g, v in spy["loop_groups_us_per_token"].items():
            print(f"  loop {v:>8.2f}  {g}")
        for f, v in spy["top_leaves_us_per_token"].get("loop", [])[:15]:
            print(f"    {v:>8.2f}  {f}")
    if "cprofile" in http:
        for f, tt, ct, nc in http["cprofile"]["top_self"][:25]:
            print(f"  self {tt:>8.2f} us/tok  cum {ct:>8.2f}  calls {nc:>8}  {f}")
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
