"""Where `duoka train` runs: inside a Slurm job step, in a Kubernetes Indexed Job or Kubeflow
PyTorchJob, or on a plain machine (the sbatch script that runs it under Slurm:
launch/slurm_script.py).

Detection reads only the environment the scheduler gave the process (and `scontrol show
hostnames` to expand a Slurm host list). It supplies what the launch flags would say: the
number of nodes, this node's rank, the rendezvous endpoint (node 0's host), the GPUs the
scheduler assigned and, under Slurm, a run directory per job id. A flag given on the command
line always wins over what was detected; `resolve_launch` merges the two and writes the one
line that says what was taken from where.

- Slurm (`srun duoka train cfg.toml`, one task per node): SLURM_STEP_NUM_NODES (else
  SLURM_JOB_NUM_NODES / SLURM_NNODES), SLURM_NODEID, the first host of SLURM_STEP_NODELIST
  (else SLURM_JOB_NODELIST) with a port derived from SLURM_JOB_ID, and SLURM_STEP_GPUS where
  CUDA_VISIBLE_DEVICES is not set (Slurm sets it for GPUs allocated as gres).
- torchrun's own variables, as Kubernetes manifests and Kubeflow's PyTorchJob set them:
  PET_NNODES, PET_NODE_RANK (else JOB_COMPLETION_INDEX, an Indexed Job's pod index),
  PET_RDZV_ENDPOINT (else PET_MASTER_ADDR:PET_MASTER_PORT, else MASTER_ADDR:MASTER_PORT,
  what a PyTorchJob sets), PET_NPROC_PER_NODE. They count only where PET_NNODES is set:
  MASTER_ADDR or an index alone says nothing about a multi-node job.
"""

from __future__ import annotations

import itertools
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping

from duoka.errors import DuokaError

# Rendezvous ports under Slurm: torchrun's default 29500 plus the job id modulo 1000, so that
# two jobs whose first node is the same do not collide, and a requeued job (same id) finds
# the same port. 29500-30499 lies below Linux's ephemeral range (32768-60999), where clients'
# outgoing connections take their ports.
SLURM_RDZV_PORT_BASE = 29500
SLURM_RDZV_PORT_SPAN = 1000
SCONTROL_TIMEOUT_S = 10  # `scontrol show hostnames` parses its argument locally: instant where slurm.conf exists
# Seconds of warning the batch script asks for before the time limit: enough to finish a step
# and save a checkpoint (a 7B model's state saves in 26-41 s on one H200 host, bench/results/
# checkpoint_times.md); Slurm may send it up to 60 s earlier than asked.
SLURM_WARNING_S = 120


@dataclass(frozen=True)
class LaunchFlags:
    """`duoka train`'s launch flags as given; None: from the scheduler's environment where it
    has them (resolve_launch), else the single-node default."""
    nproc_per_node: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    gpus: str | None = None
    max_restarts: int = 0


@dataclass(frozen=True)
class Launch:
    """How this node takes part in the job, the flags and the environment merged."""

    nnodes: int
    node_rank: int
    rdzv_endpoint: str | None
    nproc_per_node: int | None  # None: one per selected GPU, or 1 without GPUs (the launcher decides)
    gpus: str | None  # nvidia-smi indices to use, as --gpus takes them
    job_tag: str | None  # names the default run directory (runs/<model>-<tag>); a requeued job keeps it
    detected: str | None  # the line that says what came from the environment; None when nothing did


@dataclass(frozen=True)
class _Found:
    """What one scheduler's environment says; each value with the variables it came from."""

    scheduler: str  # "Slurm job 1234", "Kubernetes Indexed Job", ...
    nnodes: tuple[int, str]
    node_rank: tuple[int, str] | None = None
    # (endpoint, source), asked for only where nnodes > 1: under Slurm it runs scontrol.
    endpoint: Callable[[], tuple[str, str]] | None = None
    nproc_per_node: tuple[int, str] | None = None
    gpus: tuple[str, str] | None = None
    gpu_note: str | None = None
    job_tag: str | None = None
    nnodes_error: DuokaError | None = None  # raised unless --nnodes was given
    endpoint_error: DuokaError | None = None  # raised only if a rendezvous endpoint is needed and not given


def resolve_launch(env: Mapping[str, str], nnodes: int | None = None, node_rank: int | None = None,
                   rdzv_endpoint: str | None = None, nproc_per_node: int | None = None,
                   gpus: str | None = None) -> Launch:
    """The launch flags (None: not given) completed from the scheduler's environment."""
    found = _detect(env)
    if found is None:
        return Launch(1 if nnodes is None else nnodes, 0 if node_rank is None else node_rank, rdzv_endpoint,
                      nproc_per_node, gpus, None, None)
    node_sources, said = [], []  # where the node figures came from; the other things taken
    if nnodes is None:
        if found.nnodes_error:
            raise found.nnodes_error
        nnodes, source = found.nnodes
        node_sources.append(source)
    if node_rank is None and found.node_rank and nnodes > 1:
        node_rank, source = found.node_rank
        node_sources.insert(0, source)
    node_rank = 0 if node_rank is None else node_rank
    if rdzv_endpoint is None and nnodes > 1:
        if found.endpoint_error:
            raise found.endpoint_error
        rdzv_endpoint, source = found.endpoint()
        said.append(f"rendezvous {rdzv_endpoint} ({source})")
    if nproc_per_node is None and found.nproc_per_node:
        nproc_per_node, source = found.nproc_per_node
        said.append(f"{nproc_per_node} process(es) per node ({source})")
    if gpus is None and found.gpus:
        gpus, source = found.gpus
        said.append(f"GPUs {gpus} ({source})")
    elif gpus is None and found.gpu_note:
        said.append(found.gpu_note)
    if found.job_tag:
        said.append(f"run directory runs/<model>-{found.job_tag} unless job.output_dir is set")
    if node_sources:
        said.insert(0, f"node {node_rank} of {nnodes} ({', '.join(node_sources)})")
    detected = f"duoka: {found.scheduler}: {'; '.join(said)}" if said else None
    return Launch(nnodes, node_rank, rdzv_endpoint, nproc_per_node, gpus, found.job_tag, detected)


def _detect(env: Mapping[str, str]) -> _Found | None:
    # torchrun's variables first: a manifest or a user sets them on purpose, where Slurm's
    # come with every process of a job (a torchrun-style job inside an allocation keeps them).
    if "PET_NNODES" in env:
        return _detect_torchrun_env(env)
    if "SLURM_JOB_ID" in env:
        return _detect_slurm(env)
    return None


# ---------------------------------------------------------------- Slurm


def _detect_slurm(env: Mapping[str, str]) -> _Found:
    job = env["SLURM_JOB_ID"]
    restarts = env.get("SLURM_RESTART_COUNT", "0")
    scheduler = f"Slurm job {job}" + (f" (restart {restarts})" if restarts not in ("", "0") else "")
    in_step = "SLURM_STEP_ID" in env  # set by srun; absent in the batch script and in salloc's shell
    nodes_var = _first_set(env, ("SLURM_STEP_NUM_NODES",) if in_step else ()) or \
        _first_set(env, ("SLURM_JOB_NUM_NODES", "SLURM_NNODES"))
    nnodes = _int_var(env, nodes_var) if nodes_var else 1
    nnodes_error = None
    if in_step:
        tasks = env.get("SLURM_STEP_NUM_TASKS")
        if tasks and tasks.isdigit() and int(tasks) != nnodes:
            nnodes_error = DuokaError(
                f"srun started {tasks} tasks on {nnodes} node(s) (SLURM_STEP_NUM_TASKS, {nodes_var}); duoka train "
                "starts the worker processes of its node itself, so it runs as one task per node",
                "start it with `srun --ntasks-per-node=1 duoka train ...` (or #SBATCH --ntasks-per-node=1), or "
                "give --nnodes and --node-rank yourself")
    elif nnodes > 1:
        nnodes_error = DuokaError(
            f"this Slurm job has {nnodes} nodes ({nodes_var}) but duoka train was started outside srun, on one "
            "of them only", "start it on every node with `srun --ntasks-per-node=1 duoka train ...` (or write a "
            "batch script with --slurm-script), or give --nnodes 1 to train on this node alone")
    list_var = _first_set(env, (("SLURM_STEP_NODELIST",) if in_step else ()) + ("SLURM_JOB_NODELIST", "SLURM_NODELIST"))
    endpoint = endpoint_error = None
    if list_var:
        port = SLURM_RDZV_PORT_BASE + int(job) % SLURM_RDZV_PORT_SPAN if job.isdigit() else SLURM_RDZV_PORT_BASE

        def endpoint() -> tuple[str, str]:
            host = first_host(env[list_var], env.get("PATH", ""))
            return f"{host}:{port}", f"first host of {list_var}={env[list_var]}, port from the job id"
    else:
        endpoint_error = DuokaError(f"Slurm job {job} does not say which nodes it has (no SLURM_JOB_NODELIST)",
                                    "give --rdzv-endpoint HOST:PORT (node 0's address)")
    gpus = gpu_note = None
    gpu_list_var = _first_set(env, (("SLURM_STEP_GPUS",) if in_step else ()) + ("SLURM_JOB_GPUS",))
    on_node = env.get("SLURM_GPUS_ON_NODE")
    if "CUDA_VISIBLE_DEVICES" in env:
        assigned = f"; SLURM_GPUS_ON_NODE={on_node}" if on_node else ""
        gpu_note = f"GPUs {env['CUDA_VISIBLE_DEVICES']} (CUDA_VISIBLE_DEVICES{assigned})"
    elif gpu_list_var:
        gpus = (env[gpu_list_var], gpu_list_var)
    else:
        gpu_note = "no GPU from Slurm"
    return _Found(scheduler, nnodes=(nnodes, nodes_var or "no node count: one node"),
                  node_rank=(_int_var(env, "SLURM_NODEID"), "SLURM_NODEID") if "SLURM_NODEID" in env else None,
                  endpoint=endpoint, gpus=gpus, gpu_note=gpu_note, job_tag=f"slurm-{job}",
                  nnodes_error=nnodes_error, endpoint_error=endpoint_error)


def first_host(hostlist: str, path: str) -> str:
    """The first host of a Slurm host list: by `scontrol show hostnames` where the job's PATH
    has it, else by expand_hostlist (the same syntax; scontrol without a slurm.conf retries
    for a minute, hence the timeout)."""
    scontrol = shutil.which("scontrol", path=path)
    if scontrol:
        try:
            out = subprocess.run([scontrol, "show", "hostnames", hostlist], capture_output=True, text=True,
                                 timeout=SCONTROL_TIMEOUT_S)
            if out.returncode == 0 and out.stdout.split():
                return out.stdout.split()[0]
        except (OSError, subprocess.TimeoutExpired):
            pass
    return expand_hostlist(hostlist)[0]


def expand_hostlist(hostlist: str) -> list[str]:
    """Slurm's compressed host list as host names, in Slurm's order: `gpu[01-03,07],login1` ->
    gpu01 gpu02 gpu03 gpu07 login1. A range keeps the width of its lower bound (01-10: 01 ... 10);
    several brackets in one name expand as a product, the last varying fastest
    (`r[1-2]n[1-2]` -> r1n1 r1n2 r2n1 r2n2), as Slurm's hostlist does."""
    hosts: list[str] = []
    for term in _split_outside_brackets(hostlist):
        pieces = re.split(r"(\[[^\[\]]*\])", term)
        choices = []
        for piece in pieces:
            if piece.startswith("["):
                choices.append(_expand_ranges(piece[1:-1], hostlist))
            elif "[" in piece or "]" in piece:
                raise _bad_hostlist(hostlist, "unbalanced brackets")
            elif piece:
                choices.append([piece])
        hosts += ["".join(parts) for parts in itertools.product(*choices)]
    if not hosts:
        raise _bad_hostlist(hostlist, "no host in it")
    return hosts


def _split_outside_brackets(hostlist: str) -> list[str]:
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise _bad_hostlist(hostlist, "unbalanced brackets")
        if ch == "," and depth == 0:
            terms.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise _bad_hostlist(hostlist, "unbalanced brackets")
    terms.append(hostlist[start:])
    return [t.strip() for t in terms if t.strip()]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    out = []
    for item in ranges.split(","):
        lo, _, hi = item.strip().partition("-")
        hi = hi or lo
        if not (lo.isdigit() and hi.isdigit()):
            raise _bad_hostlist(hostlist, f"[{ranges}] holds {item!r}, not a number or a range N-M")
        if int(lo) > int(hi):
            raise _bad_hostlist(hostlist, f"the range {item} runs backwards")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def _bad_hostlist(hostlist: str, why: str) -> DuokaError:
    return DuokaError(f"cannot read the Slurm host list {hostlist!r}: {why}",
                      "give --rdzv-endpoint HOST:PORT (node 0's address) yourself")


# ---------------------------------------------------------------- torchrun's variables (Kubernetes)


def _detect_torchrun_env(env: Mapping[str, str]) -> _Found:
    raw = env["PET_NNODES"]
    low, _, high = raw.partition(":")
    if not low.isdigit() or (high and not high.isdigit()) or int(low) < 1:
        raise DuokaError(f"PET_NNODES={raw!r} is not a number of nodes", "set PET_NNODES to the job's node count")
    if high and high != low:
        raise DuokaError(f"PET_NNODES={raw} asks for an elastic range of nodes; duoka trains on a fixed number "
                         "(its data order and checkpoints assume one world size per run)",
                         "give min = max nodes (a PyTorchJob without elasticPolicy, or PET_NNODES=N)")
    nnodes = int(low)
    if "PET_NODE_RANK" in env:
        rank = (_int_var(env, "PET_NODE_RANK"), "PET_NODE_RANK")
    elif "JOB_COMPLETION_INDEX" in env:
        rank = (_int_var(env, "JOB_COMPLETION_INDEX"), "JOB_COMPLETION_INDEX")
    else:
        rank = None
    scheduler = "Kubernetes Indexed Job" if rank and rank[1] == "JOB_COMPLETION_INDEX" else "torchrun's environment"
    endpoint_error = None
    if env.get("PET_RDZV_ENDPOINT"):
        given = (env["PET_RDZV_ENDPOINT"], "PET_RDZV_ENDPOINT")
    elif env.get("PET_MASTER_ADDR") and env.get("PET_MASTER_PORT"):
        given = (f"{env['PET_MASTER_ADDR']}:{env['PET_MASTER_PORT']}", "PET_MASTER_ADDR, PET_MASTER_PORT")
    elif env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        given = (f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}", "MASTER_ADDR, MASTER_PORT")
        scheduler = "Kubeflow PyTorchJob" if rank and rank[1] == "PET_NODE_RANK" else scheduler
    else:
        given = None
        endpoint_error = DuokaError(f"PET_NNODES={nnodes} but no rendezvous endpoint is set",
                                    "set PET_RDZV_ENDPOINT=HOST:PORT (node 0's address, e.g. the pod of index 0 "
                                    "behind a headless Service), or give --rdzv-endpoint")
    endpoint = (lambda: given) if given else None
    nnodes_error = None
    if rank is None and nnodes > 1:
        nnodes_error = DuokaError(f"PET_NNODES={nnodes} but this node's rank is not set",
                                  "set PET_NODE_RANK, or run as a Kubernetes Indexed Job (JOB_COMPLETION_INDEX), "
                                  "or give --node-rank")
    nproc = None
    per_node = env.get("PET_NPROC_PER_NODE", "")
    if per_node.isdigit() and int(per_node) > 0:
        nproc = (int(per_node), "PET_NPROC_PER_NODE")
    elif per_node not in ("", "auto", "gpu"):
        raise DuokaError(f"PET_NPROC_PER_NODE={per_node!r} is not a number of processes",
                         "set it to the GPUs per node, or to auto (one process per visible GPU)")
    return _Found(scheduler, nnodes=(nnodes, "PET_NNODES"), node_rank=rank, endpoint=endpoint,
                  nproc_per_node=nproc, nnodes_error=nnodes_error, endpoint_error=endpoint_error)


def _first_set(env: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    return next((name for name in names if env.get(name)), None)


def _int_var(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    if not value.strip().isdigit():
        raise DuokaError(f"{name}={value!r} is not a number", f"unset {name}, or give the launch flags yourself")
    return int(value)
