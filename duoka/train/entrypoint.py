"""A worker process's life: join the process group, train, and leave an error where the
launcher finds it (one clear message instead of a traceback from every rank).

Under the launcher's elastic agent a worker is a child of the worker server (multiprocessing's
fork server), not of the launcher. It lives exactly as long as the launcher (die_with_launcher),
takes SIGTERM and SIGINT as a request to save and stop (StopRequest), and when the agent
restarts its group after a failure it resumes from the newest intact checkpoint
(agree_on_resume)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from duoka.errors import DuokaError, file_error
from duoka.host.lifetime import die_with_launcher, leave_after_return
from duoka.train.checkpoint_io import find_resume_checkpoint, read_train_state
from duoka.train.oom_advice import oom_cause, oom_fix
from duoka.train.run_files import error_report_path, write_error_report
from duoka.train.spec import RunSpec
from duoka.train.trainer import Trainer
from duoka.train.watchdog import process_group_timeout

# A rank that lost a peer (its collective failed because another rank died) waits this long
# before it exits: the agent checks its workers every 0.1 s and reports the first exit it
# finds, which is then the rank that died first, not this consequence of it.
LOST_PEER_DELAY_S = 1.0
# What gloo and NCCL say when a peer's process is gone (a RuntimeError, not DistError).
_LOST_PEER = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "communicator was aborted")


class StopRequest:
    """SIGTERM (a scheduler's preemption, scancel, `timeout`) or SIGINT (Ctrl-C) asks the
    trainer to finish its step, save and stop; `signal` is the first one received. Under the
    agent a stop reaches a worker twice (sent to the process group, and forwarded by the
    agent): repeats are ignored, and the launcher ends a stop that does not finish. A
    one-process run trains inside `duoka train` itself: there a second signal ends it at once.
    The handlers are installed for the worker's life only: that process must die on SIGTERM
    again afterwards."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, repeat_ends: bool = True):
        self.signal: int | None = None
        self.repeat_ends = repeat_ends

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def _on_signal(self, signum, frame) -> None:
        if self.signal is None:
            self.signal = signum
        elif self.repeat_ends:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach the main thread only
            return
        previous = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def init_distributed(reliability) -> torch.device:
    """This process's device, and the default process group (NCCL on GPUs, gloo on CPU). Its
    timeout backs up the hang watchdog: a stuck rank waits no longer than the watchdog's
    limit plus a margin, rather than gloo's 30 or NCCL's 10 minutes."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                                timeout=process_group_timeout(reliability, device.type), **kwargs)
    return device


def restart_resume_point(spec: RunSpec) -> tuple[str | None, int]:
    """Where a group restarted after a failure continues: the newest intact checkpoint of the
    run (the last one the failed group saved), or where the job started if it saved none."""
    newest = find_resume_checkpoint(Path(spec.run_dir), "auto", trust_unverified=spec.cfg.checkpoint.trust_unverified)
    if newest is None:
        return spec.resume_from, spec.resume_step
    step = read_train_state(newest)["step"]
    return (str(newest), step) if step >= spec.resume_step else (spec.resume_from, spec.resume_step)


def agree_on_resume(spec: RunSpec, device: torch.device) -> RunSpec:
    """The agent restarts a failed group with the arguments of its first start, so the resume
    point is found again here. A restart on one node can be a plain re-rendezvous on another
    (its restart count unchanged), so whether this is a restart is decided from every rank's
    count, and rank 0 chooses the checkpoint for all (an error too, so that all raise it)."""
    count = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))], device=device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if int(count.item()) == 0:
        return spec
    choice: list = [None]
    if dist.get_rank() == 0:
        try:
            choice[0] = restart_resume_point(spec)
        except DuokaError as e:
            choice[0] = e
    dist.broadcast_object_list(choice, src=0, device=device)
    if isinstance(choice[0], DuokaError):
        raise choice[0]
    resume_from, resume_step = choice[0]
    return dataclasses.replace(spec, resume_from=resume_from, resume_step=resume_step)


def worker_main(spec: RunSpec) -> int | None:
    """Entry point of each worker process (started by the elastic agent or in process).
    Returns the signal that stopped training early, None when it ran to the end."""
    rank = int(os.environ.get("RANK", 0))
    under_agent = "TORCHELASTIC_RUN_ID" in os.environ
    if under_agent:
        die_with_launcher()
        # The worker server ignores SIGTERM (a signal to the whole job must not end it) and
        # its children inherit that; here SIGTERM ends the process again unless a stop is asked.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        with contextlib.suppress(FileNotFoundError):
            error_report_path(spec.run_dir, rank).unlink()  # the failed group's, before a restart
    stop = StopRequest(repeat_ends=not under_agent)
    try:
        with stop.installed():
            device = init_distributed(spec.cfg.reliability)
            if under_agent:  # only the agent restarts a group
                spec = agree_on_resume(spec, device)
            Trainer(spec, device, stop).train()
    except DuokaError as e:
        report_error(spec.run_dir, rank, e.cause, e.fix)
        raise SystemExit(2)
    except torch.OutOfMemoryError as e:
        report_error(spec.run_dir, rank, oom_cause(spec.cfg, rank, e), oom_fix(spec.cfg, spec.world_size))
        raise SystemExit(2)
    except Exception as e:
        if (error := file_error(e)) is not None:  # a full disk, a read-only folder: the user's to mend
            report_error(spec.run_dir, rank, error.cause, error.fix)
            raise SystemExit(2) from None
        lost_peer = any(phrase in str(e) for phrase in _LOST_PEER)
        report_error(spec.run_dir, rank, f"worker {rank} crashed:\n{traceback.format_exc()}", None, lost_peer)
        if lost_peer:
            time.sleep(LOST_PEER_DELAY_S)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if under_agent:
        leave_after_return()
    return stop.signal


def report_error(run_dir: str, rank: int, cause: str, fix: str | None, lost_peer: bool = False) -> None:
    """The error file the launcher reads; `lost_peer`: a consequence of another rank's death."""
    write_error_report(run_dir, rank, cause, fix, lost_peer=lost_peer)
