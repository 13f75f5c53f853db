"""Load balancing as one component of the trainer: the balancer (each data-parallel rank's
share of the global batch), the block timer that measures each rank's own compute, and the
debug slowdown (debug.slow_ranks) that the timer applies. The trainer asks it for the
step's share, hands its timer to parallelize_qwen2 as module hooks, and feeds it the
gathered figures at each step's end."""

from __future__ import annotations

import torch

from duoka.parallel.balance import Balancer, check_config, parse_rank_factors
from duoka.parallel.block_timer import BlockTimer
from duoka.parallel.dims import ParallelDims


class LoadBalancing:
    def __init__(self, cfg, dims: ParallelDims, rank: int, world: int, device: torch.device, global_batch: int,
                 micro_batch: int, lag: int, console):
        weights = check_config(cfg.parallel, cfg.debug, dims.model_parallel, dims.tp, dims.pp, dims.dp_size, world)
        self.mode = cfg.parallel.balance
        slowed = parse_rank_factors(cfg.debug.slow_ranks, world)
        self.slow_factor = slowed.get(rank, 1.0)
        # Decided from the config alone, the same on every rank: whether a step's end is
        # deferred changes which collective each rank runs next.
        self._synchronous = self.mode != "off" or bool(slowed)
        self.console = console
        # The timer runs when shares follow measured speed, or when this rank is slowed on purpose.
        self.timer = BlockTimer(device, self.slow_factor, varying_batch=self.varying_batch) \
            if self.mode != "off" or self.slow_factor < 1 else None
        # FSDP2 gathers parameters in every micro-batch: equal micro-batch counts on all ranks.
        self.balancer = Balancer(self.mode, dims.dp_size, global_batch, micro_batch, equal_count=dims.fsdp,
                                 weights=weights, window=cfg.parallel.balance_window,
                                 hysteresis=cfg.parallel.balance_hysteresis, lag=lag)

    @property
    def varying_batch(self) -> bool:
        """Micro-batch sizes change from step to step (compiled code must not specialise on them)."""
        return self.mode != "off"

    @property
    def synchronous(self) -> bool:
        """The timer reads its marks at the step's end, so the step end cannot be deferred;
        the same answer on every rank, slowed or not."""
        return self._synchronous

    def plan(self, step: int, dp_rank: int) -> tuple[int, list[int]]:
        """This rank's (offset into the step's global batch, micro-batch sizes)."""
        return self.balancer.plan(step, dp_rank)

    def before_micro_batch(self, samples: int) -> None:
        if self.timer is not None:  # the debug slowdown's untimed per-sample work
            self.timer.slow_untimed(samples)

    def after_optimizer(self) -> None:
        if self.timer is not None:  # the debug slowdown's share of the optimizer step
            self.timer.slow_optimizer()

    def compute_seconds(self) -> float:
        """This rank's timed compute in the step just finished (after the step's end)."""
        return self.timer.step_seconds() if self.timer is not None else 0.0

    def end_step(self, step: int, compute_s: list[float], samples: list[int], phase_s: dict,
                 own_samples: int) -> dict | None:
        """Feed the figures of `step` (0-based) to the timer (this rank's phases and samples)
        and the balancer (every rank's, gathered; a data-parallel rank's figure is its first
        rank's); returns the metrics.jsonl `balance` entry, or None when balancing is off."""
        if self.timer is not None:
            self.timer.account_step(phase_s.get("forward", 0.0), phase_s.get("optimizer", 0.0), own_samples)
        if self.mode == "off":
            return None
        shares = self.balancer.shares_for(step)
        message = self.balancer.observe(step, compute_s, samples)
        if message:
            self.console.print(message)
        return {"mode": self.mode, "shares": shares, "next_shares": self.balancer.shares_for(step + 1),
                "compute_s": compute_s, "speed": [n / t if t > 0 else None for n, t in zip(samples, compute_s)]}

    def state_dict(self) -> dict:
        return self.balancer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if not self.balancer.load_state_dict(state):
            self.console.print("balance: the checkpoint's shares were for another data-parallel size or global "
                               "batch; starting from equal shares")
