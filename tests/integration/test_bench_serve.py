"""`duoka bench serve` end to end on the CPU: the bundled model behind a real `duoka serve`
(one server for the module), loaded by the command as a user runs it; the transformers peer
replaced by a stand-in script (the peer on CPU takes minutes); guidellm, when installed,
as the outside client that must agree on throughput.

The module's server runs with one torch thread on a core of its own (CPUS below), the load
generators on the others.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from duoka.bench import loadgen
from duoka.host.ports import free_port
from duoka.hub import bundled_model_dir

ROOT = Path(__file__).resolve().parents[2]
MODEL = str(bundled_model_dir())  # served under its folder's path, so the bench finds its vocabulary
VOCAB = json.loads((bundled_model_dir() / "config.json").read_text())["vocab_size"]
MAX_MODEL_LEN = 256
START_TIMEOUT_S = 90
FIELDS = ("model", "workload", "total_tokens_per_s", "output_tokens_per_s", "request_throughput",
          "peer_total_tokens_per_s", "vs_peer", "batch1_tokens_per_s", "ttft_ms", "tpot_ms", "itl_ms", "e2el_ms",
          "completed", "failed", "wall_s", "command")


# The server (its API and engine processes) on one core and the load generators on the
# others: a client then cannot take CPU time from the server it measures, as on a GPU, and
# two clients measure the same server. (Sharing 2 cores, guidellm's heavier client slowed
# the server's inter-token latency by 9% against duoka's, and the two rates came 13% apart.)
CPUS = sorted(os.sched_getaffinity(0))
SERVER_CPUS, CLIENT_CPUS = (CPUS[:1], CPUS[1:]) if len(CPUS) > 1 else (CPUS, CPUS)


def _on(cpus):
    return lambda: os.sched_setaffinity(0, cpus)


@contextlib.contextmanager
def clients_on(cpus):
    """Processes started inside run on `cpus` (they inherit this thread's affinity)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    cmd = [sys.executable, "-m", "duoka.cli", "serve", MODEL, "--device", "cpu", "--port", str(port),
           "--max-model-len", str(MAX_MODEL_LEN)]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_on(SERVER_CPUS),
                                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + START_TIMEOUT_S
    while "serving " not in log.read_text():
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the server did not start in {START_TIMEOUT_S} s:\n{log.read_text()}"
        time.sleep(0.1)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(30)


def bench(duoka, *args: str):
    proc = duoka("bench", "serve", *args, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr


# ---------------------------------------------------------------- against a running server


def test_concurrency_run_reports_every_field(duoka, server, tmp_path):
    out = tmp_path / "r.json"
    proc = duoka("bench", "serve", "--url", server, "--requests", "12", "--prompt-min", "8", "--prompt-max", "32",
                 "--out-len", "8", "--concurrency", "4", "--out", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    for field in FIELDS:
        assert field in r, field
    assert r["workload"] == {"requests": 12, "prompts_file": None, "prompt_min": 8, "prompt_max": 32, "vocab": VOCAB,
                             "out_len": 8, "seed": 0, "concurrency": 4, "request_rate": None, "duration_s": None,
                             "warmup": 1}
    assert (r["model"], r["completed"], r["failed"]) == (MODEL, 12, 0)
    prompts = loadgen.random_prompts(12, 8, 32, VOCAB, 0)
    assert r["output_tokens"] == 12 * 8 and r["prompt_tokens"] == sum(map(len, prompts))  # ignore_eos: all 8
    assert r["total_tokens_per_s"] == pytest.approx((r["prompt_tokens"] + 96) / r["wall_s"])
    assert r["output_tokens_per_s"] == pytest.approx(96 / r["wall_s"])
    assert r["request_throughput"] == pytest.approx(12 / r["wall_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert 0 < r[key]["median"] <= r[key]["p99"], (key, r[key])
    assert r["ttft_ms"]["p99"] <= r["e2el_ms"]["p99"] and r["ttft_ms"]["mean"] < r["e2el_ms"]["mean"]
    assert r["tpot_ms"]["mean"] < r["e2el_ms"]["mean"]
    slowest = r["slowest_first_tokens"]  # the five longest waits, longest first, with when each was sent
    ttfts = [s["ttft_ms"] for s in slowest]
    assert len(ttfts) == 5 and ttfts == sorted(ttfts, reverse=True), slowest
    assert ttfts[-1] >= r["ttft_ms"]["median"] and ttfts[0] >= r["ttft_ms"]["p99"] - 1e-6, (slowest, r["ttft_ms"])
    assert all(0 <= s["sent_s"] <= r["wall_s"] for s in slowest), slowest
    assert (r["peer_total_tokens_per_s"], r["vs_peer"], r["batch1_tokens_per_s"], r["peer"]) == (None, None, None, None)
    assert r["command"].startswith("duoka bench serve --url http://127.0.0.1:") and r["server_command"] is None
    assert "time to first token" in proc.stderr and "total tok/s" in proc.stderr
    assert f"slowest first tokens: {slowest[0]['ttft_ms']:.0f} ms (sent at {slowest[0]['sent_s']:.1f} s)" in proc.stderr
    assert "duoka bench serve: 12/12 requests done (0 failed), 96 output tokens" in proc.stderr  # progress


def test_the_vocabulary_comes_from_the_server(in_process, server, monkeypatch):
    """A served name that is no folder here (the bundled model as plain `duoka serve` names
    it, a hub id served elsewhere): random prompts draw from the vocab_size /v1/models gives."""
    import duoka.bench.serving

    monkeypatch.setattr(duoka.bench.serving, "_model_config", lambda name: None)
    proc = in_process("bench", "serve", "--url", server, "--requests", "2", "--prompt-min", "4", "--prompt-max", "8",
                      "--out-len", "2", "--warmup", "0")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["workload"]["vocab"] == VOCAB


def test_request_rate_over_a_duration_with_a_prompts_file(duoka, server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "def f(x):"}\n\n{"prompt": [5, 6, 7, 8], "max_tokens": 3}\n')
    r, _ = bench(duoka, "--url", server, "--prompts", str(prompts), "--request-rate", "40", "--duration", "0.25",
                 "--out-len", "6", "--warmup", "0")
    n = len(loadgen.poisson_arrivals(40, 0, duration_s=0.25))
    w = r["workload"]
    assert (w["requests"], w["request_rate"], w["duration_s"], w["concurrency"]) == (n, 40, 0.25, None)
    assert w["prompts_file"] == str(prompts) and w["prompt_min"] is None  # a text prompt: lengths unknown up front
    assert (r["completed"], r["failed"]) == (n, 0)
    assert r["output_tokens"] == sum(6 if i % 2 == 0 else 3 for i in range(n))  # the file's lines, cycled


def test_started_server_batch1_and_the_peer_side_by_side(duoka, tmp_path):
    """--model starts `duoka serve` (stopped with SIGTERM at the end); --vs-peer runs the peer
    script with the workload's sizes once the server is gone (a stand-in prints its JSON lines)."""
    argv_file = tmp_path / "peer_argv.json"
    peer = tmp_path / "fake_peer.py"
    peer.write_text(textwrap.dedent(f"""
        import json, sys
        json.dump(sys.argv[1:], open({str(argv_file)!r}, "w"))
        print("loading a model...")
        print(json.dumps(dict(case="continuous_batching", model="7b", requests=6, wall_s=2.0,
                              output_tokens_per_s=24.0, total_tokens_per_s=100.0)))
        print(json.dumps(dict(case="batch1_static_compiled", model="7b", new_tokens=8, wall_s=0.5,
                              tokens_per_s=16.0)))
    """))
    r, err = bench(duoka, "--model", MODEL, "--serve-arg", f"--device cpu --max-model-len {MAX_MODEL_LEN}",
                   "--requests", "6", "--prompt-min", "8", "--prompt-max", "16", "--out-len", "8", "--batch1",
                   "--vs-peer", "--peer", str(peer), "--peer-model", "7b")
    assert (r["completed"], r["output_tokens"]) == (6, 48)
    assert r["server_command"].startswith("duoka serve " + MODEL) and "--max-model-len 256" in r["server_command"]
    assert r["batch1_tokens_per_s"] > 0 and len(r["batch1"]["runs_tokens_per_s"]) == loadgen.BATCH1_RUNS
    assert r["peer_total_tokens_per_s"] == 100.0 and r["peer_batch1_tokens_per_s"] == 16.0
    assert r["vs_peer"] == pytest.approx(r["total_tokens_per_s"] / 100.0)
    assert json.loads(argv_file.read_text()) == ["--model", "7b", "--requests", "6", "--prompt-min", "8",
                                                 "--prompt-max", "16", "--out-len", "8", "--case", "both"]
    assert "duoka / peer" in err
    port = int(r["server_command"].split("--port ")[1].split()[0])
    with pytest.raises(httpx.ConnectError):  # the started server is gone
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)


# ---------------------------------------------------------------- user errors, in process


def test_a_bad_url_is_one_clear_error(in_process):
    r = in_process("bench", "serve", "--url", f"http://127.0.0.1:{free_port()}", "--requests", "2")
    assert r.returncode == 2
    assert "error: no server answers at http://127.0.0.1:" in r.stderr and "fix: start the server first" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, cause", [
    (["--duration", "5"], "--duration needs --request-rate"),
    (["--vs-peer", "--seed", "1"], "the peer's prompts are drawn with seed 0"),
    (["--vs-peer", "--request-rate", "4"], "the peer runs only its random prompts"),
    (["--url", "http://x", "--serve-arg", "--device cpu"], "the server is already running"),
    (["--serve-arg", "--port 9"], "picks the address of the server it starts"),
])
def test_contradictory_options_are_refused_before_anything_starts(in_process, args, cause):
    r = in_process("bench", "serve", "--peer", __file__, "--peer-model", "7b", *args)
    assert r.returncode == 2 and cause in r.stderr, r.stderr


@pytest.mark.parametrize("command", [["bench", "serve", "--peer-model", "7b"], ["bench", "--model", "qwen2-0.5b"]])
def test_an_installed_duoka_has_no_peer_and_says_what_to_pass(in_process, monkeypatch, tmp_path, command):
    """--vs-peer's default is bench/peers/ of the repository duoka runs from, never a path
    outside it: from site-packages (no repository) the peer must be given, before anything runs."""
    import duoka.bench.training

    monkeypatch.setattr(duoka.bench.training, "ROOT", tmp_path / "site-packages")
    assert duoka.bench.training.repository_peer("serve_peer.py") is None
    r = in_process(*command, "--vs-peer")
    assert r.returncode == 2 and "installed without the repository" in r.stderr, r.stderr
    assert "pass --peer PATH/" in r.stderr and "duoka bench:" not in r.stderr


def test_training_bench_parses_as_before():
    from duoka.cli import build_parser

    a = build_parser().parse_args(["bench", "--model", "debug", "--layout", "fsdp", "--vs-peer", "--out", "x.json"])
    assert (a.func.__name__, a.model, a.layout, a.vs_peer, a.out, a.bench_mode) == \
        ("run_bench", "debug", "fsdp", True, "x.json", None)


# ---------------------------------------------------------------- the client's arithmetic


def test_random_prompts_are_the_peers():
    """The peer script's workload(requests=20, prompt_min=3, prompt_max=40, vocab=1000), seed 0,
    as bench/peers/serve_peer.py prints them (the test does not run the peer: transformers'
    continuous batching takes minutes on a CPU)."""
    prompts = loadgen.random_prompts(20, 3, 40, 1000, 0)
    assert [len(p) for p in prompts][:8] == [27, 29, 5, 19, 35, 34, 28, 22]
    assert prompts[0][:5] == [318, 102, 748, 76, 921] and prompts[-1][-3:] == [507, 730, 660]


def test_percentiles_interpolate_like_numpy():
    import numpy as np

    values = [0.3, 0.01, 0.2, 0.7, 0.05, 0.11, 0.9]
    for q in (0, 37, 50, 99, 100):
        assert loadgen.percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    s = loadgen.spread_ms(values)
    assert s["mean"] == pytest.approx(1e3 * sum(values) / 7) and s["median"] == pytest.approx(200.0)


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    a = loadgen.poisson_arrivals(4.0, 0, requests=4000)
    assert a == loadgen.poisson_arrivals(4.0, 0, requests=4000) != loadgen.poisson_arrivals(4.0, 1, requests=4000)
    assert a == sorted(a) and len(a) / a[-1] == pytest.approx(4.0, rel=0.05)
    within = loadgen.poisson_arrivals(4.0, 0, duration_s=120)
    assert within == a[:len(within)] and within[-1] < 120 <= a[len(within)]


# ---------------------------------------------------------------- an outside client


def test_guidellm_agrees_on_output_throughput(server):
    """guidellm reads duoka serve's streams without an error, gets every output token, and
    measures the output tokens/s duoka bench serve measures, within 20%: both clients at once
    (two streams each) on the same prompts, so each sees the server in the same seconds. On
    this CPU server one run's speed drifts by up to 20% from the next, which made two runs one
    after the other disagree by 0.85-1.26 (and random ids against guidellm's text made loads
    ~20% apart: a token's cost depends on the text generated); at once, five runs gave ratios
    of 0.87-1.05, and beside two busy processes 0.82-0.87 and 1.14, as one client ran alone
    while the other started. Ours now starts once guidellm's first request is in (check): beside
    two busy processes 1.00-1.03. The 20% stays for a loaded machine's drift within a run; it
    still catches a client that counts wrongly (text events instead of tokens gave a 37x error).

    On a slower 2-core machine with other work running, guidellm took 85 s for what ours did in
    52 (1.61x) while both read the same streams alike (inter-token median 23.9 against 24.2 ms,
    first token 102 against 102 ms): its own time between requests, not the server. So the
    streams' cadence is held to 20% and the whole-run rate to a factor of 2, which still
    catches the 37x miscount."""
    sys.path.insert(0, str(ROOT))
    from bench.serve_guidellm_check import check, find_guidellm

    guidellm = find_guidellm()
    if guidellm is None:
        pytest.skip("guidellm is not installed (pip install guidellm, or set $GUIDELLM to its executable)")
    with clients_on(CLIENT_CPUS):
        r = check(server, MODEL, MODEL, guidellm, requests=32, prompt_len=32, out_len=128, concurrency=2,
                  tolerance=1.0, workers=1)
    assert r["guidellm"]["requests"] == {"successful": 32, "errored": 0, "incomplete": 0, "total": 32}
    assert r["agree"] and r["ratio_ours_over_guidellm"] >= 0.5, json.dumps(r, indent=1)  # every token, within 2x
    itl = r["guidellm"]["itl_ms_median"] / r["duoka_bench_serve"]["itl_ms"]["median"]
    assert abs(itl - 1) <= 0.20, json.dumps(r, indent=1)
