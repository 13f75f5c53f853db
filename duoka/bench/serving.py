"""`duoka bench serve`: serving throughput and latency through the OpenAI API, optionally
beside the transformers peer in the same call.

The server is either one already running (--url) or a `duoka serve` this command starts on
a free port in a session of its own and stops with SIGTERM at the end (a stopped
benchmark stops it too). The client (duoka/bench/loadgen.py) sends a fixed workload: the
peer's random token-id prompts (or a JSONL of prompts), all at once, at most N in flight, or
as Poisson arrivals; then, with --batch1, one request alone. With --vs-peer the peer script
(the repository's bench/peers/serve_peer.py, or --peer) runs the same
prompts through transformers' continuous batching once the server has given the GPU back;
vs_peer = our total tokens/s / the peer's. Random prompts draw their ids from the vocabulary
the server reports (duoka serve's /v1/models gives vocab_size), else the model folder's.
"""

from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx2 as httpx

from duoka import __version__
from duoka.bench import loadgen
from duoka.bench.training import peer_missing, repository_peer
from duoka.errors import DuokaError
from duoka.host.ports import free_port
from duoka.hub import bundled_model_dir, resolve_model_dir

ROOT = Path(__file__).resolve().parents[2]  # the repository (or site-packages): what PYTHONPATH needs for duoka
PEER_SCRIPT = "serve_peer.py"  # in the repository's bench/peers/
PEER_MODELS = ("0.5b", "1.5b", "7b", "tiny")
# The peer's published shapes by (hidden_size, num_hidden_layers), to name --peer-model from a folder.
PEER_SHAPES = {(896, 24): "0.5b", (1536, 28): "1.5b", (3584, 28): "7b"}
RESULTS_DIR = Path("bench") / "results" / "serve"
# Loading a 7B model, compiling and capturing CUDA graphs takes minutes; a CPU server seconds.
DEFAULT_START_TIMEOUT_S = 900.0
# After SIGTERM the server drains (nothing is in flight by then) and exits; past this, SIGKILL.
STOP_TIMEOUT_S = 60.0
HEALTH_POLL_S = 0.2


@dataclass
class ServeBenchOptions:
    model: str | None = None  # start `duoka serve MODEL` (None: the bundled model) ...
    url: str | None = None  # ... or use the server at this base URL
    model_name: str | None = None  # the name to send (default: the server's first model)
    api_key: str | None = None
    serve_args: list[str] = field(default_factory=list)
    requests: int | None = None  # default: 256, the file's prompts, or what --duration holds
    prompt_min: int = 128
    prompt_max: int = 1024
    out_len: int = 256
    seed: int = 0
    vocab: int | None = None  # default: the vocab_size the server reports, else the model folder's
    prompts: str | None = None
    concurrency: int | None = None
    request_rate: float | None = None
    duration_s: float | None = None
    warmup: int = 1
    batch1: bool = False
    vs_peer: bool = False
    peer: Path | None = None
    peer_model: str | None = None
    peer_timeout_s: float = 1800.0
    start_timeout_s: float = DEFAULT_START_TIMEOUT_S
    command: str = ""


# ---------------------------------------------------------------- the server


class StartedServer:
    """`duoka serve` in a session of its own on a free port; stop() sends SIGTERM (the drain
    exits 0), then kills the session after STOP_TIMEOUT_S."""

    def __init__(self, model: str | None, serve_args: list[str], start_timeout_s: float, log):
        for flag in ("--port", "--host"):
            if any(a == flag or a.startswith(flag + "=") for a in serve_args):
                raise DuokaError(f"--serve-arg {flag}: duoka bench serve picks the address of the server it starts",
                                 "leave it out, or start the server yourself and pass --url")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [sys.executable, "-m", "duoka.cli", "serve", *([model] if model else []), "--port",
                        str(self.port), *serve_args]
        self.log_file = tempfile.NamedTemporaryFile(prefix="duoka-bench-serve-", suffix=".log", delete=False)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        log(f"duoka bench serve: starting {shlex.join(['duoka', *self.command[3:]])}")
        self.proc = subprocess.Popen(self.command, stdout=self.log_file, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self._wait_ready(start_timeout_s, log)
        except BaseException:
            self.stop()
            raise

    def tail(self, lines: int = 15) -> str:
        text = Path(self.log_file.name).read_text(errors="replace").strip().splitlines()
        return "\n    ".join(text[-lines:])

    def _wait_ready(self, timeout_s: float, log) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise DuokaError(f"duoka serve exited with {self.proc.returncode} before it was ready:\n    {self.tail()}",
                                 "run the same duoka serve command by hand for the whole log")
            try:
                if httpx.get(self.url + "/health", timeout=5, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise DuokaError(f"duoka serve was not ready after {timeout_s:.0f} s:\n    {self.tail()}",
                                 "raise --start-timeout, or check the server's log above")
            time.sleep(HEALTH_POLL_S)
        ready = [x for x in Path(self.log_file.name).read_text(errors="replace").splitlines() if x.startswith("serving ")]
        log(f"duoka bench serve: {ready[-1] if ready else 'server ready on ' + self.url}")

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise DuokaError(f"duoka serve exited with {self.proc.returncode} during the benchmark:\n    {self.tail()}",
                             "see the server's log above")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the session (tensor-parallel ranks)
        except ProcessLookupError:
            pass
        code = self.proc.wait()
        self.log_file.close()
        Path(self.log_file.name).unlink(missing_ok=True)
        return code


class _Stopped(BaseException):
    """SIGTERM while the benchmark runs: unwinds through the `finally` that stops the server."""


def _raise_stopped(signum, frame):
    raise _Stopped(signum)


# ---------------------------------------------------------------- the peer


def peer_model_for(config: dict | None) -> str | None:
    if not config:
        return None
    return PEER_SHAPES.get((config.get("hidden_size"), config.get("num_hidden_layers")))


def run_peer(peer: Path, peer_model: str, requests: int, prompt_min: int, prompt_max: int, out_len: int,
             batch1: bool, timeout_s: float) -> dict:
    """The peer script in a session of its own; its JSON lines (one per case) are the result.
    A failed case comes back as {"error": ...}, not an exception: our own figures still count."""
    cmd = [sys.executable, str(peer), "--model", peer_model, "--requests", str(requests), "--prompt-min",
           str(prompt_min), "--prompt-max", str(prompt_max), "--out-len", str(out_len), "--case",
           "both" if batch1 else "continuous"]
    out = {"command": shlex.join(cmd), "model": peer_model, "continuous": None, "batch1": None, "error": None}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        out["error"] = f"the peer ran past {timeout_s:.0f} s and was stopped (--peer-timeout)"
        return out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    for line in stdout.splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict) or "case" not in row:
            continue
        key = "batch1" if row["case"].startswith("batch1") else "continuous"
        out[key] = row
        if row.get("error"):
            out["error"] = f"{row['case']}: {row['error']}"
    if out["continuous"] is None and out["error"] is None:
        tail = "\n    ".join((stderr or stdout).strip().splitlines()[-8:])
        out["error"] = f"the peer exited with {proc.returncode} and printed no result:\n    {tail}"
    return out


# ---------------------------------------------------------------- the benchmark


def _model_config(name: str | None) -> dict | None:
    """config.json of a model folder or cached hub id (None: the bundled model); None when there is none here."""
    try:
        folder = resolve_model_dir(name) if name is not None else bundled_model_dir()
    except DuokaError:
        return None
    path = folder / "config.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _peer_model(o: ServeBenchOptions, config: dict | None) -> str:
    name = o.peer_model or peer_model_for(config)
    if name is None:
        raise DuokaError("the peer has no shape like this model's", f"give --peer-model ({', '.join(PEER_MODELS)})")
    return name


def _check(o: ServeBenchOptions) -> None:
    if o.url and o.model:
        raise DuokaError("--url and --model both given", "--url benchmarks a running server; --model starts one: "
                                                         "give one of them")
    if o.url and o.serve_args:
        raise DuokaError("--serve-arg with --url: the server is already running", "leave --serve-arg out")
    for name, value in (("--requests", o.requests), ("--concurrency", o.concurrency), ("--out-len", o.out_len)):
        if value is not None and value < 1:
            raise DuokaError(f"{name} {value} must be at least 1", f"give a positive {name}")
    if o.warmup < 0:
        raise DuokaError(f"--warmup {o.warmup} is negative", "give 0 or more warm-up requests")
    if o.duration_s is not None:
        if o.request_rate is None:
            raise DuokaError("--duration needs --request-rate (it bounds the Poisson arrivals)",
                             "give --request-rate R, or a request count with --requests N")
        if o.requests is not None:
            raise DuokaError("--duration and --requests both given", "give one: how long, or how many")
        if not o.duration_s > 0:
            raise DuokaError(f"--duration {o.duration_s} must be positive", "give seconds, e.g. --duration 120")
    if o.vs_peer:
        if o.prompts or o.request_rate is not None:
            raise DuokaError("--vs-peer with --prompts or --request-rate: the peer runs only its random prompts, "
                             "all at once", "leave --prompts and --request-rate out for the comparison")
        if o.seed != 0:
            raise DuokaError(f"--vs-peer with --seed {o.seed}: the peer's prompts are drawn with seed 0",
                             "leave --seed at 0 for the comparison")
        if o.peer_model is not None and o.peer_model not in PEER_MODELS:
            raise DuokaError(f"--peer-model {o.peer_model} is not one of the peer's shapes",
                             f"use one of {', '.join(PEER_MODELS)}")


def _build_workload(o: ServeBenchOptions, vocab: int | None) -> tuple[list[loadgen.Request], list[float] | None, dict]:
    arrivals = None
    if o.request_rate is not None:
        arrivals = loadgen.poisson_arrivals(o.request_rate, o.seed, o.requests or (None if o.duration_s else 256),
                                            o.duration_s)
        if not arrivals:
            raise DuokaError(f"no request arrives within --duration {o.duration_s} s at {o.request_rate}/s",
                             "raise --duration or --request-rate")
    if o.prompts:
        base = loadgen.read_prompts(o.prompts, o.out_len)
        n = len(arrivals) if arrivals is not None else o.requests or len(base)
        requests = [base[i % len(base)] for i in range(n)]  # cycled when more are asked for than the file holds
        ids = [r.prompt for r in requests if isinstance(r.prompt, list)]
        lengths = [len(p) for p in ids] if len(ids) == len(requests) else None
        workload = {"prompts_file": str(o.prompts), "prompt_min": min(lengths) if lengths else None,
                    "prompt_max": max(lengths) if lengths else None}
    else:
        if vocab is None:
            raise DuokaError("the vocabulary size for random prompts is unknown: the server's /v1/models names no "
                             "vocab_size (duoka serve's does) and the served model is not a folder this machine has",
                             "give --vocab N (the model's config.json vocab_size), or --prompts FILE")
        n = len(arrivals) if arrivals is not None else o.requests or 256
        requests = [loadgen.Request(p, o.out_len)
                    for p in loadgen.random_prompts(n, o.prompt_min, o.prompt_max, vocab, o.seed)]
        workload = {"prompts_file": None, "prompt_min": o.prompt_min, "prompt_max": o.prompt_max, "vocab": vocab}
    concurrency = o.concurrency if o.request_rate is not None else min(o.concurrency or n, n)
    workload = {"requests": n, **workload, "out_len": o.out_len, "seed": o.seed, "concurrency": concurrency,
                "request_rate": o.request_rate, "duration_s": o.duration_s, "warmup": o.warmup}
    return requests, arrivals, workload


def _warmup_requests(requests: list[loadgen.Request], n: int, vocab: int | None, seed: int) -> list[loadgen.Request]:
    """The workload's first n requests, their token ids redrawn (seed + 1) so that the timed run finds
    none of its prompts in the prefix cache, and at most 16 output tokens each."""
    fresh = random.Random(seed + 1) if vocab else None
    warm = []
    for r in requests[:n]:
        prompt = r.prompt
        if fresh is not None and isinstance(prompt, list):
            prompt = [fresh.randrange(1, vocab) for _ in prompt]
        warm.append(loadgen.Request(prompt, min(r.max_tokens, 16)))
    return warm


def _pick_model(models: list[dict], name: str | None, url: str) -> dict:
    if name is None:
        return models[0]
    for m in models:
        if m.get("id") == name:
            return m
    raise DuokaError(f"{url} serves {', '.join(str(m.get('id')) for m in models)}, not {name}",
                     "pass one of those names with --model-name")


def _measure(o: ServeBenchOptions, config: dict | None, log) -> tuple:
    """Our side: the server (started here or not), the warm-up, the load, batch 1; the server is
    stopped before this returns."""
    server = None
    try:
        if o.url:
            url = o.url.rstrip("/")
        else:
            server = StartedServer(o.model, o.serve_args, o.start_timeout_s, log)
            url = server.url
        served = _pick_model(loadgen.server_models(url, o.api_key), o.model_name, url)
        name = served["id"]
        if o.url:
            config = _model_config(name) if Path(str(name)).is_dir() else None
        peer_model = _peer_model(o, config) if o.vs_peer else None
        vocab = o.vocab or served.get("vocab_size") or (config or {}).get("vocab_size")
        requests, arrivals, workload = _build_workload(o, vocab)
        limit = served.get("max_model_len")
        longest = max((len(r.prompt) + r.max_tokens for r in requests if isinstance(r.prompt, list)), default=0)
        if limit and longest > limit:
            raise DuokaError(f"the longest request needs {longest} tokens (prompt + --out-len), but {name} is served "
                             f"with a context of {limit}", "lower --prompt-max or --out-len, or serve with a larger "
                                                           "--max-model-len")
        if o.warmup:
            log(f"duoka bench serve: {o.warmup} warm-up request(s)")
            warm = loadgen.run_load(url, name, _warmup_requests(requests, o.warmup, vocab, o.seed), api_key=o.api_key)
            if warm["completed"] == 0:
                raise DuokaError(f"the warm-up request(s) failed: {warm['errors'][0]['error']}",
                                 "check the server's log and the workload's sizes against its limits")
        rate = f"{o.request_rate:g} requests/s" if o.request_rate is not None else "all at once"
        cap = f", at most {workload['concurrency']} in flight" if workload["concurrency"] else ""
        log(f"duoka bench serve: {len(requests)} requests, {rate}{cap}, to {name} at {url}")
        load = loadgen.run_load(url, name, requests, workload["concurrency"], arrivals, o.api_key,
                                progress=lambda line: log(f"duoka bench serve: {line}"))
        if load["completed"] == 0:
            raise DuokaError(f"all {len(requests)} requests failed; the first: {load['errors'][0]['error']}",
                             "check the server's log and the workload's sizes against its limits")
        batch1 = None
        if o.batch1:
            if vocab is None:
                raise DuokaError("--batch1 draws a random prompt, but the vocabulary size is unknown", "give --vocab N")
            log(f"duoka bench serve: batch 1, {loadgen.BATCH1_RUNS} x 2 requests alone")
            batch1 = loadgen.batch1_rate(url, name, vocab, o.out_len, o.seed, o.api_key)
        if server is not None:
            server.check_alive()
    finally:
        code = server.stop() if server is not None else None
        if code not in (0, None):
            log(f"duoka bench serve: the server exited with {code} after SIGTERM")
    server_command = shlex.join(["duoka", *server.command[3:]]) if server is not None else None
    return url, name, workload, load, batch1, peer_model, server_command


def bench_serve(o: ServeBenchOptions, log=print) -> dict:
    _check(o)
    config = _model_config(o.model) if not o.url else None
    peer = None
    if o.vs_peer:  # what the peer needs is checked before a server starts
        peer = o.peer or repository_peer(PEER_SCRIPT)
        if peer is None or not peer.is_file():
            raise peer_missing(PEER_SCRIPT, peer)
        if not o.url:
            _peer_model(o, config)
    # SIGTERM unwinds through the `finally`s that stop the server and the peer (main thread only).
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_stopped) if main_thread else None
    try:
        url, name, workload, load, batch1, peer_model, server_command = _measure(o, config, log)
        peer_result = None
        if o.vs_peer:  # after the server has exited: on one GPU the two cannot share its memory
            log(f"duoka bench serve: running the peer ({peer_model}) on the same workload")
            peer_result = run_peer(peer, peer_model, workload["requests"], o.prompt_min, o.prompt_max, o.out_len,
                                   o.batch1, o.peer_timeout_s)
            if peer_result["error"]:
                log(f"duoka bench serve: the peer failed: {peer_result['error']}")
    except _Stopped:
        raise DuokaError("duoka bench serve was stopped (SIGTERM)", None) from None
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
    cont = (peer_result or {}).get("continuous") or {}
    peer_total = cont.get("total_tokens_per_s")
    return {
        "model": o.model if server_command and o.model else name,
        "served_model_name": name,
        "url": url if o.url else None,
        "command": o.command,
        "server_command": server_command,
        "workload": workload,
        "completed": load["completed"],
        "failed": load["failed"],
        "wall_s": load["wall_s"],
        "request_throughput": load["request_throughput"],
        "output_tokens_per_s": load["output_tokens_per_s"],
        "total_tokens_per_s": load["total_tokens_per_s"],
        "prompt_tokens": load["prompt_tokens"],
        "output_tokens": load["output_tokens"],
        "ttft_ms": load["ttft_ms"],
        "tpot_ms": load["tpot_ms"],
        "itl_ms": load["itl_ms"],
        "e2el_ms": load["e2el_ms"],
        "slowest_first_tokens": load["slowest_first_tokens"],
        "batch1_tokens_per_s": batch1["tokens_per_s"] if batch1 else None,
        "batch1": batch1,
        "peer_total_tokens_per_s": peer_total,
        "peer_output_tokens_per_s": cont.get("output_tokens_per_s"),
        "peer_batch1_tokens_per_s": ((peer_result or {}).get("batch1") or {}).get("tokens_per_s"),
        "vs_peer": load["total_tokens_per_s"] / peer_total if peer_total else None,
        "peer": peer_result,
        "errors": load["errors"],
        "usage_missing": load["usage_missing"],
        "duoka_version": __version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def default_result_path(result: dict) -> Path:
    """bench/results/serve/<model>-<shape of the load>-<time>.json, under the current directory."""
    w = result["workload"]
    model = Path(str(result["model"])).name or "model"
    load = f"r{w['request_rate']:g}" if w["request_rate"] is not None else f"c{w['concurrency']}"
    lengths = f"{w['prompt_min']}-{w['prompt_max']}" if w["prompt_min"] is not None else "file"
    return RESULTS_DIR / f"{model}-{load}-p{lengths}-o{w['out_len']}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def render(result: dict, console) -> None:
    from rich.table import Table

    w = result["workload"]
    lengths = f"prompts {w['prompt_min']}-{w['prompt_max']}" if w["prompt_min"] is not None else "prompts from file"
    load = f"{w['request_rate']:g} req/s" if w["request_rate"] is not None else f"concurrency {w['concurrency']}"
    table = Table(title=f"{result['model']} | {w['requests']} requests | {lengths} | out {w['out_len']} | {load}")
    table.add_column("")
    table.add_column("total tok/s", justify="right")
    table.add_column("output tok/s", justify="right")
    table.add_column("req/s", justify="right")
    table.add_column("wall s", justify="right")
    table.add_row(f"duoka ({result['completed']} ok, {result['failed']} failed)", f"{result['total_tokens_per_s']:,.0f}",
                  f"{result['output_tokens_per_s']:,.0f}", f"{result['request_throughput']:.2f}",
                  f"{result['wall_s']:.3g}")
    if result["peer_total_tokens_per_s"]:
        cont = result["peer"]["continuous"]
        table.add_row(f"peer ({result['peer']['model']}, transformers)", f"{result['peer_total_tokens_per_s']:,.0f}",
                      f"{result['peer_output_tokens_per_s']:,.0f}", "", f"{cont.get('wall_s', 0):.3g}")
        table.add_row("duoka / peer", f"{result['vs_peer']:.2f}x", "", "", "")
    console.print(table)
    latency = Table()
    for column in ("ms", "mean", "median", "p99"):
        latency.add_column(column, justify="right" if column != "ms" else "left")
    for key, label in (("ttft_ms", "time to first token"), ("tpot_ms", "time per output token"),
                       ("itl_ms", "inter-token latency"), ("e2el_ms", "end-to-end latency")):
        s = result[key]
        latency.add_row(label, f"{s['mean']:.1f}", f"{s['median']:.1f}", f"{s['p99']:.1f}")
    console.print(latency)
    if result["slowest_first_tokens"]:
        console.print("slowest first tokens: " + ", ".join(f"{s['ttft_ms']:.0f} ms (sent at {s['sent_s']:.1f} s)"
                                                           for s in result["slowest_first_tokens"]))
    if result["batch1_tokens_per_s"] is not None:
        peer = result["peer_batch1_tokens_per_s"]
        console.print(f"batch 1: {result['batch1_tokens_per_s']:.1f} tok/s (one request alone, decode after the "
                      f"first token)" + (f"; peer {peer:.1f} tok/s" if peer else ""))
    for e in result["errors"]:
        console.print(f"[red]{e['count']} failed:[/red] {e['error']}")
    if result["usage_missing"]:
        console.print(f"{result['usage_missing']} responses had no usage event: their output tokens are counted "
                      "by events, which undercounts")
