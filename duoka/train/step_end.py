"""What a step leaves behind for its metrics, and the host-synchronisation rules around it.

A step's figures (loss, gradient norm, times) are read once the GPU is past the step: the
loss, norm and token count go to pinned host memory behind the step's work and the step's
end is marked after that copy, so reading them waits for nothing else, and the host can
launch the next step while the GPU still runs this one.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass

import torch

from duoka.timing import Mark, PhaseTimer


@dataclass
class StepEnd:
    step: int  # 1-based, as in metrics.jsonl
    start: Mark  # the previous step's end: the step's time includes any gap before it
    end: Mark
    phases: PhaseTimer
    scalars: torch.Tensor  # [summed loss, gradient norm, tokens] in (pinned) host memory, valid once `end` is
    lr: float
    data_time: float
    samples: int
    memory: dict
    launch_s: float  # host time from the step's start to its last launch
    # A MoE model's routed assignments [MoE layers, E] over the step's micro-batches on this
    # rank, in (pinned) host memory like `scalars`; None for a dense model.
    expert_counts: torch.Tensor | None = None


def to_host(t: torch.Tensor) -> torch.Tensor:
    """An asynchronous copy into pinned host memory (the tensor itself on CPU)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


SYNC_DEBUG_MODES = {"default": 0, "warn": 1, "error": 2}  # torch.cuda.get_sync_debug_mode's numbers


@contextlib.contextmanager
def sync_debug(mode: str):
    """PyTorch's sync debug mode for the enclosed code, the previous mode restored after:
    "error" (debug.check_host_syncs) raises at an operation that makes the host wait for
    the GPU; "default" lets pass a wait that is meant (a step's end, a background save's
    completion). Nothing on a machine without CUDA.

    The mode is set only when it changes: setting it at all makes PyTorch warn "Synchronization
    debug mode is a prototype feature", so a run without debug.check_host_syncs never sets it
    (and one with it, which asked for the check, is spared the notice)."""
    if not torch.cuda.is_available() or torch.cuda.get_sync_debug_mode() == SYNC_DEBUG_MODES[mode]:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Synchronization debug mode is a prototype")
        torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)
