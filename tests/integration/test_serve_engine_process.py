"""`duoka serve` runs its engine in a process of its own (duoka/serve/engine_process.py): that
process ends with the server however the server ends, and its death fails the requests in
flight with an error their clients read, then /health and new requests say the engine is gone.
(tests/integration/test_serve_api.py runs the whole API through it.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from duoka.host.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90


def start_server(log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "duoka.cli", "serve", "--device", "cpu", "--port", str(port),
           "--max-model-len", "256", "--num-kv-blocks", "64"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + START_TIMEOUT_S
    while "serving " not in log.read_text(errors="replace"):
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()}"
        assert time.monotonic() < deadline, f"the server did not start:\n{log.read_text()}"
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}"


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


def engine_pid(server_pid: int) -> int:
    """The server's child that runs the engine (spawned by multiprocessing)."""
    pids = [c for c in children(server_pid)
            if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes()]
    assert len(pids) == 1, f"expected one engine process under the server, found {pids}"
    return pids[0]


def gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] == "Z":
            return True  # exited; its parent has not reaped it yet
        time.sleep(0.05)
    return False


@pytest.fixture
def server(tmp_path):
    proc, url = start_server(tmp_path / "server.log")
    yield proc, url, tmp_path / "server.log"
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_the_engine_process_ends_with_the_server_even_on_sigkill(server):
    proc, url, _ = server
    engine = engine_pid(proc.pid)
    body = {"model": "duoka-tiny-qwen2", "prompt": "def", "max_tokens": 4, "temperature": 0}
    assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    helpers = children(proc.pid)  # the engine and multiprocessing's resource tracker
    proc.kill()
    proc.wait()
    assert gone(engine, 10), "the engine process outlived the server"
    assert all(gone(pid, 10) for pid in helpers), "a child of the server outlived it"


def test_a_dead_engine_fails_requests_in_flight_and_says_so(server):
    proc, url, log = server
    engine = engine_pid(proc.pid)
    body = {"model": "duoka-tiny-qwen2", "prompt": "def", "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events: list[str] = []
    first = threading.Event()

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60), "no token streamed"
    os.kill(engine, signal.SIGKILL)
    reader.join(30)
    assert not reader.is_alive(), "the stream did not end after the engine died"
    assert any('"error"' in e for e in events), events[-3:]
    assert events[-1] == "data: [DONE]" or '"error"' in events[-1]
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503 and "not usable" in health.text
    again = httpx.post(url + "/v1/completions", json={**body, "stream": False}, timeout=10)
    assert again.status_code == 503
    assert "engine process is gone" in log.read_text()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
