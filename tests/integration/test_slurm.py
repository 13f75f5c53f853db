"""`duoka train` under a real Slurm (Debian's slurm-wlm and munge; .ci/run installs them).

The fixture starts munge, slurmctld and two slurmd on this machine from a generated
slurm.conf: two nodes named 127.0.0.1 and 127.0.0.2, both loopback addresses, so that the
rendezvous host taken from the job's node list resolves and reaches node 0. A batch script
written by `duoka train --slurm-script` trains on the two nodes (one CPU process each, so the
detection of nodes, ranks and rendezvous is the multi-node path), is requeued mid-run with
`scontrol requeue`, then gets the time-limit warning (its USR1), saves and requeues itself,
and finishes by itself with the losses of an uninterrupted run. Every daemon started here,
and every process of their jobs, is stopped at the end, whatever happened.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from duoka.host.ports import free_port
from duoka.launch.cluster import SLURM_RDZV_PORT_BASE, SLURM_RDZV_PORT_SPAN, expand_hostlist
from duoka.monitor.dashboard import read_records

NODES = ("127.0.0.1", "127.0.0.2")  # node 0 first: Slurm orders a job's nodes as slurm.conf lists them
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
SBIN = "/usr/sbin:/sbin"  # where Debian puts the daemons; a non-login root shell may lack it in PATH
STEPS = 16
TRAIN = ("--model.flavor=debug", "--training.seq_len=32", "--training.global_batch_size=4", "--training.dtype=fp32",
         f"--training.steps={STEPS}", "--checkpoint.interval=2", "--metrics.log_interval=100",
         "--checkpoint.export_final=false")
# Each rank waits 9x its compute per step (~0.3 s a step here), so that the requeue and the
# warning land mid-run; the waits change no number.
SLOW = "--debug.slow_ranks=0:0.1,1:0.1"
# Same thread count in the Slurm job and the reference: a different BLAS split changes the sums.
THREADS = {"OMP_NUM_THREADS": "1"}


def _path() -> str:
    return f"{os.environ.get('PATH', '')}:{SBIN}"


def _unusable() -> str | None:
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs, and these tests are not root"
    missing = [tool for tool in TOOLS if not shutil.which(tool, path=_path())]
    if missing:
        return (f"Slurm is not installed (no {', '.join(missing)}): apt-get install slurm-wlm munge, "
                "as .ci/run does")
    return None


class LocalSlurm:
    """munged, slurmctld and one slurmd per node in `root`, each in its own session, with a
    marker in its environment that the processes of its jobs inherit too (slurmstepd from
    slurmd, the jobs from sbatch's environment): stop() ends all of them."""

    def __init__(self, root: Path):
        self.root = root
        self.marker = f"DUOKA_TEST_SLURM={root}"
        self.conf = root / "slurm.conf"
        self.env = {**os.environ, "PATH": _path(), "SLURM_CONF": str(self.conf), "DUOKA_TEST_SLURM": str(root)}
        self.daemons: dict[str, subprocess.Popen] = {}

    def start(self) -> None:
        root = self.root
        for folder, mode in (("munge", 0o700), ("run", 0o755), ("log", 0o755), ("state", 0o755)):
            (root / folder).mkdir(mode=mode)
        # munged checks that every folder above its socket is searchable by all.
        root.chmod(0o755)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))  # munge's own key size
        key.chmod(0o600)
        munge_socket = root / "run" / "munge.socket"
        self._daemon("munged", ["munged", "--foreground", f"--socket={munge_socket}", f"--key-file={key}",
                                f"--log-file={root / 'munge' / 'log'}", f"--pid-file={root / 'run' / 'munged.pid'}",
                                f"--seed-file={root / 'munge' / 'seed'}"])
        _wait(munge_socket.exists, "munged's socket", 15, self)
        ports = [free_port() for _ in range(1 + len(NODES))]
        nodes = "\n".join(f"NodeName={name} Port={port} CPUs={os.cpu_count()} State=UNKNOWN"
                          for name, port in zip(NODES, ports[1:]))
        for name in NODES:
            (root / "spool" / name).mkdir(parents=True)
        self.conf.write_text(f"""\
ClusterName=duokatest
SlurmctldHost={socket.gethostname().split('.')[0]}(127.0.0.1)
SlurmctldPort={ports[0]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket}
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool'}/%n
SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}
SlurmdPidFile={root / 'run' / 'slurmd-%n.pid'}
SlurmctldLogFile={root / 'log' / 'slurmctld.log'}
SlurmdLogFile={root / 'log' / 'slurmd-%n.log'}
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
# SIGTERM to SIGKILL when a job is requeued or cancelled: the time a save has
KillWait=30
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self._daemon("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for name in NODES:
            self._daemon(f"slurmd {name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        _wait(lambda: self.run("sinfo", "-h", "-N", "-o", "%T").stdout.split() == ["idle"] * len(NODES),
              "both nodes idle", 60, self)

    def _daemon(self, name: str, command: list[str]) -> None:
        with open(self.root / "log" / f"{name.replace(' ', '-')}.out", "w") as out:
            self.daemons[name] = subprocess.Popen(command, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                                  start_new_session=True)

    def run(self, *command: str, check: bool = False, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A Slurm command against this cluster; env: more variables (sbatch hands them to the job)."""
        proc = subprocess.run(command, env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60)
        if check:
            assert proc.returncode == 0, f"{' '.join(command)}: {proc.stderr}"
        return proc

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", job_id).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text()[-2000:] for p in sorted((self.root / "log").iterdir()))

    def stop(self) -> None:
        """Jobs first (their processes are outside the daemons' sessions), then the daemons,
        then anything of theirs left: SIGKILL to every process that carries the marker."""
        with contextlib.suppress(Exception):
            if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
                self.run("scancel", "--partition=debug")
                _wait(lambda: not self.run("squeue", "-h").stdout.strip(), "the jobs to end", 40)
        for proc in self.daemons.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.daemons.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for pid in marked(self.marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait(lambda: not marked(self.marker), "the Slurm processes to end", 15)


def marked(marker: str) -> list[int]:
    """Live processes whose environment holds the marker (the daemons, slurmstepd, jobs)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() + b"\0" in (entry / "environ").read_bytes() + b"\0" and \
                        (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _wait(condition, what: str, timeout: float, cluster: LocalSlurm | None = None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if result := condition():
            return result
        time.sleep(0.2)
    logs = f"\n{cluster.logs()}" if cluster else ""
    raise AssertionError(f"timed out after {timeout} s waiting for {what}{logs}")


@pytest.fixture(scope="module")
def slurm():
    reason = _unusable()
    if reason:
        pytest.skip(reason)
    cluster = LocalSlurm(Path(tempfile.mkdtemp(prefix="duoka-slurm-")))
    try:
        try:
            cluster.start()
        except (AssertionError, OSError) as e:
            pytest.skip(f"a local Slurm could not be started here: {str(e)[-3000:]}")
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(cluster.root, ignore_errors=True)


def steps_logged(run: Path) -> list[int]:
    path = run / "metrics.jsonl"  # read_records skips a line being written
    return [r["step"] for r in read_records(path)] if path.exists() else []


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def requeued(slurm, duoka, tmp_path_factory):
    """The Slurm job through a requeue and a time-limit warning, and beside it the reference (2
    processes, one node, no scheduler); returns what the tests read. The two run at once: the
    job's ranks mostly wait (SLOW), and one thread each keeps both runs' sums alike."""
    work = tmp_path_factory.mktemp("slurm-job")
    reference, reference_log = work / "reference", work / "reference.log"
    with open(reference_log, "w") as log:
        reference_proc = duoka.popen("train", f"--job.output_dir={reference}", *TRAIN, "--nproc-per-node=2",
                                     env=THREADS, stdout=log, stderr=log)
    try:
        found = _requeue_twice(slurm, duoka, work)
    finally:
        reference_code = reference_proc.wait(timeout=600)
    assert reference_code == 0, reference_log.read_text()[-3000:]
    return dict(found, reference=reference)


def _requeue_twice(slurm, duoka, work: Path) -> dict:
    """The job of `duoka train --slurm-script`: requeued by scontrol at step 4 or later, then
    sent the time-limit warning four steps after its resume, and left to finish."""
    script = work / "train.sh"
    # From the job's working directory, as a user would: the script runs there (--chdir).
    made = subprocess.run(duoka.command("train", *TRAIN, SLOW, "--nnodes=2", f"--slurm-script={script}"), cwd=work,
                          env=duoka.env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    # The job runs this checkout's duoka (PYTHONPATH) with the reference's thread count.
    job = slurm.run("sbatch", "--parsable", str(script), check=True,
                    env={"PYTHONPATH": str(duoka.root), **THREADS}).stdout.strip()
    run = work / "runs" / f"debug-slurm-{job}"
    out = work / f"slurm-{job}.out"

    def state() -> dict[str, str]:
        return slurm.job(job)

    def released(restarts: int) -> bool:
        """Slurm holds a requeued job back for two minutes (its begin time): start it now (or
        find it started, where a configuration holds it back less)."""
        info = state()
        if info.get("Restarts") != str(restarts):
            return False
        if info.get("JobState") == "PENDING":
            slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now", check=True)
            return True
        return info.get("JobState") == "RUNNING"

    def failing(what: str) -> str:
        return f"{what}; job {state()}\n{out.read_text() if out.exists() else ''}"

    try:
        # 1. Preemption's way: scontrol requeue sends SIGTERM to the steps; Slurm queues the job again.
        _wait(lambda: len(steps_logged(run)) >= 4, "step 4", 120, slurm)
        slurm.run("scontrol", "requeue", job, check=True)
        _wait(lambda: released(1), "the requeued job to wait in the queue", 60, slurm)
        first_stop = steps_logged(run)[-1]
        # 2. The time-limit warning: USR1 to the batch shell, which stops the steps and requeues.
        _wait(lambda: state().get("Restarts") == "1" and len(steps_logged(run)) >= first_stop + 4,
              f"four steps after the resume at {first_stop}", 120, slurm)
        slurm.run("scancel", "--batch", "--signal=USR1", job, check=True)
        _wait(lambda: released(2), "the job to requeue itself after the warning", 60, slurm)
        second_stop = steps_logged(run)[-1]
        _wait(lambda: state().get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"),
              "the job to end", 180, slurm)
    except AssertionError as e:
        raise AssertionError(failing(str(e))) from None
    return dict(job=job, info=state(), out=out.read_text(), run=run, script=script, stops=(first_stop, second_stop))


def test_a_requeued_job_finishes_by_itself_with_the_losses_of_an_uninterrupted_run(requeued):
    info, log = requeued["info"], requeued["out"]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), log[-4000:]
    first, second = requeued["stops"]
    assert 4 <= first < second < STEPS, requeued["stops"]  # both stops came mid-run
    assert losses(requeued["run"]) == losses(requeued["reference"])
    assert [step for step, _ in losses(requeued["run"])] == list(range(1, STEPS + 1))


def test_each_stop_saved_and_each_start_resumed(requeued):
    log = requeued["out"]
    first, second = requeued["stops"]
    # One line per node and stop; a stop saves the step it stopped at.
    for step in (first, second):
        saved = f"duoka: stopped by SIGTERM after saving step {step}; continue with --checkpoint.resume=auto " \
                f"--job.output_dir=runs/debug-slurm-{requeued['job']}"
        assert log.count(saved) == 2, log[-4000:]
        assert log.count(f"resuming from runs/debug-slurm-{requeued['job']}/checkpoints/step-{step} (step {step})") == 2
    assert "Traceback" not in log, log[-4000:]


def test_slurm_detection_line(requeued):
    job = int(requeued["job"])
    port = SLURM_RDZV_PORT_BASE + job % SLURM_RDZV_PORT_SPAN
    for rank in (0, 1):
        for restart in ("", " (restart 1)", " (restart 2)"):
            line = (f"duoka: Slurm job {job}{restart}: node {rank} of 2 (SLURM_NODEID, SLURM_STEP_NUM_NODES); "
                    f"rendezvous 127.0.0.1:{port} (first host of SLURM_STEP_NODELIST=127.0.0.[1-2], port from the "
                    f"job id); no GPU from Slurm; run directory runs/<model>-slurm-{job} unless job.output_dir is set")
            assert requeued["out"].count(line) == 1, (line, requeued["out"][-4000:])
    assert requeued["out"].count("duoka: 2 process(es) (2 node(s) x 1)") == 2 * 3  # each node, each start


def test_the_host_list_parser_agrees_with_scontrol(slurm):
    for hostlist in ("gpu[01-03,07],login1", "node[8-10]", "r[1-2]-n[098-101]", "127.0.0.[1-2]", "a,b[1],c[9-11]"):
        out = slurm.run("scontrol", "show", "hostnames", hostlist, check=True).stdout.split()
        assert expand_hostlist(hostlist) == out, hostlist
