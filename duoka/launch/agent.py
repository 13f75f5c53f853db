"""torchrun's elastic agent (torch.distributed.launcher), as duoka starts it: c10d rendezvous
on one node or many, a worker per process, signals forwarded, and a failed group restarted
from the newest intact checkpoint (--max-restarts). One message explains a failure: the
rank that failed first, with its own error or its signal or exit code.

Training's and serving's launches both start their workers here (launch/training.py,
launch/serving.py); the agent never imports what the workers run: each launch hands it
its entry function."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Callable

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from duoka import runtime
from duoka.errors import DuokaError
from duoka.host.ports import free_port, parse_endpoint, port_is_free
from duoka.launch.exits import EXIT_USER_ERROR, EXIT_WORKER_DIED, WorkerFailed
from duoka.state_files import cut_torn_tail
from duoka.train.run_files import RESTARTS_LOG, last_logged_step, read_error_reports

LOOPBACK = "127.0.0.1"  # where a single node's stores listen: nothing outside the host needs them
# The signals the agent installs handlers for (raising SignalException), never putting the old ones back.
AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def run_training_agent(entry: Callable, spec, restart_point: Callable, nproc_per_node: int, nnodes: int,
                       node_rank: int, rdzv_endpoint: str | None, max_restarts: int, log) -> int | None:
    """Run `entry(spec)` in every worker of this node to the end. Returns the signal that
    stopped them early (None: they ran to the end); a failure raises its explanation.
    restart_point(spec) -> (checkpoint, step) tells a restart where the group resumes."""
    endpoint = training_endpoint(rdzv_endpoint, nnodes, node_rank, log)
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node,
        # Every node derives the same id from the endpoint they share.
        run_id=os.environ.get("DUOKA_RUN_ID") or str(uuid.uuid5(uuid.NAMESPACE_URL, endpoint)),
        # torch's c10d rendezvous with a fresh worker store at each restart; on one node its
        # stores listen on the loopback address only (runtime.register_rendezvous).
        rdzv_backend=runtime.register_rendezvous(), rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": node_rank == 0, "join_timeout": 600} if nnodes > 1 else {"is_host": True},
        local_addr=LOOPBACK if nnodes == 1 else None,
        max_restarts=max_restarts, monitor_interval=0.1, start_method="forkserver",
        **shutdown_timeout(),
    )
    quiet_agent_logs()
    restarts = Restarts(spec, restart_point, max_restarts, node_rank, log)
    with kept_signal_handlers():
        try:
            with runtime.elastic_agent_hooks(restarts.after_failure):
                returned = elastic_launch(config, entry)(spec)
            return next((r for r in returned.values() if r), None)
        except SignalException as e:
            # The agent forwarded it to the workers, which saved (or not) within the grace period.
            # A second signal lands here too, at once: the workers then end with the worker server.
            return int(e.sigval)
        except ChildFailedError as e:
            raise explain_failure(e.failures, spec.run_dir) from None


def training_endpoint(rdzv_endpoint: str | None, nnodes: int, node_rank: int, log) -> str:
    """The rendezvous endpoint: --rdzv-endpoint across nodes; on one node the loopback
    address, on the port given if it is free (else another, said on the console)."""
    if rdzv_endpoint is None:
        return f"{LOOPBACK}:{free_port()}"
    host, port = parse_endpoint(rdzv_endpoint)
    endpoint = rdzv_endpoint if nnodes > 1 else f"{LOOPBACK}:{port}"
    if node_rank == 0 and not port_is_free(host if nnodes > 1 else LOOPBACK, port):
        if nnodes > 1:
            raise DuokaError(f"rendezvous port {port} on {host} is already in use (another job, or a stale one)",
                             f"pick another port for every node, e.g. --rdzv-endpoint {host}:{free_port()}")
        new = free_port()
        log(f"duoka: rendezvous port {port} is in use; using {new} instead")
        endpoint = f"{LOOPBACK}:{new}"
    return endpoint


@contextlib.contextmanager
def kept_signal_handlers():
    """Put back the signal handlers the agent replaces (it installs its own and leaves them)."""
    handlers = {s: signal.getsignal(s) for s in AGENT_SIGNALS}
    try:
        yield
    finally:
        for s, handler in handlers.items():
            with contextlib.suppress(ValueError):  # ValueError: not the main thread (nor was the agent's)
                signal.signal(s, handler)


def shutdown_timeout(seconds: int | None = None) -> dict:
    """On SIGTERM or SIGINT the agent forwards it to the workers, which finish their step and
    save a checkpoint; it gives them DUOKA_SHUTDOWN_TIMEOUT seconds (600; `seconds` if given)
    before its SIGKILL, so a stop that hangs still ends. LaunchConfig takes the grace period in
    recent torch (2.13 here); older ones (2.11) keep their default: then {}."""
    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return {}
    return {"shutdown_timeout": seconds if seconds is not None else int(os.environ.get("DUOKA_SHUTDOWN_TIMEOUT", "600"))}


def quiet_agent_logs() -> None:
    """The elastic agent logs every worker exit with a traceback of its own polling code, and
    torch.multiprocessing each worker it terminates. A failing worker already leaves its cause
    (and, for a crash, its traceback) in the run directory, and the agent's record says which
    rank died first and how; together they make the one message the user reads."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


class Restarts:
    """--max-restarts: each failure the agent restarts the group after is recorded in
    RUN/restarts.jsonl (node 0) with what it cost, and told on the console. A worker's own
    error (exit code 2: config, data, a damaged checkpoint) is final: a restart would meet it
    again."""

    def __init__(self, spec, restart_point: Callable, max_restarts: int, node_rank: int, log):
        self.spec, self.restart_point = spec, restart_point
        self.max_restarts, self.node_rank, self.log = max_restarts, node_rank, log
        self.done = 0

    def after_failure(self, failures: dict) -> bool:
        """Called by the agent once the failed group's workers on this node have all exited;
        returns whether a restart may follow."""
        failure = explain_failure(failures, self.spec.run_dir)
        if failure.exit_code == EXIT_USER_ERROR:
            return False
        if self.done == self.max_restarts:
            return True  # the agent gives up; the launcher explains the failure
        self.done += 1
        run_dir = Path(self.spec.run_dir)
        last = last_logged_step(run_dir)
        try:
            resume_from, resume_step = self.restart_point(self.spec)
        except DuokaError:  # no intact checkpoint: the restarted workers say so, once each
            resume_from, resume_step = None, None
        lost = last - resume_step if resume_step is not None and last is not None else None
        rank, first = min(failures.items(), key=lambda item: item[1].timestamp)
        record = {"time": time.time(), "restart": self.done, "max_restarts": self.max_restarts, "rank": rank,
                  "exit_code": first.exitcode, "signal": first.signal_name() if first.exitcode < 0 else None,
                  "cause": failure.cause, "last_step": last, "resume_from": resume_from,
                  "resume_step": resume_step, "steps_lost": lost}
        if self.node_rank == 0:
            log_path = run_dir / RESTARTS_LOG
            cut_torn_tail(log_path, lambda message: self.log(f"duoka: warning: {message}"))
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        self.log(f"duoka: {failure.cause.splitlines()[0]}; restart {self.done} of {self.max_restarts} from "
                 f"step {resume_step} ({lost} step(s) lost)")
        return True


def explain_failure(failures: dict, run_dir: str) -> WorkerFailed:
    """One message for a failed group, naming the rank that failed first. The agent reports
    the first exit it saw (with its signal or exit code); a rank that only lost a peer leaves
    a moment later (entrypoint.LOST_PEER_DELAY_S), so that is the rank that died first."""
    reports = read_error_reports(run_dir)
    if any(not r.get("lost_peer") for r in reports.values()):
        return reported_failure(reports)
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    step = last_logged_step(Path(run_dir))
    when = f" after step {step}" if step is not None else " before its first step ended"
    resume = f"continue with --checkpoint.resume=auto --job.output_dir={run_dir} (or let --max-restarts N restart it)"
    if failure.exitcode < 0:
        name = failure.signal_name()
        if -failure.exitcode == signal.SIGKILL:
            return WorkerFailed(f"rank {rank} was killed by SIGKILL{when} (killed by the OS, out of host memory?)",
                                f"look for the OOM killer in the kernel log (dmesg); {resume}", EXIT_WORKER_DIED)
        return WorkerFailed(f"rank {rank} was killed by {name}{when}", resume, EXIT_WORKER_DIED)
    if failure.exitcode == EXIT_USER_ERROR:  # its report could not be written: the disk is full?
        return WorkerFailed(f"rank {rank} stopped with an error{when} that it could not write to {run_dir} (a full "
                            "disk?): its message is above", "mend what the message names; then " + resume,
                            EXIT_USER_ERROR)
    if rank in reports:  # it lost a peer, and no other rank said why
        lost = reports[rank]["cause"].strip().splitlines()[-1]
        return WorkerFailed(f"rank {rank} lost contact with the other ranks{when} ({lost}); the rank that died first "
                            "left no error", resume, EXIT_WORKER_DIED)
    return WorkerFailed(f"rank {rank} exited with code {failure.exitcode}{when} without leaving an error", resume,
                        EXIT_WORKER_DIED)


def reported_failure(reports: dict[int, dict]) -> WorkerFailed:
    """The errors workers wrote themselves; those of ranks that only lost a peer are left out."""
    causes = {rank: r for rank, r in sorted(reports.items()) if not r.get("lost_peer")} or dict(sorted(reports.items()))
    # A hang explains the rest: its declaring rank killed the stuck peers, whose collectives broke.
    hung = {rank: r for rank, r in causes.items() if r.get("kind") == "hang"}
    causes = hung or causes
    first = next(iter(causes.values()))
    ranks = ", ".join(str(rank) for rank in causes)
    # A reported error with a fix is the user's to mend; one without is a crash (a bug).
    code = first.get("exit_code") or (EXIT_USER_ERROR if first.get("fix") else EXIT_WORKER_DIED)
    return WorkerFailed(f"training stopped on rank(s) {ranks}: {first['cause']}", first.get("fix"), code)
