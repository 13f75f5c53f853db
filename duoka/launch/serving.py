"""`duoka serve`: check what can be checked before any process starts (the model folder, the
tensor-parallel size against the model's heads, the port), then serve: with --tp 1 the
engine runs in a process of its own beside the HTTP server (serve/engine_process.py); with
--tp N the elastic agent (launch/agent.py) starts N ranks, rank 0 serving HTTP and driving
the others (serve/rank_process.py; ranks above 0 run only a serve.worker.Worker)."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import uuid
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from duoka import runtime
from duoka.data.tokenizer import load_tokenizer
from duoka.errors import DuokaError
from duoka.host.devices import read_gpus, visible_indices
from duoka.host.ports import free_port, port_is_free
from duoka.hub import bundled_model_dir, resolve_model_dir
from duoka.launch.agent import LOOPBACK, kept_signal_handlers, quiet_agent_logs, shutdown_timeout
from duoka.launch.exits import EXIT_USER_ERROR, EXIT_WORKER_DIED, WorkerFailed
from duoka.models.qwen2.hf_adapter import read_config
from duoka.serve.config import EngineConfig, ServerConfig
from duoka.serve.engine import BUNDLED_MODEL_NAME
from duoka.serve.engine_process import EngineProcess
from duoka.serve.rank_process import serve_rank_main
from duoka.serve.server import serve
from duoka.serve.tp_shard import check_tp_size


def launch_serving(config: EngineConfig, server: ServerConfig, log=print) -> int:
    """Serve until a SIGTERM/SIGINT drain; returns the exit code (0 after a drain)."""
    folder = resolve_model_dir(config.model) if config.model is not None else bundled_model_dir()
    check_tp_size(read_config(folder), config.tp)
    # A chat template that does not compile or fails on a plain conversation is refused now,
    # before the model loads, rather than answering 400 to every chat request.
    load_tokenizer(folder).check_chat_template()
    # The ranks load the resolved folder; clients keep calling the model by the name given.
    name = config.served_model_name or config.model or BUNDLED_MODEL_NAME
    # Adapter folders absolute: every process, and /v1/models, see the same ones.
    loras = tuple((lora, str(Path(path).resolve())) for lora, path in config.loras)
    config = dataclasses.replace(config, model=str(folder), served_model_name=name, loras=loras)
    if config.tp == 1:
        # The engine in a process of its own: the HTTP loop's work per token then takes no
        # GIL from it (serve.engine_process). With tp > 1 rank 0 runs both, in two threads.
        return serve(lambda: EngineProcess(config), **server.kwargs())
    return _run_serving_ranks(config, server, log)


def _run_serving_ranks(config: EngineConfig, server: ServerConfig, log) -> int:
    host, port, tp = server.host, server.port, config.tp
    if not port_is_free(host, port):  # now: rank 0's serve() would find it only after every rank has loaded
        raise DuokaError(f"{host}:{port} is already in use (another server?)",
                         f"stop the other process, or pick another port: --port {port + 1}")
    gpus = read_gpus(check_torch=False)
    if gpus and config.device not in (None, "cuda"):
        raise DuokaError(f"--tp {tp} with --device {config.device}: each rank takes its own GPU",
                         "leave --device out (or give --device cuda); without GPUs the ranks run on the CPU")
    visible = len(visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus))
    if gpus and tp > visible:
        raise DuokaError(f"--tp {tp} needs {tp} GPUs; {visible} are visible",
                         f"lower --tp to {visible} or less, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    if not gpus:  # CPU ranks share the cores
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp)))
    endpoint = f"{LOOPBACK}:{free_port()}"
    # A drain must end before the agent's SIGKILL: the grace period plus time to close.
    launch = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=tp, run_id=str(uuid.uuid4()),
        rdzv_backend=runtime.register_rendezvous(), rdzv_endpoint=endpoint, rdzv_configs={"is_host": True},
        local_addr=LOOPBACK, max_restarts=0, monitor_interval=0.1, start_method="spawn",
        **shutdown_timeout(int(server.grace_s + 30)),
    )
    quiet_agent_logs()
    with tempfile.TemporaryDirectory(prefix="duoka-serve-") as scratch, kept_signal_handlers():
        result = Path(scratch) / "rank0"
        try:
            elastic_launch(launch, serve_rank_main)(config, server, str(result))
            return serving_result(result, None)
        except SignalException as e:
            return serving_result(result, int(e.sigval))
        except ChildFailedError as e:
            serving_result(result, None)  # raises rank 0's own error, when it wrote one
            rank, failure = min(e.failures.items())
            raise WorkerFailed(f"serving rank {rank} failed (exit code {failure.exitcode})",
                               "the ranks' messages above say why", EXIT_WORKER_DIED) from None


def serving_result(result: Path, signum: int | None) -> int:
    """Rank 0's own account of how it ended (written whole, by rename); without a readable one
    (rank 0 died before writing it), a signal's conventional code."""
    lines = result.read_text(errors="replace").splitlines() if result.is_file() else []
    if lines and lines[0].strip().isdigit():
        code = int(lines[0])
        if code == EXIT_USER_ERROR and len(lines) > 1:
            raise DuokaError(lines[1], lines[2] if len(lines) > 2 and lines[2] else None)
        return code
    return 128 + signum if signum is not None else EXIT_WORKER_DIED
