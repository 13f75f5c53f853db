"""The learning-rate rules: batch-size scaling of the peak and the schedule (warmup, then
cosine, linear, constant or warmup-stable-decay). The optimizer itself: duoka.train.optimizers."""

from __future__ import annotations

import math

from duoka.config import OptimizerConfig


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
