"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a folder `checkpoints/step-N/` holding
- the DCP files of the model and optimizer state, each rank writing its own shards
  (parameter names are the plain model's, so any layout can load them: DCP reshards);
- `train_state.json`: step, tokens seen, the model shape, the resolved config and the RNG
  state, everything else needed to continue;
- the tokenizer files, so `duoka export` of one folder is self-contained.

Atomicity: everything is written into `step-N.partial` and renamed to `step-N` by rank 0
only after every rank finished; a folder without that rename is never loaded, so a crash
or kill -9 mid-save leaves the previous checkpoint as the newest complete one. The data
order and the LR schedule are functions of the step, so the step is all the sampler needs
to reproduce the remaining stream exactly, under any number of data-parallel ranks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from duoka.errors import DuokaError

STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a folder counts once renamed and with its state file)."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / STATE_FILE).is_file() and (p / ".metadata").is_file():
            found.append((int(m.group(1)), p))
    return [p for _, p in sorted(found)]


def find_resume_checkpoint(run_dir: Path, resume: str) -> Path | None:
    if not resume:
        return None
    if resume == "auto":
        done = complete_checkpoints(run_dir)
        return done[-1] if done else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file() or not (path / ".metadata").is_file():
        raise DuokaError(f"checkpoint.resume={resume} is not a complete duoka checkpoint "
                         f"(it needs {STATE_FILE} and .metadata)",
                         "point at a checkpoints/step-N folder, or use checkpoint.resume=auto")
    return path


def read_train_state(path: Path) -> dict:
    return json.loads((path / STATE_FILE).read_text())


def _app_state(model, optimizer) -> dict:
    # Full FQNs of the plain model; DTensor shards stay sharded (no gather on save).
    opts = StateDictOptions(full_state_dict=False)
    return {"model": get_model_state_dict(model, options=opts),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=opts)}


class PendingSave:
    """An asynchronous save in flight: the state was copied to host memory (training was
    blocked only for that), the files are being written by a background thread. Rank 0
    publishes the checkpoint (state file, rename, pruning) once its write is done: DCP's
    coordinator finishes only after every rank has written, so that is safe."""

    def __init__(self, future, publish):
        self.future, self.publish = future, publish
        self.step, self.blocked_s = 0, 0.0  # set by the trainer, for its log line

    def poll(self, wait: bool = False) -> bool:
        if not wait and not self.future.done():
            return False
        self.future.result()  # re-raises a failed write
        self.publish()
        return True


def async_stager(device: torch.device) -> AsyncStager:
    """One stager per run, reused by every asynchronous save. On GPU it keeps pinned host
    buffers for the whole state, allocated by the first save (pinning costs seconds) and
    refilled by the later ones at copy-engine speed; without CUDA there is nothing to pin.
    (torch's DefaultStager would overlap even the copy with the next step, but its
    deep copy fails on FSDP2's DTensor state in torch 2.11: KeyError <class 'type'>.)"""
    return BlockingAsyncStager(cache_staged_state_dict=device.type == "cuda")


def save_checkpoint(run_dir: Path, step: int, model, optimizer, train_state: dict, tokenizer_files: list[str],
                    keep: int, async_group=None, write_threads: int = 1, stager: AsyncStager | None = None):
    """Returns the checkpoint path, or a PendingSave when given async_group (a gloo process
    group of its own, since the background thread's collectives must not interleave with
    the training loop's on the same group) and the run's stager (see async_stager)."""
    rank = dist.get_rank()
    final = run_dir / "checkpoints" / f"step-{step}"
    partial = final.with_name(final.name + ".partial")
    if rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    state = dict(train_state, step=step, rng_cpu=torch.get_rng_state().tolist())

    def publish() -> None:
        if rank != 0:
            return
        (partial / STATE_FILE).write_text(json.dumps(state, indent=1))
        for f in tokenizer_files:
            shutil.copy2(f, partial / Path(f).name)
        if final.exists():  # a re-run of the same step: replace it only now that the new one is whole
            shutil.rmtree(final)
        os.replace(partial, final)
        for old in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    # write_threads files per rank, written in parallel: one thread alone does not fill a fast disk.
    writer = dcp.FileSystemWriter(str(partial), thread_count=write_threads)
    if async_group is not None:
        future = dcp.async_save(_app_state(model, optimizer), storage_writer=writer, process_group=async_group,
                                async_stager=stager)
        return PendingSave(future, publish)
    dcp.save(_app_state(model, optimizer), storage_writer=writer)
    publish()
    dist.barrier()
    return final


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Load model and optimizer state into the (possibly differently) parallelized model."""
    state = _app_state(model, optimizer)
    dcp.load(state, checkpoint_id=str(path))
    set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=False))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=False))
    train_state = read_train_state(path)
    torch.set_rng_state(torch.tensor(train_state["rng_cpu"], dtype=torch.uint8))
    return train_state


def load_model_weights(path: Path, model, no_dist: bool = False) -> None:
    """Only the model part (for export) into a plain single-process model; no_dist when a
    process group exists but this process reads alone."""
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path), no_dist=no_dist)
