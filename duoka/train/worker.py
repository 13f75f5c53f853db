"""A worker process's life: join the process group, train, and leave an error where the
launcher finds it (one clear message instead of a traceback from every rank)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from duoka import runtime
from duoka.errors import DuokaError
from duoka.train.spec import RunSpec
from duoka.train.trainer import Trainer


class StopRequest:
    """SIGTERM (a preempted job) asks the trainer to finish its step, save and stop. The
    handler is installed for the worker's life only: a one-process run trains inside the
    `duoka train` process itself, which must die on SIGTERM again afterwards."""

    def __init__(self):
        self.requested = False

    def _on_signal(self, signum, frame) -> None:
        self.requested = True

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach the main thread only
            return
        previous = signal.signal(signal.SIGTERM, self._on_signal)
        try:
            yield self
        finally:
            signal.signal(signal.SIGTERM, previous)


def init_distributed() -> torch.device:
    """This process's device, and the default process group (NCCL on GPUs, gloo on CPU)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world, **kwargs)
    return device


def worker_main(spec: RunSpec) -> None:
    """Entry point of each worker process (started by the elastic launcher or in process)."""
    rank = int(os.environ.get("RANK", 0))
    stop = StopRequest()
    try:
        with stop.installed():
            Trainer(spec, init_distributed(), stop).train()
        if stop.requested and "TORCHELASTIC_RUN_ID" in os.environ:
            # The agent is shutting down on SIGTERM and joins its workers without releasing
            # them normally; the checkpoint is saved, so leave at once.
            dist.destroy_process_group()
            runtime.hard_exit(0)
    except DuokaError as e:
        report_error(spec.run_dir, rank, e.cause, e.fix)
        raise SystemExit(2)
    except torch.OutOfMemoryError:
        training = spec.cfg.training
        report_error(spec.run_dir, rank,
                     f"CUDA out of memory on rank {rank} (micro-batch {training.micro_batch_size}, "
                     f"seq_len {training.seq_len})",
                     "lower training.micro_batch_size (or set it to auto), set training.activation_checkpointing="
                     "full, or shard with parallel.dp_mode=fsdp")
        raise SystemExit(2)
    except Exception:
        report_error(spec.run_dir, rank, f"worker {rank} crashed:\n{traceback.format_exc()}", None)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def report_error(run_dir: str, rank: int, cause: str, fix: str | None) -> None:
    path = Path(run_dir) / f"error-rank{rank}.json"
    with contextlib.suppress(OSError):
        path.write_text(json.dumps({"rank": rank, "cause": cause, "fix": fix}))
