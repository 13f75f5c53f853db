"""`duoka serve --tp 2` as a user runs it: the launcher starts two CPU ranks over gloo, rank 0
serves; greedy answers equal one process's; SIGTERM drains and every process is gone.
A size the model's heads cannot take is refused before any process starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from duoka.host.ports import free_port
from duoka.serve.engine import LLM
from duoka.serve.params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["The quick brown fox", "def add(a, b):", "Return the", "多卡训练 means"]
START_TIMEOUT_S = 120


def _children(pid: int) -> set[int]:
    """Every descendant of pid, from /proc (no psutil needed)."""
    found, todo = set(), [pid]
    while todo:
        for task in Path(f"/proc/{todo.pop()}/task").glob("*"):
            try:
                kids = {int(k) for k in (task / "children").read_text().split()}
            except OSError:
                continue
            todo.extend(kids - found)
            found |= kids
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"  # a zombie has ended
    except OSError:
        return False


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("serve_tp") / "server.log"
    cmd = [sys.executable, "-m", "duoka.cli", "serve", "--tp", "2", "--device", "cpu", "--port", str(port),
           "--max-model-len", "256", "--served-model-name", "tiny"]
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + START_TIMEOUT_S
    while "serving tiny" not in log.read_text():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    yield proc, port, log
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_two_ranks_answer_as_one_process_and_stop_cleanly(tp_server):
    proc, port, log = tp_server
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=60)

    def ask(prompt):
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True})
        return r.choices[0].text

    with ThreadPoolExecutor(4) as pool:
        served = list(pool.map(ask, PROMPTS))
    one = LLM(None, device="cpu", max_model_len=256, log=lambda m: None)
    want = [c.text for c in one.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))]
    assert served == want

    ranks = {pid for pid in _children(proc.pid) if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()}
    assert len(ranks) == 2
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0, log.read_text()
    deadline = time.monotonic() + 10
    while [pid for pid in ranks if _alive(pid)]:
        assert time.monotonic() < deadline, "a rank outlived the launcher"
        time.sleep(0.1)
    assert "Traceback" not in log.read_text()


def test_a_size_the_heads_cannot_take_is_refused_before_starting(in_process):
    proc = in_process("serve", "--tp", "4", "--device", "cpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "over 4 processes" in proc.stderr
    assert "fix: use a tp that divides it: 1, 2" in proc.stderr  # 6 heads and 2 KV heads
