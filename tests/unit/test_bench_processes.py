"""duoka bench's launcher runs: a run that times out takes its workers with it."""

import os
import sys
import time

import pytest

from duoka.bench.training import run_process_group
from duoka.errors import DuokaError

# A launcher that starts a worker of its own and waits, as torchrun does.
LAUNCHER = """
import subprocess, sys, time
worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print(worker.pid, flush=True)
open(sys.argv[1], "w").write(str(worker.pid))
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A killed child of an exited parent is reaped by init; until then it is a zombie.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_timeout_kills_the_launchers_workers(tmp_path):
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(DuokaError, match="ran past 3 s"):
        run_process_group([sys.executable, "-c", LAUNCHER, str(pid_file)], 3, dict(os.environ))
    worker = int(pid_file.read_text())
    deadline = time.time() + 5
    while _alive(worker) and time.time() < deadline:
        time.sleep(0.1)
    assert not _alive(worker)


def test_a_clean_run_returns_its_output():
    proc = run_process_group([sys.executable, "-c", "print('ok'); import sys; sys.exit(3)"], 30, dict(os.environ))
    assert proc.returncode == 3 and proc.stdout.strip() == "ok"
