"""Checkpoints as one component of the trainer: resume, blocking saves, background saves
(only the copy to host memory blocks training; one save in flight at a time), and retention.

Retention waits for a normal step after the newest save before it deletes older checkpoints:
a checkpoint saved just before a blow-up (its next step already non-finite) fails again when
resumed, and the one to resume from is then an older one (Health.last_good_checkpoint), which
must still exist. In a run without trouble that is one step later than the save."""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from duoka.train.checkpoint_io import async_stager, load_checkpoint, prune, save_checkpoint
from duoka.train.step_end import sync_debug


class Checkpointer:
    def __init__(self, cfg, run_dir: Path, device: torch.device, tokenizer_files: tuple[str, ...], console):
        self.cfg, self.run_dir, self.tokenizer_files, self.console = cfg, run_dir, list(tokenizer_files), console
        # A background save's collectives run on a group of their own: they must not
        # interleave with the training loop's on the same group.
        self.async_group = dist.new_group(backend="gloo") if cfg.async_save else None
        self.stager = async_stager(device) if cfg.async_save else None
        self.pending = None
        self.unconfirmed = False  # a save is published that no normal step has followed yet

    def load(self, path: Path, model, optimizer) -> dict:
        t = time.perf_counter()
        state = load_checkpoint(path, model, optimizer)
        self.console.print(f"loaded {path} in {time.perf_counter() - t:.1f} s")
        return state

    def save(self, step: int, model, optimizer, train_state: dict) -> None:
        if not self.cfg.enabled:
            return
        t = time.perf_counter()
        self.finish()  # one save in flight at a time (waiting for it blocks training too)
        result = save_checkpoint(self.run_dir, step, model, optimizer, train_state, self.tokenizer_files,
                                 self.async_group, self.cfg.write_threads, self.stager)
        if self.async_group is not None:
            # Blocked: waiting for the previous save, then the copy to host memory.
            result.step, result.blocked_s = step, time.perf_counter() - t
            self.pending = result
        else:
            self.unconfirmed = True
            self.console.print(f"checkpoint step-{step} written: training blocked {time.perf_counter() - t:.2f} s")

    def prune_if_confirmed(self, healthy: bool) -> None:
        """Called after each step's end (healthy: its loss and gradient were finite) and at the
        run's end: once a normal step follows the newest save, older checkpoints beyond
        checkpoint.keep go. Rank 0's file-system work; no collective."""
        if self.unconfirmed and healthy and self.pending is None:
            self.unconfirmed = False
            if dist.get_rank() == 0:
                prune(self.run_dir, self.cfg.keep)

    @property
    def written_here(self) -> bool:
        """This rank's background write has finished (what it reports in the step's figures)."""
        return self.pending is not None and self.pending.done()

    def finish_if_written_everywhere(self, everywhere: bool) -> None:
        """Publish a background save once every rank's write is done. Decided from the
        gathered figures, so all ranks enter finish()'s collective at the same step; each
        rank's own poll could differ and leave one rank in it alone."""
        if self.pending is not None and everywhere:
            with sync_debug("default"):
                self.finish()

    def finish(self) -> None:
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        pending.finish()  # every rank: a failed save is one DuokaError everywhere
        self.unconfirmed = True
        self.console.print(f"checkpoint step-{pending.step} written in the background: training blocked "
                           f"{pending.blocked_s:.2f} s")

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None  # its pinned host buffers go with it
