"""`duoka train`: resolve and check everything once, then start the workers through
PyTorch's elastic launcher (the machinery behind torchrun) with c10d rendezvous.

All checks that can fail on user input run here, before a single worker starts: config
keys and ranges, the model and tokenizer, the parallel layout against the process count,
the batch arithmetic, the data. Workers that still fail write their error to the run
directory, and the launcher turns it into one message.

Multi-node: run the same command on every node with --nnodes, --node-rank and the same
--rdzv-endpoint HOST:PORT (node 0's address). Under Slurm (`srun duoka train cfg.toml`, one
task per node) and in a Kubernetes Indexed Job or Kubeflow PyTorchJob, the flags left out come
from the scheduler's environment (parallel/cluster.py); flags given win.

How a job ends (docs/training.md, "Stopping, preemption and restarts"): the workers live
exactly as long as the launcher; SIGTERM or SIGINT, to the launcher or to the whole process
group, saves a checkpoint and exits 128 + the signal's number; a worker that dies is named
with its signal or exit code, and with --max-restarts N the group restarts from the newest
intact checkpoint by itself. Node 0's launcher holds a lock on the run directory.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import json
import os
import shlex
import signal
import socket
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from duoka import runtime
from duoka.cache import compile_cache_env
from duoka.config import Config, load_config, to_toml
from duoka.errors import DuokaError
from duoka.parallel.cluster import duoka_command, resolve_launch, slurm_script
from duoka.parallel.ports import free_port, parse_endpoint, port_is_free
from duoka.train.spec import RESTARTS_LOG, STOPPED_MARKER, TOKENIZER_FILES, RunSpec

# Exit codes of `duoka train` (docs/training.md lists them). A stop by signal N exits 128 + N,
# as a process killed by N would, so that schedulers and `&&` chains see an unfinished job.
EXIT_WORKER_DIED = 1  # a worker was killed or crashed, no restart left: resuming may succeed
EXIT_USER_ERROR = 2  # DuokaError: cause and fix; the same command fails the same way
LOCK_FILE = ".lock"
LOOPBACK = "127.0.0.1"  # where a single node's stores listen: nothing outside the host needs them


def resolve_model(cfg: Config):
    """(ModelArgs, folder to load weights from or None, tokenizer folder or None)."""
    from duoka.hub import bundled_model_dir, resolve_model_dir
    from duoka.models.qwen2.args import get_flavor
    from duoka.models.qwen2.hf_adapter import read_config, weight_files

    if cfg.model.path:
        folder = resolve_model_dir(cfg.model.path)
        args = read_config(folder)
        weight_files(folder)  # fails now, not in every worker, if the weights are missing
        tokenizer = Path(cfg.model.tokenizer) if cfg.model.tokenizer else folder
        return args, folder, tokenizer
    args = get_flavor(cfg.model.flavor)
    if cfg.model.tokenizer:
        return args, None, resolve_model_dir(cfg.model.tokenizer)
    if cfg.model.flavor == "debug":
        return args, None, bundled_model_dir()
    return args, None, None


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


def launch_training(
    config_path: str | None,
    overrides: list[str],
    nproc_per_node: int | None = None,
    nnodes: int | None = None,
    node_rank: int | None = None,
    rdzv_endpoint: str | None = None,
    gpus: str | None = None,
    log=print,
    max_restarts: int = 0,
) -> Path:
    """Launch flags left as None are taken from the scheduler's environment where it has them
    (cluster.resolve_launch), else their single-node defaults."""
    from duoka.parallel.devices import device_env, read_gpus, select_gpus

    cfg = load_config(config_path, overrides)
    if nproc_per_node is not None and nproc_per_node < 1:
        raise DuokaError(f"--nproc-per-node {nproc_per_node}: a node needs at least one worker process",
                         "give --nproc-per-node 1 or more, or leave it out (one per selected GPU, or 1 without GPUs)")
    if max_restarts < 0:
        raise DuokaError(f"--max-restarts {max_restarts} is negative",
                         "give the number of times the workers may be restarted after a failure (0: none)")
    launch = resolve_launch(os.environ, nnodes, node_rank, rdzv_endpoint, nproc_per_node, gpus)
    nnodes, node_rank, rdzv_endpoint = launch.nnodes, launch.node_rank, launch.rdzv_endpoint
    nproc_per_node, gpus = launch.nproc_per_node, launch.gpus
    if launch.detected:
        log(launch.detected)
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise DuokaError(f"--node-rank {node_rank} with --nnodes {nnodes}", "node ranks run from 0 to nnodes - 1")
    if nnodes > 1 and not rdzv_endpoint:
        raise DuokaError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT", "give node 0's address and a free port on it")

    # Devices. NVML sees every GPU whatever CUDA_VISIBLE_DEVICES says.
    env: dict[str, str] = {}
    # Without torch's check here: it imports torch (~2 s), which can wait until the
    # worker server below has started importing it too (read_gpus again, below).
    gpu_list = read_gpus(check_torch=False)
    if gpu_list:
        chosen = select_gpus(gpus, os.environ.get("CUDA_VISIBLE_DEVICES"), gpu_list)
        if not chosen:
            raise DuokaError("CUDA_VISIBLE_DEVICES leaves no GPU visible", "unset it or list GPU indices in it")
        env.update(device_env(chosen))
        if nproc_per_node is None:
            nproc_per_node = len(chosen)
        elif nproc_per_node > len(chosen):
            raise DuokaError(f"--nproc-per-node {nproc_per_node} but only {len(chosen)} GPUs are selected ({chosen})",
                             "one process drives one GPU: lower --nproc-per-node or select more GPUs")
    else:
        if gpus is not None:
            select_gpus(gpus, None, [])  # raises: no GPU
        nproc_per_node = nproc_per_node or 1
    world = nproc_per_node * nnodes
    if not gpu_list and "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:
        # CPU workers share the cores; without this each starts one thread per core and
        # they oversubscribe the machine (torchrun sets 1; a fair share is faster).
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    if cfg.training.compile is True or (cfg.training.compile == "auto" and gpu_list):  # as compile_wanted decides
        # torch.compile's artefacts kept between launches (the workers compile only what is new).
        env.update(compile_cache_env(cfg.training.compile_cache))
    os.environ.update(env)  # the worker environment is complete: the worker server may start
    if world > 1:
        _start_worker_server()
    if not gpu_list:
        read_gpus()  # raises if PyTorch sees GPUs that NVML could not list

    # Imports that load torch come after the worker server has started: its own import of
    # torch then overlaps this process's.
    from duoka.data.dataset import RANDOM_DATA, PackedWindows, end_of_text_id, read_manifest, tokenize_corpus
    from duoka.data.prepare import is_prepared
    from duoka.data.sft import prepare_sft
    from duoka.data.tokenizer import Tokenizer
    from duoka.hub import bundled_corpus
    from duoka.models.qwen2.stages import layer_counts
    from duoka.parallel.balance import check_config as check_balance_config
    from duoka.parallel.dims import ParallelDims
    from duoka.parallel.parallelize import check_float8
    from duoka.plan.memory import auto_blocks_per_unit
    from duoka.train import adapters
    from duoka.train.checkpoint import find_resume_checkpoint, read_train_state
    from duoka.train.compiling import failing_ranks
    from duoka.train.optim import pipeline_microbatches, plan_batch
    from duoka.train.optimizers import check_optimizer
    from duoka.train.optimizers import check_resume as check_optimizer_resume

    # Everything a worker would otherwise discover late, resolved once.
    args, model_dir, tokenizer_dir = resolve_model(cfg)
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.check_model(args.n_heads, args.n_kv_heads, args.n_layers, cfg.parallel.pp_stages_per_rank)
    check_balance_config(cfg.parallel, cfg.debug, dims.model_parallel, dims.tp, dims.pp, dims.dp_size, world)
    check_float8(cfg.training.float8, dims.tp)
    lora = adapters.lora_args(cfg)
    adapters.check_layout(cfg, dims, args)
    check_optimizer(cfg, dims, on_gpu=bool(gpu_list), lora=lora is not None)
    if lora is not None and model_dir is None:
        log("duoka: warning: LoRA on a randomly initialised base (model.path is empty): right for measurements, "
            "but the adapter means nothing outside this run; set model.path to fine-tune a real model")
    failing_ranks(cfg.debug.fail_compile_ranks, world)
    stage_layers = None
    if dims.pp > 1 and cfg.parallel.pp_layers != "measured":
        stage_layers = tuple(layer_counts(args, dims.pp * cfg.parallel.pp_stages_per_rank, cfg.parallel.pp_layers,
                                          cfg.training.seq_len))
    micro_batch = blocks_per_unit = None
    if cfg.training.micro_batch_size != "auto":
        micro_batch = cfg.training.micro_batch_size
        batch = plan_batch(cfg.training.global_batch_size, dims.dp_size, micro_batch)
        if dims.pp > 1:
            pipeline_microbatches(cfg, batch.per_rank, batch.accumulation)
    elif cfg.training.global_batch_size % dims.dp_size:
        plan_batch(cfg.training.global_batch_size, dims.dp_size, 1)
    if cfg.parallel.fsdp_blocks_per_unit != -1:
        blocks_per_unit = cfg.parallel.fsdp_blocks_per_unit
    elif micro_batch is not None:
        blocks_per_unit = auto_blocks_per_unit(args, micro_batch, cfg.training.seq_len, dims.tp,
                                               cfg.parallel.reshard_after_forward and dims.pp == 1)
    if cfg.training.seq_len > args.max_seq_len:
        raise DuokaError(f"training.seq_len={cfg.training.seq_len} exceeds the model's {args.max_seq_len} positions",
                         f"use training.seq_len <= {args.max_seq_len}")

    tokenizer_files: list[str] = []
    token_file = None
    end_of_text = None
    if cfg.data.path == RANDOM_DATA:
        if tokenizer_dir is not None:
            tokenizer_files = _tokenizer_files(tokenizer_dir)
    else:
        if tokenizer_dir is None:
            raise DuokaError(f"model.flavor={cfg.model.flavor} has no tokenizer to read data.path with",
                             "set model.tokenizer to a Qwen2 tokenizer folder (or a hub id such as Qwen/Qwen2-7B)")
        tokenizer = Tokenizer(tokenizer_dir)
        if tokenizer.vocab_size > args.vocab_size:
            raise DuokaError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary is "
                             f"{args.vocab_size}", "use the model's own tokenizer, or a flavor with a larger vocabulary")
        t = time.perf_counter()
        end_of_text = end_of_text_id(tokenizer)
        if cfg.data.mode == "sft":
            if not cfg.data.path:
                raise DuokaError("data.mode=sft needs data.path (JSONL conversations)",
                                 'give a .jsonl file with one {"messages": [...]} per line')
            data_path = Path(cfg.data.path)
            token_path, stats = prepare_sft(data_path, tokenizer, cfg.training.seq_len, cfg.data.messages_field,
                                            cfg.data.sft_overlong)
            token_file = str(token_path)
            log(f"duoka: sft data {data_path}: {stats.conversations:,} conversations -> {stats.windows:,} windows, "
                f"{stats.target_tokens:,} target tokens; {stats.truncated} truncated, {stats.dropped} dropped "
                f"(longer than {cfg.training.seq_len + 1} tokens), {stats.no_target} skipped (no assistant token "
                f"within that length) ({time.perf_counter() - t:.1f} s)")
        else:
            data_path = Path(cfg.data.path) if cfg.data.path else bundled_corpus()
            if is_prepared(data_path):
                manifest = read_manifest(data_path)
                if manifest["tokenizer"] != tokenizer.fingerprint:
                    raise DuokaError(f"{data_path} was prepared with the tokenizer in {manifest['tokenizer_dir']}, "
                                     f"not the model's ({tokenizer.folder})",
                                     f"prepare it again: duoka prepare --data SOURCE --out DIR --tokenizer {tokenizer.folder}")
                token_file = str(data_path)
            else:
                token_file = str(tokenize_corpus(data_path, tokenizer, cfg.data.text_field))
            # Raises if the corpus is too small or holds ids beyond the model's vocabulary (read once, here).
            windows = len(PackedWindows(Path(token_file), cfg.training.seq_len, args.vocab_size))
            log(f"duoka: data {data_path}: {windows:,} windows of {cfg.training.seq_len} tokens "
                f"({time.perf_counter() - t:.1f} s)")
        tokenizer_files = _tokenizer_files(tokenizer_dir)

    run_dir = run_directory(cfg, launch.job_tag)
    run_dir.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        if node_rank == 0:
            held.enter_context(run_lock(run_dir))
            check_run_directory(run_dir, cfg)
        cfg.job.output_dir = str(run_dir)
        resume_from = find_resume_checkpoint(run_dir, cfg.checkpoint.resume)
        resume_step = 0
        base = adapters.base_identity(model_dir, args, cfg.training.seed) if lora is not None else None
        if resume_from is not None:
            train_state = read_train_state(resume_from)
            adapters.check_resume(resume_from, train_state, lora, base)
            check_optimizer_resume(resume_from, train_state, cfg)
            resume_step = train_state["step"]
            if resume_step > cfg.training.steps:
                raise DuokaError(f"{resume_from} is at step {resume_step}, past training.steps={cfg.training.steps}",
                                 f"raise training.steps above {resume_step} to train further")
            log(f"duoka: resuming from {resume_from} (step {resume_step})")
        # What an earlier job left (every node, before any worker starts): its errors, and the
        # mark of its stop, which would otherwise make this run look stopped too.
        for stale in [*run_dir.glob("error-rank*.json"), run_dir / STOPPED_MARKER]:
            stale.unlink(missing_ok=True)
        if node_rank == 0:
            (run_dir / "config.toml").write_text(to_toml(cfg))

        spec = RunSpec(config=cfg.to_dict(), run_dir=str(run_dir), model_args=asdict(args), world_size=world,
                       model_dir=str(model_dir) if model_dir else None, token_file=token_file,
                       tokenizer_files=tuple(tokenizer_files), end_of_text=end_of_text,
                       resume_from=str(resume_from) if resume_from else None, resume_step=resume_step,
                       micro_batch=micro_batch, fsdp_blocks_per_unit=blocks_per_unit, stage_layers=stage_layers,
                       base=base)
        log(f"duoka: {world} process(es) ({nnodes} node(s) x {nproc_per_node}), run directory {run_dir}")
        stop_signal = _run_workers(spec, nproc_per_node, nnodes, node_rank, rdzv_endpoint, max_restarts, log)
        stopped = run_dir / STOPPED_MARKER
        if stopped.exists():
            raise TrainingStopped(run_dir, stop_signal or signal.SIGTERM, stopped.read_text().strip())
        # A stop that came after the last step found the run complete.
        if stop_signal is not None and not (run_dir / "checkpoints" / f"step-{cfg.training.steps}").is_dir():
            raise TrainingStopped(run_dir, stop_signal, None)
    return run_dir


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


class TrainingStopped(Exception):
    """The job stopped early on a signal (SIGTERM, SIGINT), having saved a checkpoint or not.
    Exit code 128 + the signal's number, as a job killed by it, so that schedulers and `&&`
    chains do not mistake it for a finished run."""

    def __init__(self, run_dir: Path, signum: int, saved_step: str | None):
        name = signal.Signals(signum).name
        resume = f"--checkpoint.resume=auto --job.output_dir={run_dir}"
        if saved_step is not None:
            message = f"stopped by {name} after saving step {saved_step}; continue with {resume}"
        else:
            message = (f"stopped by {name} before a checkpoint was saved (a second signal, or a stop that did not "
                       f"finish within the grace period); continue from the newest one with {resume}")
        super().__init__(message)
        self.exit_code = 128 + signum


class WorkerFailed(DuokaError):
    """A worker failed and no restart is left; `exit_code` tells a scheduler whether trying
    again may help (EXIT_WORKER_DIED) or not (EXIT_USER_ERROR), or is a worker's own."""

    def __init__(self, cause: str, fix: str | None, exit_code: int):
        super().__init__(cause, fix)
        self.exit_code = exit_code

    def __reduce__(self):
        return (type(self), (self.cause, self.fix, self.exit_code))


def _tokenizer_files(folder: Path) -> list[str]:
    return [str(folder / n) for n in TOKENIZER_FILES if (folder / n).is_file()]


def _run_workers(spec, nproc_per_node: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None,
                 max_restarts: int, log) -> int | None:
    """Run the workers to their end. Returns the signal that stopped them early (None: they
    ran to the end); a failure raises its explanation."""
    from duoka.train.worker import worker_main

    if nnodes == 1 and nproc_per_node == 1 and max_restarts == 0:
        # One process: run in this one, no agent to start (faster, and debuggers work).
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        try:
            return worker_main(spec)
        except SystemExit:
            reports = _error_reports(spec.run_dir)
            if reports:
                raise _reported_failure(reports) from None
            raise

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if rdzv_endpoint is None:
        endpoint = f"{LOOPBACK}:{free_port()}"
    else:
        host, port = parse_endpoint(rdzv_endpoint)
        endpoint = rdzv_endpoint if nnodes > 1 else f"{LOOPBACK}:{port}"
        if node_rank == 0 and not port_is_free(host if nnodes > 1 else LOOPBACK, port):
            if nnodes == 1:
                new = free_port()
                log(f"duoka: rendezvous port {port} is in use; using {new} instead")
                endpoint = f"{LOOPBACK}:{new}"
            else:
                raise DuokaError(f"rendezvous port {port} on {host} is already in use (another job, or a stale one)",
                                 f"pick another port for every node, e.g. --rdzv-endpoint {host}:{free_port()}")
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
        **_shutdown_timeout(),
    )
    _start_worker_server()  # already running unless this is a single-process job
    _quiet_agent_logs()
    restarts = Restarts(spec, max_restarts, node_rank, log)
    # The agent installs handlers that raise SignalException and never puts the old ones back.
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
    try:
        with runtime.elastic_agent_hooks(restarts.after_failure):
            returned = elastic_launch(config, worker_main)(spec)
        return next((r for r in returned.values() if r), None)
    except SignalException as e:
        # The agent forwarded it to the workers, which saved (or not) within the grace period.
        # A second signal lands here too, at once: the workers then end with the worker server.
        return int(e.sigval)
    except ChildFailedError as e:
        raise explain_failure(e.failures, spec.run_dir) from None
    finally:
        for s, handler in handlers.items():
            with contextlib.suppress(ValueError):  # ValueError: not the main thread (nor was the agent's)
                signal.signal(s, handler)
        _stop_worker_server()


class Restarts:
    """--max-restarts: each failure the agent restarts the group after is recorded in
    RUN/restarts.jsonl (node 0) with what it cost, and told on the console. A worker's own
    error (exit code 2: config, data, a damaged checkpoint) is final: a restart would meet it
    again."""

    def __init__(self, spec, max_restarts: int, node_rank: int, log):
        self.spec, self.max_restarts, self.node_rank, self.log = spec, max_restarts, node_rank, log
        self.done = 0

    def after_failure(self, failures: dict) -> bool:
        """Called by the agent once the failed group's workers on this node have all exited;
        returns whether a restart may follow."""
        from duoka.train.worker import restart_resume_point

        failure = explain_failure(failures, self.spec.run_dir)
        if failure.exit_code == EXIT_USER_ERROR:
            return False
        if self.done == self.max_restarts:
            return True  # the agent gives up; the launcher explains the failure
        self.done += 1
        run_dir = Path(self.spec.run_dir)
        last = _last_logged_step(run_dir)
        try:
            resume_from, resume_step = restart_resume_point(self.spec)
        except DuokaError:  # no intact checkpoint: the restarted workers say so, once each
            resume_from, resume_step = None, None
        lost = last - resume_step if resume_step is not None and last is not None else None
        rank, first = min(failures.items(), key=lambda item: item[1].timestamp)
        record = {"time": time.time(), "restart": self.done, "max_restarts": self.max_restarts, "rank": rank,
                  "exit_code": first.exitcode, "signal": first.signal_name() if first.exitcode < 0 else None,
                  "cause": failure.cause, "last_step": last, "resume_from": resume_from,
                  "resume_step": resume_step, "steps_lost": lost}
        if self.node_rank == 0:
            with open(run_dir / RESTARTS_LOG, "a") as f:
                f.write(json.dumps(record) + "\n")
        self.log(f"duoka: {failure.cause.splitlines()[0]}; restart {self.done} of {self.max_restarts} from "
                 f"step {resume_step} ({lost} step(s) lost)")
        return True


def _last_logged_step(run_dir: Path) -> int | None:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in reversed(lines):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return int(json.loads(line)["step"])
    return None


def explain_failure(failures: dict, run_dir: str) -> WorkerFailed:
    """One message for a failed group, naming the rank that failed first. The agent reports
    the first exit it saw (with its signal or exit code); a rank that only lost a peer leaves
    a moment later (worker.LOST_PEER_DELAY_S), so that is the rank that died first."""
    reports = _error_reports(run_dir)
    if any(not r.get("lost_peer") for r in reports.values()):
        return _reported_failure(reports)
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    step = _last_logged_step(Path(run_dir))
    when = f" after step {step}" if step is not None else " before its first step ended"
    resume = f"continue with --checkpoint.resume=auto --job.output_dir={run_dir} (or let --max-restarts N restart it)"
    if failure.exitcode < 0:
        name = failure.signal_name()
        if -failure.exitcode == signal.SIGKILL:
            return WorkerFailed(f"rank {rank} was killed by SIGKILL{when} (killed by the OS, out of host memory?)",
                                f"look for the OOM killer in the kernel log (dmesg); {resume}", EXIT_WORKER_DIED)
        return WorkerFailed(f"rank {rank} was killed by {name}{when}", resume, EXIT_WORKER_DIED)
    if rank in reports:  # it lost a peer, and no other rank said why
        lost = reports[rank]["cause"].strip().splitlines()[-1]
        return WorkerFailed(f"rank {rank} lost contact with the other ranks{when} ({lost}); the rank that died first "
                            "left no error", resume, EXIT_WORKER_DIED)
    return WorkerFailed(f"rank {rank} exited with code {failure.exitcode}{when} without leaving an error", resume,
                        EXIT_WORKER_DIED)


def _error_reports(run_dir: str) -> dict[int, dict]:
    """rank -> the error that worker wrote (spec.write_error_report's format)."""
    reports = {}
    for path in Path(run_dir).glob("error-rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            reports[int(path.stem.removeprefix("error-rank"))] = json.loads(path.read_text())
    return reports


def _reported_failure(reports: dict[int, dict]) -> WorkerFailed:
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


def _stop_worker_server() -> None:
    """End the worker server once the agent has returned (its workers have all exited)."""
    runtime.stop_forkserver()


def _start_worker_server() -> None:
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

    multiprocessing.set_forkserver_preload(["duoka.train.worker"])
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGTERM, previous)
    # A launch that fails before its workers start (a config or data error found after
    # this) ends the server on the way out, as _run_workers does after its workers.
    atexit.unregister(_stop_worker_server)  # once, however many launches this process makes
    atexit.register(_stop_worker_server)


def _shutdown_timeout() -> dict:
    """On SIGTERM or SIGINT the agent forwards it to the workers, which finish their step and
    save a checkpoint; it gives them DUOKA_SHUTDOWN_TIMEOUT seconds (600) before its SIGKILL,
    so a stop that hangs still ends. LaunchConfig takes the grace period in recent torch (2.13
    here); older ones (2.11) keep their default."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return {}
    return {"shutdown_timeout": int(os.environ.get("DUOKA_SHUTDOWN_TIMEOUT", "600"))}


def _quiet_agent_logs() -> None:
    """The elastic agent logs every worker exit with a traceback of its own polling code, and
    torch.multiprocessing each worker it terminates. A failing worker already leaves its cause
    (and, for a crash, its traceback) in the run directory, and the agent's record says which
    rank died first and how; together they make the one message the user reads."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.elastic", "torch.multiprocessing")):
            logging.getLogger(name).setLevel(logging.CRITICAL)


# ---------------------------------------------------------------- duoka train --slurm-script


def write_slurm_script(out: str, config_path: str | None, overrides: list[str], nnodes: int | None,
                       nproc_per_node: int | None, node_rank: int | None, rdzv_endpoint: str | None,
                       gpus: str | None, max_restarts: int, sbatch_options: list[str], log=print) -> Path:
    """`duoka train ... --slurm-script FILE`: check the config and the layout against the job's
    size now (an error at submission, not after hours in the queue) and write the batch script
    (parallel/cluster.slurm_script) that runs the same command on every node."""
    from duoka.parallel.devices import read_gpus
    from duoka.parallel.dims import ParallelDims

    if node_rank is not None or rdzv_endpoint is not None or gpus is not None:
        flag = "--node-rank" if node_rank is not None else "--rdzv-endpoint" if rdzv_endpoint else "--gpus"
        raise DuokaError(f"{flag} with --slurm-script: inside the job Slurm says which node is which, where node 0 "
                         f"is and which GPUs each node has", f"leave {flag} out (--nproc-per-node N asks for N GPUs "
                         "per node)")
    for option in sbatch_options:
        if not option.startswith("-"):
            raise DuokaError(f"--sbatch={option}: not an sbatch option", "write e.g. --sbatch=--time=24:00:00")
    nnodes = 1 if nnodes is None else nnodes
    if nnodes < 1:
        raise DuokaError(f"--nnodes {nnodes}: a job needs at least one node", "give --nnodes 1 or more")
    if max_restarts < 0:
        raise DuokaError(f"--max-restarts {max_restarts} is negative",
                         "give the number of times the workers may be restarted after a failure (0: none)")
    cfg = load_config(config_path, overrides)
    if cfg.checkpoint.resume not in ("", "auto"):
        raise DuokaError(f"checkpoint.resume={cfg.checkpoint.resume} with --slurm-script: every requeue would "
                         "start again from that checkpoint", "leave checkpoint.resume out (the job continues its "
                         "own run: resume=auto); to start from other weights, set model.path")
    if nproc_per_node is not None and nproc_per_node < 1:
        raise DuokaError(f"--nproc-per-node {nproc_per_node}: a node needs at least one GPU",
                         "give the GPUs per node, e.g. --nproc-per-node 8")
    gpus_per_node = nproc_per_node if nproc_per_node is not None else len(read_gpus())
    ParallelDims.from_config(cfg.parallel, nnodes * max(gpus_per_node, 1))  # the layout fits the job
    command = [*duoka_command(), "train"]
    if config_path:
        command.append(str(Path(config_path).resolve()))
    command += [*overrides, "--checkpoint.resume=auto"]
    if max_restarts:
        command.append(f"--max-restarts={max_restarts}")
    name = "duoka-" + (Path(config_path).stem if config_path else cfg.model.flavor)
    written_by = shlex.join(["duoka", "train", *([config_path] if config_path else []), *overrides,
                             f"--nnodes={nnodes}", *([f"--nproc-per-node={nproc_per_node}"] if nproc_per_node else []),
                             *([f"--max-restarts={max_restarts}"] if max_restarts else []),
                             *[f"--sbatch={o}" for o in sbatch_options], f"--slurm-script={out}"])
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(slurm_script(command, nnodes, gpus_per_node, name, Path.cwd(), sbatch_options, written_by))
    path.chmod(0o755)
    per_node = (f"{gpus_per_node} GPU(s)" if gpus_per_node else
                "1 CPU process (no GPU on this machine: give --nproc-per-node N for N GPUs per node)")
    log(f"duoka: wrote {path}: {nnodes} node(s) x {per_node}, requeued after preemption and ahead of the time "
        f"limit; submit it with: sbatch {path}")
    return path


# ---------------------------------------------------------------- duoka serve


def launch_serving(engine_options: dict, server_options: dict, tp: int = 1, log=print) -> int:
    """`duoka serve`: check what can be checked before any process starts (the model folder,
    the tensor-parallel size against the model's heads, the port), then serve in this process
    (tp 1) or in tp processes started by the elastic agent, rank 0 serving. Returns the exit
    code: 0 after a SIGTERM/SIGINT drain."""
    from duoka.hub import bundled_model_dir, resolve_model_dir
    from duoka.models.qwen2.hf_adapter import read_config
    from duoka.parallel.serve_tp import check_tp_size
    from duoka.serve.engine import BUNDLED_MODEL_NAME

    model = engine_options.get("model")
    folder = resolve_model_dir(model) if model is not None else bundled_model_dir()
    check_tp_size(read_config(folder), tp)
    # The ranks load the resolved folder; clients keep calling the model by the name given.
    name = engine_options.get("served_model_name") or model or BUNDLED_MODEL_NAME
    engine_options = {**engine_options, "model": str(folder), "served_model_name": name}
    if tp == 1:
        from duoka.serve.engine_process import EngineProcess
        from duoka.serve.server import serve

        # The engine in a process of its own: the HTTP loop's work per token then takes no
        # GIL from it (serve.engine_process). With tp > 1 rank 0 runs both, in two threads.
        return serve(lambda: EngineProcess(engine_options), **server_options)
    return _run_serving_workers(engine_options, server_options, tp, log)


def _run_serving_workers(engine_options: dict, server_options: dict, tp: int, log) -> int:
    import tempfile

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from duoka.parallel.devices import read_gpus, visible_indices
    from duoka.serve.worker import serve_worker_main

    host, port = server_options["host"], server_options["port"]
    if not port_is_free(host, port):  # now: rank 0's serve() would find it only after every rank has loaded
        raise DuokaError(f"{host}:{port} is already in use (another server?)",
                         f"stop the other process, or pick another port: --port {port + 1}")
    gpus = read_gpus(check_torch=False)
    if gpus and engine_options.get("device") not in (None, "cuda"):
        raise DuokaError(f"--tp {tp} with --device {engine_options['device']}: each rank takes its own GPU",
                         "leave --device out (or give --device cuda); without GPUs the ranks run on the CPU")
    visible = len(visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus))
    if gpus and tp > visible:
        raise DuokaError(f"--tp {tp} needs {tp} GPUs; {visible} are visible",
                         f"lower --tp to {visible} or less, or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    if not gpus:  # CPU ranks share the cores
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp)))
    endpoint = f"{LOOPBACK}:{free_port()}"
    # A drain must end before the agent's SIGKILL: the grace period plus time to close.
    shutdown = {"shutdown_timeout": int(server_options.get("grace_s", 25) + 30)} if _shutdown_timeout() else {}
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=tp, run_id=str(uuid.uuid4()),
        rdzv_backend=runtime.register_rendezvous(), rdzv_endpoint=endpoint, rdzv_configs={"is_host": True},
        local_addr=LOOPBACK, max_restarts=0, monitor_interval=0.1, start_method="spawn", **shutdown,
    )
    _quiet_agent_logs()
    with tempfile.TemporaryDirectory(prefix="duoka-serve-") as scratch:
        result = Path(scratch) / "rank0"
        handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}
        try:
            elastic_launch(config, serve_worker_main)(engine_options, server_options, str(result))
            return _serving_result(result, None)
        except SignalException as e:
            return _serving_result(result, int(e.sigval))
        except ChildFailedError as e:
            _serving_result(result, None)  # raises rank 0's own error, when it wrote one
            rank, failure = min(e.failures.items())
            raise WorkerFailed(f"serving rank {rank} failed (exit code {failure.exitcode})",
                               "the ranks' messages above say why", EXIT_WORKER_DIED) from None
        finally:
            for s, handler in handlers.items():
                with contextlib.suppress(ValueError):
                    signal.signal(s, handler)


def _serving_result(result: Path, signum: int | None) -> int:
    """Rank 0's own account of how it ended; without one, a signal's conventional code."""
    if result.is_file():
        lines = result.read_text().splitlines()
        code = int(lines[0])
        if code == EXIT_USER_ERROR and len(lines) > 1:
            raise DuokaError(lines[1], lines[2] if len(lines) > 2 and lines[2] else None)
        return code
    return 128 + signum if signum is not None else EXIT_WORKER_DIED
