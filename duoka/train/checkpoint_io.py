"""Resumable checkpoints with torch.distributed.checkpoint (DCP).

A checkpoint is a folder `checkpoints/step-N/` holding
- the DCP files of the model and optimizer state, each rank writing its own shards
  (parameter names are the plain model's, so any layout can load them: DCP reshards);
- `train_state.json`: step, tokens seen, the model shape, the resolved config and the RNG
  state, everything else needed to continue;
- the tokenizer files, so `duoka export` of one folder is self-contained;
- `manifest.json`, written last: every file's size and checksum (see integrity.py).

Atomicity: everything is written into `step-N.partial`, fsynced, and renamed to `step-N` by
rank 0 only after every rank finished; a folder without that rename is never loaded, so a
crash or kill -9 mid-save leaves the previous checkpoint as the newest complete one. A
failed save (a full disk) removes its `.partial` folder and ends in one DuokaError on every
rank. A resume checks the manifest first and falls back to the newest intact checkpoint.
The data order and the LR schedule are functions of the step, so the step is all the
sampler needs to reproduce the remaining stream exactly, under any number of data-parallel
ranks.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException, DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.staging import AsyncStager, BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from duoka.errors import DuokaError
from duoka.train.integrity import (
    FIX_DAMAGED,
    FIX_WRITE,
    MANIFEST,
    METADATA,
    STATE_FILE,
    UNVERIFIED,
    copy_synced,
    disk_full,
    find_damage,
    fix_for,
    fsync_dir,
    has_manifest,
    is_disk_full,
    load_metadata,
    read_state,
    refused_item,
    write_manifest,
    write_rank_sums,
    write_synced,
)

_STEP_DIR = re.compile(r"^step-(\d+)$")
# What torch.save adds to each tensor's bytes in a DCP file (measured: ~1.6 KiB), with margin.
_BYTES_PER_ITEM = 4096


def _step_dirs(run_dir: Path) -> list[Path]:
    """Renamed (finished) checkpoint folders, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def checkpoint_step(path: Path) -> int:
    """The step of a checkpoints/step-N folder, from its name."""
    return int(_STEP_DIR.match(path.name).group(1))


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (a folder counts once renamed and with its state file)."""
    return [p for p in _step_dirs(run_dir) if (p / STATE_FILE).is_file() and (p / METADATA).is_file()]


def choose_resume_checkpoint(run_dir: Path, resume: str, trust_unverified: bool = False
                             ) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from, and what was skipped on the way (one line each).
    `auto` takes the newest checkpoint that passes every check (integrity.find_damage); a
    named one must pass them, or it is an error. One without a manifest passes only when
    trusted (checkpoint.trust_unverified), with a warning."""
    if not resume:
        return None, []
    unverified = "{} has no manifest (trusted by checkpoint.trust_unverified): not verified"
    if resume != "auto":
        path = Path(resume)
        if not any((path / name).is_file() for name in (STATE_FILE, METADATA, MANIFEST)):
            raise DuokaError(f"checkpoint.resume={resume} is not a duoka checkpoint (it has no {STATE_FILE}, "
                             f"{METADATA} or {MANIFEST})",
                             "point at a checkpoints/step-N folder, or use checkpoint.resume=auto")
        if (damage := find_damage(path, trust_unverified)) is not None:
            raise DuokaError(f"checkpoint.resume={resume} is damaged: {damage}", fix_for(damage))
        return path, [] if has_manifest(path) else [unverified.format(path)]
    skipped = []
    candidates = _step_dirs(run_dir)
    for path in reversed(candidates):
        if (damage := find_damage(path, trust_unverified)) is None:
            if not has_manifest(path):
                skipped.append(unverified.format(path))
            return path, skipped
        skipped.append(f"{path} is damaged, skipped: {damage}" if damage != UNVERIFIED else
                       f"{path} is skipped: {damage} (--checkpoint.trust_unverified=true loads it)")
    if candidates:
        raise DuokaError(f"no intact checkpoint in {run_dir / 'checkpoints'}: " + "; ".join(skipped),
                         "restore the damaged files from a copy, or start afresh with another job.output_dir")
    return None, []


def find_resume_checkpoint(run_dir: Path, resume: str, warn: Callable[[str], None] | None = None,
                           trust_unverified: bool = False) -> Path | None:
    """choose_resume_checkpoint, saying what it skipped through warn (stderr by default)."""
    path, skipped = choose_resume_checkpoint(run_dir, resume, trust_unverified)
    for line in skipped:
        (warn or _warn)(line)
    return path


def _warn(message: str) -> None:
    print(f"duoka: warning: {message}", file=sys.stderr, flush=True)


def read_train_state(path: Path) -> dict:
    """train_state.json of a checkpoint (a DuokaError when missing or damaged)."""
    return read_state(path)


def is_healthy(path: Path) -> bool:
    """A checkpoint saved from weights the run still trusts (train_state's `healthy`, true
    when absent)."""
    try:
        return read_state(path).get("healthy", True) is not False
    except DuokaError:
        return False


def prune(run_dir: Path, keep: int) -> None:
    """Keep the newest `keep` checkpoints and the newest `keep` healthy ones: an unhealthy
    checkpoint never takes the place of a healthy one, so the newest healthy one survives.
    Called once a normal step has followed the newest save (Checkpointer.prune_if_confirmed)."""
    done = complete_checkpoints(run_dir)
    healthy = [p for p in done if is_healthy(p)]
    kept = set(done[-keep:]) | set(healthy[-keep:])
    for old in done:
        if old not in kept:
            shutil.rmtree(old, ignore_errors=True)


def explain_checkpoint_error(e: CheckpointException, action: str, path: Path, needed: int | None = None) -> DuokaError:
    """DCP's CheckpointException (a BaseException carrying every failed rank's exception) as
    one DuokaError, the same on every rank: each rank gets the same failures."""
    failures = {rank: failure[0] for rank, failure in sorted(e.failures.items())}
    for exc in failures.values():
        if isinstance(exc, DuokaError):
            return exc
    for exc in failures.values():
        if is_disk_full(exc):
            return disk_full(path.parent, needed)
    rank, exc = next(iter(failures.items()))
    return DuokaError(f"could not {action} checkpoint {path}: rank {rank}: {type(exc).__name__}: {exc}",
                      FIX_DAMAGED if action == "load" else FIX_WRITE)


class _CapturingFileSystem(FileSystem):
    """DCP's file system, recording the files written and keeping an OSError raised while a
    file is written: DCP's extra write threads would lose it (printing a traceback), so
    the writer raises it on its own thread once every file is done."""

    def __init__(self):
        super().__init__()
        self.capture, self.written, self.errors = False, [], []

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if not self.capture:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        failed = False
        try:
            with contextlib.ExitStack() as files:
                try:
                    stream = files.enter_context(super().create_stream(path, mode))
                except OSError as e:  # the caller's body runs anyway, writing nowhere
                    self.errors.append(e)
                    failed, stream = True, files.enter_context(open(os.devnull, "wb"))
                yield stream
        except OSError as e:
            self.errors.append(e)
            failed = True
        if not failed:
            self.written.append(Path(path))


def _planned_bytes(plan) -> int:
    """What a DCP save plan writes, a little over the files' size."""
    total = 0
    for item in plan.items:
        if item.tensor_data is not None:
            total += math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize
        elif item.bytes_io_data is not None:
            total += item.bytes_io_data.nbytes
        total += _BYTES_PER_ITEM
    return total


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer (its files fsynced), plus: a save the disk cannot hold fails before
    writing, a full disk is named as such, and each rank checksums the files it wrote for
    the manifest. `needed` is the checkpoint's size on the coordinator, which plans the
    whole save, and this rank's share on the others."""

    def __init__(self, folder: Path, thread_count: int):
        super().__init__(str(folder), thread_count=thread_count, sync_files=True)
        self.fs = _CapturingFileSystem()
        self.folder, self.needed = folder, 0

    def prepare_global_plan(self, plans):
        plans = super().prepare_global_plan(plans)
        self.needed = sum(_planned_bytes(p) for p in plans)
        if self.needed > shutil.disk_usage(self.folder).free:
            raise disk_full(self.folder.parent, self.needed)
        return plans

    def write_data(self, plan, planner):
        self.needed = self.needed or _planned_bytes(plan)
        self.fs.capture = True
        try:
            future = super().write_data(plan, planner)
        finally:
            self.fs.capture = False
        if self.fs.errors:
            raise self.failure(self.fs.errors[0])
        try:
            write_rank_sums(self.folder, dist.get_rank() if self.rank is None else self.rank, self.fs.written)
        except OSError as e:
            raise self.failure(e) from None
        return future

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except OSError as e:
            raise self.failure(e) from None

    def failure(self, e: OSError) -> DuokaError:
        if is_disk_full(e):
            return disk_full(self.folder.parent, self.needed)
        return DuokaError(f"could not write checkpoint {self.folder}: {type(e).__name__}: {e}", FIX_WRITE)


class _Reader(dcp.FileSystemReader):
    """DCP's file reader, with the metadata read by integrity's restricted unpickler (and
    read at construction, so a refused or damaged one is one DuokaError on each rank before
    DCP's collectives and its own retries start)."""

    def __init__(self, folder: Path):
        super().__init__(str(folder))
        self.metadata = load_metadata(folder)

    def read_metadata(self, *args, **kwargs):
        if getattr(self.metadata, "storage_meta", None) is not None:
            self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class _PlainValuesPlanner(DefaultLoadPlanner):
    """DCP's load planner, except for bytes items (the non-tensor values of the saved state:
    the optimizer's hyper-parameters and step counts), which are unpickled by torch's
    weights-only loader: it builds plain values and tensors and refuses every other global.
    DCP's own planner hands them to torch.load(weights_only=False), so a .distcp shard
    crafted to declare a pickled object as a bytes item would run its code on every rank."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            plain = torch.load(value, weights_only=True)
        except Exception as e:  # UnpicklingError for a refused global; anything else is damage
            raise refused_item(self.folder, read_item.dest_index.fqn, e) from None
        # Handed on as DCP stores it, re-saved from the plain value: DCP's own unpickling
        # then reads bytes written here, never the file's.
        again = io.BytesIO()
        torch.save(plain, again)
        again.seek(0)
        super().load_bytes(read_item, again)


def plain_name(name: str) -> str:
    """A parameter's name in the plain model, without the wrappers' prefixes."""
    for wrapper in ("_orig_mod.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(wrapper, "")
    return name


def trained_names(model) -> set[str] | None:
    """The plain names of the parameters that train, when some do not (a LoRA model: its
    frozen base is read from the base model, never saved); None when all train."""
    named = list(model.named_parameters(remove_duplicate=False))
    if all(p.requires_grad for _, p in named):
        return None
    return {plain_name(name) for name, p in named if p.requires_grad}


def _model_state(model, state: dict) -> dict:
    """What a checkpoint holds of the model: every parameter, or only those that train."""
    trained = trained_names(model)
    return state if trained is None else {k: v for k, v in state.items() if k in trained}


def _app_state(model, optimizer) -> dict:
    # Full FQNs of the plain model; DTensor shards stay sharded (no gather on save).
    opts = StateDictOptions(full_state_dict=False)
    return {"model": _model_state(model, get_model_state_dict(model, options=opts)),
            "optimizer": get_optimizer_state_dict(model, optimizer, options=opts)}


class PendingSave:
    """An asynchronous save in flight: the state was copied to host memory (training was
    blocked only for that), the files are being written by a background thread. finish()
    is called by every rank at the same step: it waits for the write (DCP's coordinator
    finishes only after every rank has written), then rank 0 publishes the checkpoint
    (state file, manifest, rename, pruning)."""

    def __init__(self, future, publish: Callable[[], None], writer: _Writer):
        self.future, self.publish, self.writer = future, publish, writer
        self.step, self.blocked_s = 0, 0.0  # set by the trainer, for its log line

    def done(self) -> bool:
        return self.future.done()

    def finish(self) -> None:
        try:
            self.future.result()
        except CheckpointException as e:
            raise _failed_save(e, self.writer) from None
        _on_rank0(self.publish, self.writer)


def async_stager(device: torch.device) -> AsyncStager:
    """One stager per run, reused by every asynchronous save. On GPU it keeps pinned host
    buffers for the whole state, allocated by the first save (pinning costs seconds) and
    refilled by the later ones at copy-engine speed; without CUDA there is nothing to pin.
    (torch's DefaultStager would overlap even the copy with the next step, but its
    deep copy fails on FSDP2's DTensor state in torch 2.11: KeyError <class 'type'>.)"""
    return BlockingAsyncStager(cache_staged_state_dict=device.type == "cuda")


def save_checkpoint(run_dir: Path, step: int, model, optimizer, train_state: dict, tokenizer_files: list[str],
                    async_group=None, write_threads: int = 1, stager: AsyncStager | None = None):
    """Returns the checkpoint path, or a PendingSave when given async_group (a gloo process
    group of its own, since the background thread's collectives must not interleave with
    the training loop's on the same group) and the run's stager (see async_stager). Any
    failure is one DuokaError, raised on every rank, with the `.partial` folder removed."""
    final = run_dir / "checkpoints" / f"step-{step}"
    partial = final.with_name(final.name + ".partial")
    # write_threads files per rank, written in parallel: one thread alone does not fill a fast disk.
    writer = _Writer(partial, write_threads)

    def fresh_folder() -> None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    _on_rank0(fresh_folder, writer)
    state = dict(train_state, step=step, rng_cpu=torch.get_rng_state().tolist())

    def publish() -> None:
        write_synced(partial / STATE_FILE, _json(state))
        for f in tokenizer_files:
            copy_synced(Path(f), partial)
        write_manifest(partial)  # last: a folder with a manifest is whole
        fsync_dir(partial)
        if final.exists():  # a re-run of the same step: replace it only now that the new one is whole
            shutil.rmtree(final)
        os.replace(partial, final)
        fsync_dir(final.parent)

    try:
        if async_group is not None:
            future = dcp.async_save(_app_state(model, optimizer), storage_writer=writer, process_group=async_group,
                                    async_stager=stager)
            return PendingSave(future, publish, writer)
        dcp.save(_app_state(model, optimizer), storage_writer=writer)
    except CheckpointException as e:
        raise _failed_save(e, writer) from None
    _on_rank0(publish, writer)
    return final


def _json(state: dict) -> bytes:
    return json.dumps(state, indent=1).encode()


def _failed_save(e: CheckpointException, writer: _Writer) -> DuokaError:
    """Every rank gets the same CheckpointException; rank 0 removes the partial folder."""
    if dist.get_rank() == 0:
        shutil.rmtree(writer.folder, ignore_errors=True)
    return explain_checkpoint_error(e, "save", writer.folder, writer.needed)


def _on_rank0(work: Callable[[], None], writer: _Writer) -> None:
    """Rank 0 does the folder's bookkeeping while the others wait (this is the barrier).
    Its failure reaches every rank as the same DuokaError, after the partial folder is
    removed: raised on rank 0 alone, the others would wait in the next collective."""
    error = None
    if dist.get_rank() == 0:
        try:
            work()
        except (DuokaError, OSError) as e:
            shutil.rmtree(writer.folder, ignore_errors=True)
            error = e if isinstance(e, DuokaError) else writer.failure(e)
    shared = [error]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] is not None:
        raise shared[0]


def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Load model and optimizer state into the (possibly differently) parallelized model."""
    state = _app_state(model, optimizer)
    _load(state, path)
    # Not strict when the frozen base is left out: it was filled from the base model.
    strict = trained_names(model) is None
    set_model_state_dict(model, state["model"], options=StateDictOptions(full_state_dict=False, strict=strict))
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=False))
    train_state = read_state(path)
    torch.set_rng_state(torch.tensor(train_state["rng_cpu"], dtype=torch.uint8))
    return train_state


def load_model_weights(path: Path, model, no_dist: bool = False) -> None:
    """Only the model part (for export) into a plain single-process model; no_dist when a
    process group exists but this process reads alone. A LoRA model reads its adapters (and
    modules trained whole) only: its base is not in the checkpoint."""
    _load({"model": _model_state(model, model.state_dict())}, path, no_dist)


def _load(state: dict, path: Path, no_dist: bool = False) -> None:
    try:
        dcp.load(state, storage_reader=_Reader(path), planner=_PlainValuesPlanner(path), no_dist=no_dist)
    except CheckpointException as e:
        raise explain_checkpoint_error(e, "load", path) from None
