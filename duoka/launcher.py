"""`duoka train`: resolve and check everything once, then start the workers through
PyTorch's elastic launcher (the machinery behind torchrun) with c10d rendezvous.

All checks that can fail on user input run here, before a single worker starts: config
keys and ranges, the model and tokenizer, the parallel layout against the process count,
the batch arithmetic, the data. Workers that still fail write their error to the run
directory, and the launcher turns it into one message.

Multi-node: run the same command on every node with --nnodes, --node-rank and the same
--rdzv-endpoint HOST:PORT (node 0's address); under Slurm, one task per node:
    srun --nodes=2 --ntasks-per-node=1 duoka train cfg.toml --nnodes 2 \
        --node-rank $SLURM_NODEID --rdzv-endpoint $(scontrol show hostnames | head -1):29500
"""

from __future__ import annotations

import atexit
import json
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from duoka import runtime
from duoka.config import Config, load_config, to_toml
from duoka.errors import DuokaError
from duoka.parallel.ports import free_port, parse_endpoint, port_is_free
from duoka.train.spec import STOPPED_MARKER, RunSpec


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


def run_directory(cfg: Config, node_rank: int) -> Path:
    if cfg.job.output_dir:
        run_dir = Path(cfg.job.output_dir)
    else:
        if cfg.checkpoint.resume == "auto":
            raise DuokaError("checkpoint.resume=auto needs job.output_dir (the run to continue)",
                             "add --job.output_dir=runs/<the run>")
        name = (Path(cfg.model.path).name if cfg.model.path else cfg.model.flavor) + time.strftime("-%Y%m%d-%H%M%S")
        run_dir = Path("runs") / name
    if node_rank == 0 and (run_dir / "metrics.jsonl").exists() and not cfg.checkpoint.resume:
        raise DuokaError(f"run directory {run_dir} already holds a run (metrics.jsonl)",
                         "continue it with --checkpoint.resume=auto, or choose a new job.output_dir")
    return run_dir


def launch_training(
    config_path: str | None,
    overrides: list[str],
    nproc_per_node: int | None = None,
    nnodes: int = 1,
    node_rank: int = 0,
    rdzv_endpoint: str | None = None,
    gpus: str | None = None,
    log=print,
) -> Path:
    from duoka.parallel.devices import device_env, read_gpus, select_gpus

    cfg = load_config(config_path, overrides)
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
    if nproc_per_node < 1:
        raise DuokaError(f"--nproc-per-node {nproc_per_node} must be >= 1")
    world = nproc_per_node * nnodes
    if not gpu_list and "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:
        # CPU workers share the cores; without this each starts one thread per core and
        # they oversubscribe the machine (torchrun sets 1; a fair share is faster).
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc_per_node))
    os.environ.update(env)  # the worker environment is complete: the worker server may start
    if world > 1:
        _start_worker_server()
    if not gpu_list:
        read_gpus()  # raises if PyTorch sees GPUs that NVML could not list

    # Imports that load torch come after the worker server has started: its own import of
    # torch then overlaps this process's.
    from duoka.data.dataset import RANDOM_DATA, PackedWindows, end_of_text_id, tokenize_corpus
    from duoka.data.prepare import MANIFEST, is_prepared
    from duoka.data.sft import prepare_sft
    from duoka.data.tokenizer import Tokenizer
    from duoka.hub import bundled_corpus
    from duoka.models.qwen2.stages import layer_counts
    from duoka.parallel.balance import check_config as check_balance_config
    from duoka.parallel.dims import ParallelDims
    from duoka.parallel.parallelize import check_float8
    from duoka.plan.memory import auto_blocks_per_unit
    from duoka.train.checkpoint import find_resume_checkpoint, read_train_state
    from duoka.train.optim import pipeline_microbatches, plan_batch

    # Everything a worker would otherwise discover late, resolved once.
    args, model_dir, tokenizer_dir = resolve_model(cfg)
    dims = ParallelDims.from_config(cfg.parallel, world)
    dims.check_model(args.n_heads, args.n_kv_heads, args.n_layers, cfg.parallel.pp_stages_per_rank)
    check_balance_config(cfg.parallel, cfg.debug, dims.model_parallel, dims.tp, dims.pp, dims.dp_size, world)
    check_float8(cfg.training.float8, dims.tp)
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
                manifest = json.loads((data_path / MANIFEST).read_text())
                if manifest["tokenizer"] != tokenizer.fingerprint:
                    raise DuokaError(f"{data_path} was prepared with the tokenizer in {manifest['tokenizer_dir']}, "
                                     f"not the model's ({tokenizer.folder})",
                                     f"prepare it again: duoka prepare --data SOURCE --out DIR --tokenizer {tokenizer.folder}")
                token_file = str(data_path)
            else:
                token_file = str(tokenize_corpus(data_path, tokenizer, cfg.data.text_field))
            windows = len(PackedWindows(Path(token_file), cfg.training.seq_len))  # raises if the corpus is too small
            log(f"duoka: data {data_path}: {windows:,} windows of {cfg.training.seq_len} tokens "
                f"({time.perf_counter() - t:.1f} s)")
        tokenizer_files = _tokenizer_files(tokenizer_dir)

    run_dir = run_directory(cfg, node_rank)
    cfg.job.output_dir = str(run_dir)
    resume_from = find_resume_checkpoint(run_dir, cfg.checkpoint.resume)
    resume_step = 0
    if resume_from is not None:
        resume_step = read_train_state(resume_from)["step"]
        if resume_step > cfg.training.steps:
            raise DuokaError(f"{resume_from} is at step {resume_step}, past training.steps={cfg.training.steps}",
                             f"raise training.steps above {resume_step} to train further")
        log(f"duoka: resuming from {resume_from} (step {resume_step})")
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.glob("error-rank*.json"):
        stale.unlink()
    if node_rank == 0:
        (run_dir / "config.toml").write_text(to_toml(cfg))

    spec = RunSpec(config=cfg.to_dict(), run_dir=str(run_dir), model_args=asdict(args), world_size=world,
                   model_dir=str(model_dir) if model_dir else None, token_file=token_file,
                   tokenizer_files=tuple(tokenizer_files), end_of_text=end_of_text,
                   resume_from=str(resume_from) if resume_from else None, resume_step=resume_step,
                   micro_batch=micro_batch, fsdp_blocks_per_unit=blocks_per_unit, stage_layers=stage_layers)
    log(f"duoka: {world} process(es) ({nnodes} node(s) x {nproc_per_node}), run directory {run_dir}")
    _run_workers(spec, nproc_per_node, nnodes, node_rank, rdzv_endpoint, log)
    stopped = run_dir / STOPPED_MARKER
    if stopped.exists():
        stopped.unlink()
        raise TrainingStopped(run_dir)
    return run_dir


class TrainingStopped(Exception):
    """The job saved a checkpoint and stopped early on SIGTERM (exit code 143, as a job
    killed by SIGTERM, so schedulers and `&&` chains do not mistake it for a finished run)."""

    def __init__(self, run_dir: Path):
        super().__init__(f"stopped early; continue with --checkpoint.resume=auto --job.output_dir={run_dir}")


def _tokenizer_files(folder: Path) -> list[str]:
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
             "generation_config.json")
    return [str(folder / n) for n in names if (folder / n).is_file()]


def _run_workers(spec, nproc_per_node: int, nnodes: int, node_rank: int, rdzv_endpoint: str | None, log) -> None:
    from duoka.train.worker import worker_main

    if nnodes == 1 and nproc_per_node == 1:
        # One process: run in this one, no agent to start (faster, and debuggers work).
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        try:
            worker_main(spec)
        except SystemExit:
            _raise_worker_error(spec.run_dir)
            raise
        return

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if rdzv_endpoint is None:
        endpoint = f"127.0.0.1:{free_port()}"
    else:
        host, port = parse_endpoint(rdzv_endpoint)
        endpoint = rdzv_endpoint
        if node_rank == 0 and not port_is_free(host, port):
            if nnodes == 1:
                new = free_port()
                log(f"duoka: rendezvous port {port} is in use; using {new} instead")
                endpoint = f"{host}:{new}"
            else:
                raise DuokaError(f"rendezvous port {port} on {host} is already in use (another job, or a stale one)",
                                 f"pick another port for every node, e.g. --rdzv-endpoint {host}:{free_port()}")
    config = LaunchConfig(
        min_nodes=nnodes, max_nodes=nnodes, nproc_per_node=nproc_per_node,
        # Every node derives the same id from the endpoint they share.
        run_id=os.environ.get("DUOKA_RUN_ID") or str(uuid.uuid5(uuid.NAMESPACE_URL, endpoint)),
        rdzv_backend="c10d", rdzv_endpoint=endpoint,
        rdzv_configs={"is_host": node_rank == 0, "join_timeout": 600} if nnodes > 1 else {"is_host": True},
        max_restarts=0, monitor_interval=0.1, start_method="forkserver",
        **_shutdown_timeout(),
    )
    _start_worker_server()  # already running unless this is a single-process job
    _quiet_agent_logs()
    try:
        elastic_launch(config, worker_main)(spec)
    except SignalException:
        if (Path(spec.run_dir) / STOPPED_MARKER).exists():
            return  # the workers saved and stopped; launch_training reports it
        raise
    except ChildFailedError:
        _raise_worker_error(spec.run_dir)
        raise
    finally:
        _stop_worker_server()


def _stop_worker_server() -> None:
    """End the worker server once the agent has returned (its workers have all exited)."""
    runtime.stop_forkserver()


def _start_worker_server() -> None:
    """Workers are forked from one server process that has imported torch and the trainer
    once (4 s on a busy core) instead of each importing them afresh as under spawn; the
    server never touches CUDA, so its children initialise CUDA cleanly, as with spawn.
    Started as soon as the worker environment (GPU selection, thread counts) is final, its
    import runs while this process checks the config, model and data. The elastic
    launcher's forkserver start method then uses this same server."""
    import multiprocessing
    from multiprocessing import forkserver

    multiprocessing.set_forkserver_preload(["duoka.train.worker"])
    forkserver.ensure_running()
    # A launch that fails before its workers start (a config or data error found after
    # this) ends the server on the way out, as _run_workers does after its workers.
    atexit.unregister(_stop_worker_server)  # once, however many launches this process makes
    atexit.register(_stop_worker_server)


def _shutdown_timeout() -> dict:
    """On SIGTERM (preemption) the agent forwards it to the workers, which finish their step
    and save a checkpoint; give them time before the agent's SIGKILL. LaunchConfig takes
    the grace period in recent torch (2.13 here); older ones (2.11) keep their default."""
    import dataclasses

    from torch.distributed.launcher.api import LaunchConfig

    if "shutdown_timeout" not in {f.name for f in dataclasses.fields(LaunchConfig)}:
        return {}
    return {"shutdown_timeout": int(os.environ.get("DUOKA_SHUTDOWN_TIMEOUT", "600"))}


def _quiet_agent_logs() -> None:
    """The elastic agent logs every worker exit with a traceback of its own polling code.
    A failing worker already leaves its cause (and, for a crash, its traceback) in the run
    directory, which becomes the one message the user reads; keep the agent's noise out."""
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed.elastic"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _raise_worker_error(run_dir: str) -> None:
    errors = sorted(Path(run_dir).glob("error-rank*.json"))
    if not errors:
        return
    first = json.loads(errors[0].read_text())
    ranks = ", ".join(e.stem.removeprefix("error-rank") for e in errors)
    raise DuokaError(f"training stopped on rank(s) {ranks}: {first['cause']}", first["fix"])
