"""The process of one tensor-parallel rank of `duoka serve`, started by the launcher's elastic
agent (the machinery that starts training's workers): one process per GPU, NCCL between GPUs
(gloo between CPU processes). Rank 0 builds the LLMEngine (tokenizer, scheduler, its own
Worker) and serves HTTP; every other rank builds only a Worker (serve.worker.run_worker).
Their start-ups meet in the Workers' collectives (the sharded load, the profile step, the
KV-cache agreement, the CUDA graphs); then rank 0 sends each step to the others, which run
it until rank 0 stops.

Stopping: SIGTERM or SIGINT reaches rank 0 (from the agent, or to the whole process group),
which drains its requests and then releases the other ranks. Those ignore the signals: ending
first would leave rank 0's last steps without their peers. Every rank ends with the launcher.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from duoka.errors import DuokaError
from duoka.host.lifetime import die_with_launcher, leave_after_return
from duoka.serve.config import EngineConfig, ServerConfig
from duoka.serve.engine import LLMEngine
from duoka.serve.server import serve
from duoka.serve.worker import run_worker
from duoka.state_files import write_whole


def serve_rank_main(config: EngineConfig, server: ServerConfig, result_file: str) -> int:
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
    config = dataclasses.replace(config, device=str(device))
    try:
        if rank != 0:
            run_worker(config, dist.group.WORLD)
            return 0
        engine = LLMEngine(config, tp_group=dist.group.WORLD)
        code = serve(engine, **server.kwargs())
        write_whole(Path(result_file), f"{code}\n")
        return code
    except DuokaError as e:
        if rank == 0:
            write_whole(Path(result_file), f"2\n{e.cause}\n{e.fix or ''}\n")
        print(f"error: {e.cause}", file=sys.stderr)
        raise SystemExit(2)
    finally:
        dist.destroy_process_group()
        leave_after_return()
