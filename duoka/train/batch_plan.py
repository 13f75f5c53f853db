"""The batch arithmetic: global batch = micro-batch x accumulation x data-parallel ranks,
and the pipeline schedule's micro-batch count."""

from __future__ import annotations

from dataclasses import dataclass

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
