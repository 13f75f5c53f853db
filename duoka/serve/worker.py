"""A tensor-parallel rank of `duoka serve`, started by the launcher's elastic agent (the
machinery that starts training's workers): one process per GPU, NCCL between GPUs (gloo
between CPU processes). Every rank builds the same engine, so their start-up collectives
(the sharded load, the profile step, the KV-cache agreement, the CUDA graphs) pair up; then
rank 0 serves HTTP and sends each step to the others, which run it until rank 0 stops.

Stopping: SIGTERM or SIGINT reaches rank 0 (from the agent, or to the whole process group),
which drains its requests and then releases the other ranks. Those ignore the signals: ending
first would leave rank 0's last steps without their peers. Every rank ends with the launcher.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from duoka.errors import DuokaError
from duoka.host.lifetime import die_with_launcher, leave_after_return
from duoka.serve.engine import LLMEngine
from duoka.serve.server import serve


def serve_worker_main(engine_options: dict, server_options: dict, result_file: str) -> int:
    """Entry point of each rank. Rank 0 writes how it ended to result_file: the exit code, or
    on a user error "2" and the error's lines, for the launcher to tell."""
    rank = int(os.environ["RANK"])
    die_with_launcher()
    if rank == 0:
        # The worker server ignores SIGTERM and its children inherit that; rank 0 takes it
        # (the server drains on it once it listens).
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    options = {**engine_options, "device": str(device)}
    if rank != 0:
        options["log"] = _quiet
    try:
        engine = LLMEngine(tp_group=dist.group.WORLD, **options)
        if rank != 0:
            engine.run_worker()
            return 0
        code = serve(engine, **server_options)
        Path(result_file).write_text(f"{code}\n")
        return code
    except DuokaError as e:
        if rank == 0:
            Path(result_file).write_text(f"2\n{e.cause}\n{e.fix or ''}\n")
        print(f"error: {e.cause}", file=sys.stderr)
        raise SystemExit(2)
    finally:
        dist.destroy_process_group()
        leave_after_return()


def _quiet(message: str) -> None:
    """Ranks other than 0 say nothing: rank 0 speaks for the group."""
