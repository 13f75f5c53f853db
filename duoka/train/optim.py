"""Batch arithmetic and learning-rate rules (the optimizer itself: duoka.train.optimizers)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from duoka.config import OptimizerConfig
from duoka.errors import DuokaError


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    dp_size: int
    micro_batch: int

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.dp_size

    @property
    def accumulation(self) -> int:
        return self.per_rank // self.micro_batch


def plan_batch(global_batch: int, dp_size: int, micro_batch: int) -> BatchPlan:
    """global_batch = micro_batch x accumulation x dp_size, all whole numbers."""
    if global_batch % dp_size:
        lower = global_batch - global_batch % dp_size
        raise DuokaError(
            f"training.global_batch_size={global_batch} does not split over {dp_size} data-parallel ranks "
            f"({global_batch} / {dp_size} = {global_batch / dp_size:g})",
            f"use a multiple of {dp_size}, e.g. {lower or dp_size} or {lower + dp_size}",
        )
    per_rank = global_batch // dp_size
    if micro_batch > per_rank or per_rank % micro_batch:
        divisors = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
        raise DuokaError(
            f"training.micro_batch_size={micro_batch} does not divide the per-rank batch: global {global_batch} / "
            f"{dp_size} ranks = {per_rank} samples per rank per step",
            f"choose a micro-batch from {divisors} (accumulation = {per_rank} / micro-batch), or `auto`",
        )
    return BatchPlan(global_batch, dp_size, micro_batch)


def pipeline_microbatches(cfg, per_rank: int, accumulation: int) -> int:
    """The schedule's micro-batch count: parallel.pp_microbatches, or one per micro-batch."""
    n_micro = cfg.parallel.pp_microbatches or accumulation
    if per_rank % n_micro:
        raise DuokaError(f"parallel.pp_microbatches={n_micro} does not divide the per-rank batch of "
                         f"{per_rank} samples",
                         f"choose a divisor of {per_rank} (0: per-rank batch / micro_batch_size)")
    return n_micro


def effective_lr(cfg: OptimizerConfig, global_batch: int) -> float:
    """Peak lr after batch-size scaling: linear (Goyal et al., arXiv:1706.02677) or square
    root (the Adam rule of Malladi et al., arXiv:2205.10287) in B / B_ref."""
    ref = cfg.reference_batch_size or global_batch
    ratio = global_batch / ref
    if cfg.lr_scaling == "linear":
        return cfg.lr * ratio
    if cfg.lr_scaling == "sqrt":
        return cfg.lr * math.sqrt(ratio)
    return cfg.lr


def lr_at(step: int, total_steps: int, peak: float, cfg: OptimizerConfig) -> float:
    """lr for optimizer step `step` (0-based). Warmup reaches the peak on its last step."""
    if step < cfg.warmup_steps:
        return peak * (step + 1) / cfg.warmup_steps
    floor = peak * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        # Warmup-stable-decay (Hu et al., MiniCPM, arXiv:2404.06395): flat, then a linear
        # decay over the last decay_fraction of the run.
        decay_steps = max(1, round(total_steps * cfg.decay_fraction))
        decay_start = total_steps - decay_steps
        if step < decay_start:
            return peak
        return peak - (peak - floor) * (step - decay_start + 1) / decay_steps
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps + 1) / span)
    if cfg.schedule == "linear":
        return peak - (peak - floor) * progress
    return floor + (peak - floor) * 0.5 * (1 + math.cos(math.pi * progress))  # cosine
