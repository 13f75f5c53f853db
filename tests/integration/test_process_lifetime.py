"""How a 2-process `duoka train` job lives and ends: its workers die with the launcher, a stop
by signal to the whole process group saves and exits with one line and 128 + the signal, a
run directory holds one job at a time, a killed worker is named, and with --max-restarts the
job restarts itself and ends where an uninterrupted run ends.

The processes of a job are found by a marker in their environment (the launcher's, which the
worker server and its workers inherit)."""

import contextlib
import io
import json
import os
import signal
import time
import uuid
from pathlib import Path
from unittest import mock

import pytest
from safetensors.torch import load_file

from duoka.monitor.dashboard import read_records

COMMON = ("--model.flavor=debug", "--training.seq_len=32", "--training.global_batch_size=4", "--training.dtype=fp32",
          "--nproc-per-node=2", "--checkpoint.interval=2", "--metrics.log_interval=100")
RESTART_STEPS = 12


def marked(marker: str) -> dict[int, int]:
    """pid -> parent pid of every live process whose environment holds the marker."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if f"DUOKA_TEST_MARKER={marker}".encode() not in (entry / "environ").read_bytes():
                continue
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":  # a zombie has ended; its parent has not reaped it yet
            found[int(entry.name)] = int(fields[1])
    return found


def workers(marker: str, launcher: int) -> list[int]:
    """The job's workers, in rank order: the children of the worker server (the launcher's
    child that the workers are forked from), started one after the other."""
    procs = marked(marker)
    servers = [p for p, parent in procs.items() if parent == launcher
               and b"forkserver" in Path(f"/proc/{p}/cmdline").read_bytes()]
    return sorted(p for p, parent in procs.items() if parent in servers)


def steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"  # read_records skips a line being written
    return [r["step"] for r in read_records(path)] if path.exists() else []


def wait_for(condition, what: str, timeout: float = 120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if result := condition():
            return result
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


class Job:
    """`duoka train` in its own process group (as a scheduler starts it), its output in a file:
    an orphaned worker holding a pipe would block whoever reads it to the end."""

    def __init__(self, duoka, run: Path, *args: str, env: dict[str, str] | None = None):
        self.marker, self.run = uuid.uuid4().hex, run
        self.log = run.parent / f"{run.name}-{self.marker[:8]}.log"
        with open(self.log, "w") as out:
            self.proc = duoka.popen("train", f"--job.output_dir={run}", *COMMON, *args,
                                    env={"DUOKA_TEST_MARKER": self.marker, **(env or {})}, stdout=out, stderr=out,
                                    start_new_session=True)

    def wait(self, timeout: float = 120) -> tuple[int, str]:
        code = self.proc.wait(timeout=timeout)
        return code, self.log.read_text()

    def cleanup(self):
        for pid in marked(self.marker):
            os.kill(pid, signal.SIGKILL)


def newest_checkpoint(run: Path) -> int:
    done = [int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*") if not p.name.endswith(".partial")]
    return max(done, default=0)


def in_process(*args: str) -> tuple[int, str]:
    """duoka.cli.main(args) in this process: (exit code, stderr)."""
    from duoka.cli import main

    err = io.StringIO()
    # mock.patch.dict: the launcher's worker environment stays out of later tests' processes.
    with contextlib.redirect_stderr(err), mock.patch.dict(os.environ):
        code = main(list(args))
    return code, err.getvalue()


@pytest.fixture(scope="module")
def lifetime(duoka, tmp_path_factory):
    """One run directory through a job's ends: the launcher killed (kill -9), a second
    launcher refused while a job holds the directory, the process group stopped by SIGTERM,
    and the stopped run resumed to its end."""
    run = tmp_path_factory.mktemp("lifetime") / "run"
    found = {}
    killed = Job(duoka, run, "--training.steps=1000")
    try:
        wait_for(lambda: len(steps_logged(run)) >= 3, "step 3")
        found["workers_before_kill"] = workers(killed.marker, killed.proc.pid)
        os.kill(killed.proc.pid, signal.SIGKILL)
        t = time.time()
        wait_for(lambda: not marked(killed.marker), "the job's processes to end", 10)
        found["kill_s"] = time.time() - t
    finally:
        killed.cleanup()
        killed.proc.wait()

    stopped = Job(duoka, run, "--training.steps=1000", "--checkpoint.resume=auto")
    try:
        start = newest_checkpoint(run)
        # The banner comes once the metrics of the killed job past its checkpoint are dropped.
        wait_for(lambda: f"resumed at step {start}" in stopped.log.read_text(), "the resumed job's start")
        wait_for(lambda: steps_logged(run)[-1:] >= [start + 2], "two steps after the resume")
        found["second"] = in_process("train", f"--job.output_dir={run}", *COMMON[:4], "--checkpoint.resume=auto",
                                     "--training.steps=1", "--nproc-per-node=1")
        found["holder"] = stopped.proc.pid
        os.killpg(stopped.proc.pid, signal.SIGTERM)
        found["stop_code"], found["stop_log"] = stopped.wait()
        t = time.time()  # multiprocessing's resource tracker leaves a moment after the launcher
        wait_for(lambda: not marked(stopped.marker), "the job's processes to end", 10)
        found["ended_after_stop_s"] = time.time() - t
    finally:
        stopped.cleanup()
    found["saved"] = newest_checkpoint(run)
    found["logged_at_stop"] = steps_logged(run)

    found["resumed"] = duoka("train", f"--job.output_dir={run}", *COMMON, "--checkpoint.resume=auto",
                             f"--training.steps={found['saved'] + 3}", "--checkpoint.export_final=false")
    found["run"] = run
    return found


def test_workers_die_with_a_killed_launcher(lifetime):
    assert len(lifetime["workers_before_kill"]) == 2
    assert lifetime["kill_s"] < 5


def test_a_second_job_in_a_run_directory_is_refused(lifetime):
    code, err = lifetime["second"]
    assert code == 2 and "Traceback" not in err, err
    assert f"is in use by another duoka train (pid {lifetime['holder']} on " in err
    assert "fix: " in err


def test_sigterm_to_the_process_group_saves_and_says_so_once(lifetime):
    log = lifetime["stop_log"]
    assert lifetime["stop_code"] == 143, log[-3000:]
    assert "Traceback" not in log and "SignalException" not in log, log[-3000:]
    saved = lifetime["saved"]
    assert saved == lifetime["logged_at_stop"][-1]  # the step it stopped at was saved
    lines = [line for line in log.splitlines() if line.startswith("duoka: stopped")]
    assert lines == [(f"duoka: stopped by SIGTERM after saving step {saved}; continue with "
                      f"--checkpoint.resume=auto --job.output_dir={lifetime['run']}")]
    assert lifetime["ended_after_stop_s"] < 5


def test_a_stopped_run_resumed_to_its_end_exits_0(lifetime):
    proc = lifetime["resumed"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "stopped" not in proc.stderr  # the earlier job's stop is not this one's
    saved = lifetime["saved"]
    assert steps_logged(lifetime["run"]) == list(range(1, saved + 4))


@pytest.fixture(scope="module")
def restarted(duoka, tmp_path_factory):
    """--max-restarts 1 with rank 1 killed (kill -9) after the checkpoint of step 2, and the
    same run uninterrupted."""
    root = tmp_path_factory.mktemp("restart")
    args = (f"--training.steps={RESTART_STEPS}",)
    reference = root / "reference"
    duoka.ok("train", f"--job.output_dir={reference}", *COMMON, *args)
    run = root / "run"
    job = Job(duoka, run, *args, "--max-restarts=1")
    try:
        wait_for(lambda: newest_checkpoint(run) >= 2 and len(steps_logged(run)) >= 3, "step 3")
        ranks = workers(job.marker, job.proc.pid)
        os.kill(ranks[1], signal.SIGKILL)
        code, log = job.wait()
    finally:
        job.cleanup()
    return reference, run, code, log


def test_a_killed_worker_is_restarted_and_the_run_ends_as_if_uninterrupted(restarted):
    reference, run, code, log = restarted
    assert code == 0, log[-3000:]
    (record,) = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert record["restart"] == 1 and record["rank"] == 1 and record["signal"] == "SIGKILL"
    assert record["resume_step"] >= 2 and record["steps_lost"] == record["last_step"] - record["resume_step"]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, RESTART_STEPS + 1))
    assert [r["restarts"] for r in records] == [0] * record["resume_step"] + [1] * (RESTART_STEPS - record["resume_step"])
    final, expected = (load_file(r / "hf" / f"step-{RESTART_STEPS}" / "model.safetensors") for r in (run, reference))
    assert final.keys() == expected.keys()
    assert all((final[k] == expected[k]).all() for k in expected)


def test_the_rank_that_died_first_is_named(duoka, tmp_path):
    run = tmp_path / "run"
    job = Job(duoka, run, "--training.steps=1000")
    try:
        wait_for(lambda: len(steps_logged(run)) >= 2, "step 2")
        os.kill(workers(job.marker, job.proc.pid)[1], signal.SIGKILL)
        code, log = job.wait()
    finally:
        job.cleanup()
    assert code == 1, log[-3000:]
    assert "Traceback" not in log and "Connection" not in log, log[-3000:]
    (error,) = [line for line in log.splitlines() if line.startswith("error: ")]
    assert error.startswith("error: rank 1 was killed by SIGKILL after step ")
    assert "out of host memory?" in error


def test_a_stop_that_hangs_ends_after_the_grace_period(duoka, tmp_path):
    """A stopped (SIGSTOP) worker cannot finish its step: the launcher's agent kills the
    workers after DUOKA_SHUTDOWN_TIMEOUT seconds and the job still ends with its one line."""
    run = tmp_path / "run"
    job = Job(duoka, run, "--training.steps=1000", env={"DUOKA_SHUTDOWN_TIMEOUT": "2"})
    try:
        wait_for(lambda: len(steps_logged(run)) >= 2, "step 2")
        os.kill(workers(job.marker, job.proc.pid)[1], signal.SIGSTOP)
        t = time.time()
        os.killpg(job.proc.pid, signal.SIGTERM)
        code, log = job.wait(timeout=60)
        took = time.time() - t
    finally:
        job.cleanup()
    assert code == 143, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    assert "duoka: stopped by SIGTERM before a checkpoint was saved" in log
    assert 2 <= took < 15


def test_no_workers_is_refused(in_process, tmp_path):
    for n in ("0", "-1"):
        proc = in_process("train", f"--job.output_dir={tmp_path / 'run'}", f"--nproc-per-node={n}")
        assert proc.returncode == 2 and f"--nproc-per-node {n}: a node needs at least one worker" in proc.stderr
    assert not (tmp_path / "run").exists()
