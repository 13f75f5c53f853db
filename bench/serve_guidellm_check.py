"""An outside client agrees (issue 24): guidellm and `duoka bench serve` load the same server
with the same shape of workload, and their output tokens/s must be within --tolerance.

    python bench/serve_guidellm_check.py --model /tmp/duoka-models/qwen2-7b-random \\
        --requests 256 --prompt-len 512 --out-len 256 --concurrency 64 --out $OUT/guidellm_check.json
    python bench/serve_guidellm_check.py --url http://127.0.0.1:8000 --tokenizer MODEL_FOLDER ...

The shape: both clients send the same prompts (shared_prompts: --prompt-len tokens of the
bundled corpus's documents, as text), --out-len output tokens each (ignore_eos, which guidellm
sends once it knows the output length), greedy (guidellm sends no temperature, so the server's
default would sample: its requests get temperature 0 through `extras`, the value `duoka bench
serve` and `vllm bench serve` send), --concurrency streams each, --requests requests each, both
clients at once (each sees the server in the same seconds: a CPU server's speed drifts by 20%
from one run to the next), ours from guidellm's first request on (wait_for_first_request).
guidellm must read every stream without an error; the ratio of the two clients' output rates
is the result.
Exit 0 when they agree, 1 when not, 2 on a setup error.

guidellm: `$GUIDELLM` or `guidellm` on PATH (pip install guidellm, best in a venv of its own:
python -m venv --system-site-packages V && V/bin/pip install guidellm).

Cited by docs/serving.md ("Measuring a server"); tests/integration/test_bench_serve.py
imports it (guidellm against `duoka bench serve` on a CPU server).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from duoka.bench.loadgen import server_models  # noqa: E402
from duoka.bench.serving import StartedServer  # noqa: E402
from duoka.data.dataset import iter_documents  # noqa: E402
from duoka.data.tokenizer import load_tokenizer  # noqa: E402
from duoka.errors import DuokaError  # noqa: E402
from duoka.hub import bundled_corpus, bundled_model_dir, resolve_model_dir  # noqa: E402


def find_guidellm(given: str | None = None) -> str | None:
    return given or os.environ.get("GUIDELLM") or shutil.which("guidellm")


def shared_prompts(tokenizer: str, requests: int, prompt_len: int, out_len: int, path: Path) -> Path:
    """The prompts both clients send, one JSON line each: the first prompt_len tokens of the
    bundled corpus's documents as text, with the output length under both clients' names
    (`max_tokens` for duoka bench serve, `output_tokens_count` for guidellm). The same texts:
    on a CPU server the cost of a token depends on the text generated (random token ids ran
    ~20% slower than guidellm's synthetic text), so different prompts made different loads."""
    tok = load_tokenizer(tokenizer)
    rows = []
    for doc in iter_documents(bundled_corpus(), "text"):
        ids = tok.encode(doc, add_special_tokens=False)
        if len(ids) >= prompt_len:
            rows.append({"prompt": tok.decode(ids[:prompt_len]), "max_tokens": out_len, "output_tokens_count": out_len})
        if len(rows) == requests:
            break
    if len(rows) < requests:
        raise DuokaError(f"the bundled corpus has only {len(rows)} documents of {prompt_len} tokens",
                         "ask for fewer requests or shorter prompts")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def guidellm_command(guidellm: str, url: str, model: str, tokenizer: str, prompts: Path, requests: int,
                     concurrency: int, out_json: Path, api_key: str | None = None) -> list[str]:
    backend = {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions",
               "extras": {"body": {"temperature": 0}}, **({"api_key": api_key} if api_key else {})}
    return [guidellm, "run", "--backend", json.dumps(backend), "--profile", f"kind=concurrent,streams={concurrency}",
            "--constraint", f"kind=max_requests,count={requests}",
            "--tokenizer", json.dumps({"kind": "huggingface_auto", "model": tokenizer}),
            "--data", f"kind=json_file,path={prompts}",
            "--output", json.dumps({"kind": "json", "path": str(out_json)}), "--disable-console"]


def read_guidellm(path: Path) -> dict:
    """The figures of guidellm's one benchmark: its reported output tokens/s (the mean of
    its rate series, which is total output tokens / duration), the request totals and the
    output tokens of each completed request."""
    bench = json.loads(path.read_text())["benchmarks"][0]
    metrics = bench["metrics"]
    done = bench["requests"]["successful"]
    return {"output_tokens_per_s": metrics["output_tokens_per_second"]["successful"]["mean"],
            "total_tokens_per_s": metrics["tokens_per_second"]["successful"]["mean"],
            "duration_s": bench["duration"], "requests": metrics["request_totals"],
            "output_tokens": [r["output_tokens"] for r in done], "prompt_tokens": [r["prompt_tokens"] for r in done],
            "ttft_ms_median": metrics["time_to_first_token_ms"]["successful"]["median"],
            "itl_ms_median": metrics["inter_token_latency_ms"]["successful"]["median"]}


def ours_command(url: str, model: str, prompts: Path, requests: int, out_len: int, concurrency: int,
                 api_key: str | None) -> list[str]:
    return [sys.executable, "-m", "duoka.cli", "bench", "serve", "--url", url, "--model-name", model, "--prompts",
            str(prompts), "--requests", str(requests), "--out-len", str(out_len), "--concurrency", str(concurrency),
            *(["--api-key", api_key] if api_key else [])]


def requests_in_flight(url: str, api_key: str | None) -> int | None:
    """Running plus waiting requests from the server's Prometheus metrics (duoka serve's and
    vLLM's names end alike); None when it exposes neither."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        text = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return None
    found = re.findall(r"^\S*num_requests_(?:running|waiting)(?:\{[^}]*\})? ([0-9.e+]+)$", text, re.MULTILINE)
    return int(sum(float(n) for n in found)) if found else None


def wait_for_first_request(theirs: subprocess.Popen, url: str, api_key: str | None, timeout_s: float = 120) -> None:
    """Until guidellm's first request reaches the server (or guidellm ends, or the server has
    no such metric). Started together, the clients' start-ups (guidellm's longer, and both
    stretched on a loaded machine) left one client alone on the server for seconds at one end
    of its run, with half the streams: on a CPU server beside two busy processes the rates came
    0.82-0.87 apart (1.14 in another run). Started after its first request, each client runs
    alone for about our start-up, guidellm at its start and ours at its end: 1.00-1.03."""
    deadline = time.monotonic() + timeout_s
    while theirs.poll() is None and time.monotonic() < deadline:
        inflight = requests_in_flight(url, api_key)
        if inflight is None or inflight > 0:
            return
        time.sleep(0.05)


def run_both(ours_cmd: list[str], guidellm_cmd: list[str], out_json: Path, workers: int | None, url: str,
             api_key: str | None = None) -> tuple[dict, dict]:
    """Both clients at once, on the same server: each sees the server as it is in the same
    seconds (a CPU server's speed drifts by 20% from one run to the next, which made two runs
    one after the other disagree by as much); ours starts once guidellm's first request is in."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if workers:  # on a CPU server, guidellm's worker processes poll and take cores from the server
        env["GUIDELLM__MAX_WORKER_PROCESSES"] = str(workers)
    theirs = subprocess.Popen(guidellm_cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=out_json.parent)
    wait_for_first_request(theirs, url, api_key)
    ours = subprocess.run(ours_cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          cwd=ROOT)
    out, err = theirs.communicate()
    if ours.returncode != 0:
        raise DuokaError(f"duoka bench serve failed:\n{ours.stderr[-2000:]}", "run it by hand: " + " ".join(ours_cmd))
    if theirs.returncode != 0 or not out_json.is_file():
        raise DuokaError(f"guidellm failed ({theirs.returncode}):\n{(err or out)[-3000:]}",
                         "run the guidellm command by hand: " + " ".join(guidellm_cmd))
    return json.loads(ours.stdout), read_guidellm(out_json)


def check(url: str, model: str, tokenizer: str, guidellm: str, requests: int, prompt_len: int, out_len: int,
          concurrency: int, tolerance: float, workers: int | None = None, api_key: str | None = None) -> dict:
    """Both clients at once on the same prompts, each with `concurrency` streams; the ratio of
    their output rates. guidellm must read every stream whole."""
    with tempfile.TemporaryDirectory(prefix="guidellm-") as tmp:
        prompts = shared_prompts(tokenizer, requests, prompt_len, out_len, Path(tmp) / "prompts.jsonl")
        out_json = Path(tmp) / "guidellm.json"
        cmd = guidellm_command(guidellm, url, model, tokenizer, prompts, requests, concurrency, out_json, api_key)
        ours, theirs = run_both(ours_command(url, model, prompts, requests, out_len, concurrency, api_key), cmd,
                                out_json, workers, url, api_key)
    totals = theirs["requests"]
    ratio = ours["output_tokens_per_s"] / theirs["output_tokens_per_s"]
    agree = (totals["errored"] == 0 and totals["incomplete"] == 0 and totals["successful"] == requests
             and all(n == out_len for n in theirs["output_tokens"]) and abs(ratio - 1) <= tolerance)
    return {"agree": agree, "ratio_ours_over_guidellm": ratio, "tolerance": tolerance,
            "workload": {"requests": requests, "prompt_len": prompt_len, "out_len": out_len,
                         "concurrency": concurrency, "simultaneous": True},
            "duoka_bench_serve": {k: ours[k] for k in ("output_tokens_per_s", "total_tokens_per_s", "wall_s",
                                                       "completed", "failed", "ttft_ms", "itl_ms", "command")},
            "guidellm": {**{k: v for k, v in theirs.items() if k not in ("output_tokens", "prompt_tokens")},
                         "prompt_tokens_range": [min(theirs["prompt_tokens"], default=0),
                                                 max(theirs["prompt_tokens"], default=0)],
                         "command": " ".join(cmd)}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--url", help="a running server")
    where.add_argument("--model", help="start `duoka serve MODEL` (default: the bundled model)")
    p.add_argument("--serve-arg", action="append", default=[], help="extra duoka serve flags (with --model)")
    p.add_argument("--model-name", default=None, help="with --url: the name to send (default: the first model)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder for guidellm (default: the model's folder)")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--out-len", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--tolerance", type=float, default=0.10)
    p.add_argument("--guidellm", default=None, help="the guidellm executable (default: $GUIDELLM, then PATH)")
    p.add_argument("--guidellm-workers", type=int, default=None,
                   help="GUIDELLM__MAX_WORKER_PROCESSES (default: guidellm's, 10)")
    p.add_argument("--api-key", default=os.environ.get("DUOKA_API_KEY"))
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args()
    guidellm = find_guidellm(a.guidellm)
    if guidellm is None:
        print("error: guidellm not found\n  fix: pip install guidellm (or set $GUIDELLM to its executable)",
              file=sys.stderr)
        return 2
    server = None
    try:
        if a.url:
            url = a.url.rstrip("/")
        else:
            server = StartedServer(a.model, [x for s in a.serve_arg for x in s.split()], 900,
                                   log=lambda m: print(m, file=sys.stderr, flush=True))
            url = server.url
        served = server_models(url, a.api_key)
        name = a.model_name or served[0]["id"]
        folder = a.tokenizer or (str(resolve_model_dir(a.model)) if a.model else
                                 name if Path(name).is_dir() else str(bundled_model_dir()) if server else None)
        if folder is None:
            raise DuokaError("guidellm needs the model's tokenizer", "pass --tokenizer MODEL_FOLDER")
        result = check(url, name, folder, guidellm, a.requests, a.prompt_len, a.out_len, a.concurrency, a.tolerance,
                       a.guidellm_workers, a.api_key)
    except DuokaError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if server is not None:
            server.stop()
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")
    return 0 if result["agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
