"""A rank stopped with SIGSTOP in a 2-process run: the hang watchdog ends the job within its
timeout and a few seconds, with one message naming the step, the phase and the stopped rank,
and every rank's Python stack in the run directory."""

import os
import re
import signal
import subprocess
import time
from pathlib import Path

TIMEOUT_S = 6


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            if ppid == pid:
                found.append(int(entry.name))
    return found


def holds(pid: int, path: Path) -> bool:
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == str(path):
                return True
        except OSError:  # closed meanwhile
            pass
    return False


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stopped_rank_ends_the_job_with_one_message_and_every_stack(duoka, tmp_path):
    run = tmp_path / "run"
    proc = duoka.popen("train", f"--job.output_dir={run}", "--nproc-per-node=2", "--model.flavor=debug",
                       "--training.seq_len=32", "--training.global_batch_size=4", "--training.steps=100000",
                       "--training.dtype=fp32", f"--reliability.hang_timeout_s={TIMEOUT_S}",
                       "--checkpoint.export_final=false", "--metrics.log_interval=100000",
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    workers = []
    try:
        metrics, deadline = run / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):  # past the untimed steps
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        # The launcher -> its worker server -> the two workers.
        workers = [w for server in children(proc.pid) for w in children(server)]
        assert len(workers) == 2, workers
        rank1 = [w for w in workers if not holds(w, metrics)]  # rank 0 writes metrics.jsonl: it holds it open
        assert len(rank1) == 1, workers
        stopped = rank1[0]  # rank 0, awake, is the one to raise the straggler alert
        os.kill(stopped, signal.SIGSTOP)
        t = time.monotonic()
        _, err = proc.communicate(timeout=120)
        ended = time.monotonic() - t
        left = [pid for pid in workers if alive(pid)]
    finally:
        for pid in workers:  # whatever the outcome, leave no stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert ended < TIMEOUT_S + 8, (ended, err[-3000:])
    stacks = {int(p.stem.removeprefix("rank-")): p.read_text() for p in (run / "hang").glob("rank-*.txt")}
    assert sorted(stacks) == [0, 1], err[-3000:]
    rank = next(r for r, text in stacks.items() if f"(pid {stopped} " in text)
    assert rank == 1
    for text in stacks.values():
        assert 'File "' in text and "in _run" in text  # Python frames of every thread
    assert err.count("error: ") == 1, err[-3000:]
    error = err[err.index("error: "):]
    assert re.search(rf"step \d+ hung in the [^:]+: .*rank {rank} .*stopped by SIGSTOP", error), error
    assert f"every rank's Python stack is in {run / 'hang'}" in error and "fix: read the stacks" in error
    # Before that, rank 0 named it in a straggler alert.
    assert re.search(rf"alert \(straggler\): step \d+ has stalled .*rank {rank} not answering", err), err[-3000:]
    assert left == []  # the stopped worker too
