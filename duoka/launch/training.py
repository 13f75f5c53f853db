"""`duoka train`: resolve and check everything once, then start the workers through
PyTorch's elastic launcher (the machinery behind torchrun) with c10d rendezvous.

All checks that can fail on user input run before a single worker starts (train/spec.py's
resolve_run): config keys and ranges, the model and tokenizer, the parallel layout against
the process count, the batch arithmetic, the data. Workers that still fail write their error
to the run directory, and the agent (launch/agent.py) turns it into one message.

Multi-node: run the same command on every node with --nnodes, --node-rank and the same
--rdzv-endpoint HOST:PORT (node 0's address). Under Slurm (`srun duoka train cfg.toml`, one
task per node) and in a Kubernetes Indexed Job or Kubeflow PyTorchJob, the flags left out come
from the scheduler's environment (launch/cluster.py); flags given win.

How a job ends (docs/training.md, "Stopping, preemption and restarts"): the workers live
exactly as long as the launcher; SIGTERM or SIGINT, to the launcher or to the whole process
group, saves a checkpoint and exits 128 + the signal's number; a worker that dies is named
with its signal or exit code, and with --max-restarts N the group restarts from the newest
intact checkpoint by itself. Node 0's launcher holds a lock on the run directory.

Start-up time: this module imports no torch at its top. Workers are forked from a server
that imports torch and the trainer (start_worker_server); it starts as soon as the workers'
environment is final, and only then does this process import what loads torch (the spec's
resolution, the agent), so the two imports overlap.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import signal
import socket
import time
from pathlib import Path

from duoka import runtime
from duoka.cache import compile_cache_env
from duoka.config import Config, load_config, to_toml
from duoka.errors import DuokaError
from duoka.host.devices import device_env, read_gpus, select_gpus
from duoka.host.ports import free_port
from duoka.launch.cluster import Launch, LaunchFlags, resolve_launch
from duoka.launch.exits import TrainingStopped
from duoka.state_files import write_whole
from duoka.train.run_files import STOPPED_MARKER, read_error_reports

LOCK_FILE = ".lock"


def launch_training(config_path: str | None, overrides: list[str], flags: LaunchFlags = LaunchFlags(),
                    log=print) -> Path:
    """Train the run the config and overrides describe; returns its run directory."""
    cfg = load_config(config_path, overrides)
    launch = _resolve_flags(flags, log)
    on_gpu, nproc_per_node = _prepare_host(cfg, launch)
    world = nproc_per_node * launch.nnodes
    # What loads torch comes after the worker server has started: its own import of torch
    # then overlaps this process's.
    from duoka.train.spec import resolve_resume, resolve_run

    spec = resolve_run(cfg, world, on_gpu, log)
    run_dir = run_directory(cfg, launch.job_tag)
    run_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        if launch.node_rank == 0:
            held.enter_context(run_lock(run_dir))
            check_run_directory(run_dir, cfg)
        spec = resolve_resume(spec, run_dir, log)
        # What an earlier job left (every node, before any worker starts): its errors, and the
        # mark of its stop, which would otherwise make this run look stopped too.
        for stale in [*run_dir.glob("error-rank*.json"), run_dir / STOPPED_MARKER]:
            stale.unlink(missing_ok=True)
        if launch.node_rank == 0:
            write_whole(run_dir / "config.toml", to_toml(spec.cfg))
        log(f"duoka: {world} process(es) ({launch.nnodes} node(s) x {nproc_per_node}), run directory {run_dir}")
        stop_signal = _run_workers(spec, nproc_per_node, launch, flags.max_restarts, log)
        stopped = run_dir / STOPPED_MARKER
        if stopped.exists():
            raise TrainingStopped(run_dir, stop_signal or signal.SIGTERM, stopped.read_text().strip())
        # A stop that came after the last step found the run complete.
        if stop_signal is not None and not (run_dir / "checkpoints" / f"step-{cfg.training.steps}").is_dir():
            raise TrainingStopped(run_dir, stop_signal, None)
    return run_dir


def _resolve_flags(flags: LaunchFlags, log) -> Launch:
    """The launch flags merged with what the scheduler's environment says, checked."""
    if flags.nproc_per_node is not None and flags.nproc_per_node < 1:
        raise DuokaError(f"--nproc-per-node {flags.nproc_per_node}: a node needs at least one worker process",
                         "give --nproc-per-node 1 or more, or leave it out (one per selected GPU, or 1 without GPUs)")
    if flags.max_restarts < 0:
        raise DuokaError(f"--max-restarts {flags.max_restarts} is negative",
                         "give the number of times the workers may be restarted after a failure (0: none)")
    launch = resolve_launch(os.environ, flags.nnodes, flags.node_rank, flags.rdzv_endpoint, flags.nproc_per_node,
                            flags.gpus)
    if launch.detected:
        log(launch.detected)
    if launch.nnodes < 1 or not 0 <= launch.node_rank < launch.nnodes:
        raise DuokaError(f"--node-rank {launch.node_rank} with --nnodes {launch.nnodes}",
                         "node ranks run from 0 to nnodes - 1")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise DuokaError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT", "give node 0's address and a free port on it")
    return launch


def _prepare_host(cfg: Config, launch: Launch) -> tuple[bool, int]:
    """Choose the GPUs, set the workers' environment in this process (which they inherit) and
    start the worker server. Returns (on GPUs, processes on this node)."""
    env: dict[str, str] = {}
    # NVML sees every GPU whatever CUDA_VISIBLE_DEVICES says. Without torch's check here: it
    # imports torch (~2 s), which can wait until the worker server has started importing it too.
    gpu_list = read_gpus(check_torch=False)
    nproc_per_node = launch.nproc_per_node
    if gpu_list:
        chosen = select_gpus(launch.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"), gpu_list)
        if not chosen:
            raise DuokaError("CUDA_VISIBLE_DEVICES leaves no GPU visible", "unset it or list GPU indices in it")
        env.update(device_env(chosen))
        if nproc_per_node is None:
            nproc_per_node = len(chosen)
        elif nproc_per_node > len(chosen):
            raise DuokaError(f"--nproc-per-node {nproc_per_node} but only {len(chosen)} GPUs are selected ({chosen})",
                             "one process drives one GPU: lower --nproc-per-node or select more GPUs")
    else:
        if launch.gpus is not None:
            select_gpus(launch.gpus, None, [])  # raises: no GPU
        nproc_per_node = nproc_per_node or 1
    if not gpu_list and "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:
        # CPU workers share the cores; without this each starts one thread per core and
        # they oversubscribe the machine (torchrun sets 1; a fair share is faster).
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    if cfg.training.compile is True or (cfg.training.compile == "auto" and gpu_list):  # as compile_wanted decides
        # torch.compile's artefacts kept between launches (the workers compile only what is new).
        env.update(compile_cache_env(cfg.training.compile_cache))
    os.environ.update(env)  # the worker environment is complete: the worker server may start
    if nproc_per_node * launch.nnodes > 1:
        start_worker_server()
    if not gpu_list:
        read_gpus()  # raises if PyTorch sees GPUs that NVML could not list
    return bool(gpu_list), nproc_per_node


def _run_workers(spec, nproc_per_node: int, launch: Launch, max_restarts: int, log) -> int | None:
    """Run the workers to their end. Returns the signal that stopped them early (None: they
    ran to the end); a failure raises its explanation."""
    from duoka.launch.agent import reported_failure, run_training_agent
    from duoka.train.entrypoint import restart_resume_point, worker_main

    if launch.nnodes == 1 and nproc_per_node == 1 and max_restarts == 0:
        # One process: run in this one, no agent to start (faster, and debuggers work).
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        try:
            return worker_main(spec)
        except SystemExit:
            reports = read_error_reports(spec.run_dir)
            if reports:
                raise reported_failure(reports) from None
            raise
    start_worker_server()  # already running unless this is a single-process job
    try:
        return run_training_agent(worker_main, spec, restart_resume_point, nproc_per_node, launch.nnodes,
                                  launch.node_rank, launch.rdzv_endpoint, max_restarts, log)
    finally:
        stop_worker_server()


def run_directory(cfg: Config, job_tag: str | None = None) -> Path:
    """job.output_dir; else runs/<model>-<job_tag> in a scheduler's job (a requeued job keeps its
    id, so it finds its own run again); else runs/<model>-<time>."""
    if cfg.job.output_dir:
        return Path(cfg.job.output_dir)
    model = Path(cfg.model.path).name if cfg.model.path else cfg.model.flavor
    if job_tag:
        return Path("runs") / f"{model}-{job_tag}"
    if cfg.checkpoint.resume == "auto":
        raise DuokaError("checkpoint.resume=auto needs job.output_dir (the run to continue)",
                         "add --job.output_dir=runs/<the run>")
    return Path("runs") / (model + time.strftime("-%Y%m%d-%H%M%S"))


def check_run_directory(run_dir: Path, cfg: Config) -> None:
    """A new run never writes over an earlier one (checked by node 0, holding the run's lock)."""
    if (run_dir / "metrics.jsonl").exists() and not cfg.checkpoint.resume:
        raise DuokaError(f"run directory {run_dir} already holds a run (metrics.jsonl)",
                         "continue it with --checkpoint.resume=auto, or choose a new job.output_dir")


@contextlib.contextmanager
def run_lock(run_dir: Path):
    """An exclusive flock on RUN/.lock for the run's life (node 0's launcher), so that two jobs
    never write one run directory: a second `duoka train` there is refused at once. The kernel
    drops it when its holder exits however it ends, so a killed job leaves no stale lock."""
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited (Python's default)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").split()
        os.close(fd)
        who = f"pid {holder[0]} on {holder[1]}" if len(holder) == 2 else "another process"
        raise DuokaError(f"run directory {run_dir} is in use by another duoka train ({who})",
                         "wait for that job to end or stop it (SIGTERM saves a checkpoint), or choose another "
                         "job.output_dir") from None
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        yield
    finally:
        os.close(fd)


def start_worker_server() -> None:
    """Workers are forked from one server process that has imported torch and the trainer
    once (4 s on a busy core) instead of each importing them afresh as under spawn; the
    server never touches CUDA, so its children initialise CUDA cleanly, as with spawn.
    Started as soon as the worker environment (GPU selection, thread counts) is final, its
    import runs while this process checks the config, model and data. The elastic
    launcher's forkserver start method then uses this same server.

    The server ignores SIGTERM, inherited from here (it ignores SIGINT itself): a signal to
    the whole process group (a scheduler's preemption, `timeout`) must leave it running, since
    the agent learns its workers' exits through it while they save."""
    import multiprocessing
    from multiprocessing import forkserver

    # torch._dynamo too: every worker imports it anyway (torch 2.13's optimizers, DDP and FSDP2
    # in their constructors, meta-device initialisers), ~1 s of CPU each, once here instead.
    multiprocessing.set_forkserver_preload(["duoka.train.entrypoint", "torch._dynamo"])
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
    # A launch that fails before its workers start (a config or data error found after
    # this) ends the server on the way out, as _run_workers does after its workers.
    atexit.unregister(stop_worker_server)  # once, however many launches this process makes
    atexit.register(stop_worker_server)


def stop_worker_server() -> None:
    """End the worker server once the agent has returned (its workers have all exited)."""
    runtime.stop_forkserver()
