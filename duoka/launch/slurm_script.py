"""`duoka train ... --slurm-script FILE`: the sbatch script that runs the same training on
every node of a Slurm job, requeued after preemption and ahead of the time limit, written
after the config and the layout were checked against the job's size (an error at submission,
not after hours in the queue). Apart from detection (launch/cluster.py), which every launch
reads before torch loads: this module checks the layout, which needs torch."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from duoka.config import load_config
from duoka.errors import DuokaError
from duoka.host.devices import read_gpus
from duoka.launch.cluster import SLURM_WARNING_S, LaunchFlags
from duoka.parallel.dims import ParallelDims


def slurm_script(command: list[str], nnodes: int, gpus_per_node: int, job_name: str, workdir: Path,
                 extra_options: list[str], written_by: str) -> str:
    """An sbatch script that runs `command` (duoka train ... --checkpoint.resume=auto) once per
    node and continues the same run after preemption, a requeue or the time limit."""
    # (option, why): the reasons go on comment lines of their own, which every sbatch version skips.
    options = [(f"--job-name={job_name}", None), (f"--nodes={nnodes}", None),
               ("--ntasks-per-node=1", "one duoka train per node: it starts the node's workers itself")]
    if gpus_per_node:
        options.append((f"--gpus-per-node={gpus_per_node}", None))
    options += [
        ("--exclusive", "whole nodes: every CPU and GPU of a node goes to its one duoka train"),
        ("--mem=0", "and all of each node's memory"),
        ("--requeue", "preemption and node failure put the job back in the queue"),
        (f"--signal=B:USR1@{SLURM_WARNING_S}", "the time-limit warning, to this script (below)"),
        ("--open-mode=append", "a requeued job adds to its output file instead of truncating it"),
        (f"--chdir={workdir}", None),
        *((option, None) for option in extra_options),
    ]
    directives = []
    for option, why in options:
        directives += ([f"# {why}"] if why else []) + [f"#SBATCH {option}"]
    lines = [
        "#!/bin/bash",
        f"# duoka train on {nnodes} node(s) as a Slurm batch job; submit it with sbatch.",
        f"# Written by: {written_by}",
        "#",
        "# Preemption, `scontrol requeue` and scancel send SIGTERM to every node's duoka train, which",
        "# finishes its step and saves a checkpoint (Slurm's KillWait or the preemption GraceTime must",
        "# cover a save). Ahead of the time limit Slurm signals this script, which asks the nodes to save",
        "# the same way and requeues the job. A requeued job keeps its id, so its run directory",
        "# (runs/<model>-slurm-<id> unless job.output_dir is set), and --checkpoint.resume=auto continues",
        "# there from the newest intact checkpoint. Options added with --sbatch come last and win.",
        *directives,
        "",
        "warned=0",
        "# The time-limit warning: SIGTERM to the job's steps (every node's duoka train), not to this",
        "# shell; once they have saved, the job goes back in the queue (below).",
        "trap 'warned=1; scancel --signal=TERM \"$SLURM_JOB_ID\"' USR1",
        "# A cancel or requeue signals this shell too: it waits for the steps to save before ending.",
        "trap ':' TERM",
        f'srun --cpus-per-task="$SLURM_CPUS_ON_NODE" {shlex.join(command)} &',
        "step=$!",
        "# A trapped signal ends `wait` early: wait again until the step has exited.",
        'wait "$step"; code=$?',
        'while kill -0 "$step" 2>/dev/null; do wait "$step"; code=$?; done',
        "# Stopped by the warning before its last step: continue in a new allocation.",
        'if [ "$warned" = 1 ] && [ "$code" -ne 0 ]; then scontrol requeue "$SLURM_JOB_ID"; fi',
        'exit "$code"',
        "",
    ]
    return "\n".join(lines)


def duoka_command() -> list[str]:
    """How the batch job starts this installation of duoka: its own `duoka` script when it sits
    beside this interpreter (the same environment), else this interpreter with -m duoka.cli."""
    script = Path(sys.executable).parent / "duoka"
    return [str(script)] if script.is_file() and os.access(script, os.X_OK) else [sys.executable, "-m", "duoka.cli"]


def write_slurm_script(out: str, config_path: str | None, overrides: list[str], flags: LaunchFlags,
                       sbatch_options: list[str], log=print) -> Path:
    """`duoka train ... --slurm-script FILE`: check the config and the layout against the job's
    size now (an error at submission, not after hours in the queue) and write the batch script
    (slurm_script) that runs the same command on every node."""
    nnodes, nproc_per_node, max_restarts = flags.nnodes, flags.nproc_per_node, flags.max_restarts
    node_rank, rdzv_endpoint, gpus = flags.node_rank, flags.rdzv_endpoint, flags.gpus
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
