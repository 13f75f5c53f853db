"""Dynamic load balancing: each data-parallel rank's share of the global batch follows its
measured speed, so a slower GPU (another model, throttled, shared) stops setting the pace.

How it stays exact. Every step's global batch is the same list of samples in the same
(seed, step) order whatever the shares; a share is a contiguous slice of that list. The
loss is the summed cross-entropy over the global count of target tokens (the trainer
already scales by dp_size / global tokens, which undoes the average the data-parallel
reduction takes), so the gradient is the uniform split's up to summation order.

How the collectives stay matched. DDP reduces only in the last micro-batch's backward, so
ranks may run different numbers of micro-batches. FSDP2 gathers parameters in every
micro-batch's forward and backward, so there every rank runs the same number of
micro-batches (the largest share over micro_batch_size, rounded up) of different sizes,
and no share falls below that count (no empty micro-batch is ever needed). A rank's
micro-batch never exceeds training.micro_batch_size: the fast rank gets more or fuller
micro-batches, never bigger ones than fit.

How the speed is measured. BlockTimer (block_timer.py) times each decoder block and the LM
head on the rank itself, forward and backward: CUDA events placed after FSDP2's waits for
all-gathers (so waiting for a slower peer is not counted), wall clock on CPU. Seconds per
sample over a window of steps, the median per rank (one slow outlier step does not move it).

When shares change. Only at optimizer-step boundaries, decided from gathered (identical)
figures on every rank, and applied `lag` steps later: the data thread builds batches a
few steps ahead, and a fixed lag keeps every rank's batches and a resumed run's stream
the same. A change needs the predicted step time to fall by `hysteresis`; after a change
the window restarts, from the SETTLE_STEPS-th step on the new shares.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

import torch

from duoka.errors import DuokaError
from duoka.parallel.dims import ParallelDims
from duoka.train.block_timer import BlockTimer

MODES = ("off", "static", "auto")
# Steps not measured after a change of shares: the first steps on new micro-batch sizes can
# compile inside the timed modules, and their seconds would move the shares the wrong way.
SETTLE_STEPS = 2


def parse_rank_factors(text: str, world: int) -> dict[int, float]:
    """debug.slow_ranks "1:0.5,3:0.8" -> {1: 0.5, 3: 0.8}: rank 1 runs at half speed."""
    out: dict[int, float] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        try:
            rank_text, factor_text = item.split(":")
            rank, factor = int(rank_text), float(factor_text)
        except ValueError:
            raise DuokaError(f"debug.slow_ranks item {item!r} is not RANK:FACTOR",
                             "write e.g. --debug.slow_ranks=1:0.5 (rank 1 at half speed)") from None
        if not 0 <= rank < world:
            raise DuokaError(f"debug.slow_ranks names rank {rank}, but the job has ranks 0..{world - 1}",
                             "name an existing rank")
        if not 0 < factor <= 1:
            raise DuokaError(f"debug.slow_ranks factor {factor} for rank {rank} is not in (0, 1]",
                             "give the speed as a fraction of normal, e.g. 0.5")
        out[rank] = factor
    return out


def parse_weights(text: str, dp_size: int) -> list[float]:
    """parallel.balance_weights "1,0.5" -> relative speeds of the data-parallel ranks."""
    try:
        weights = [float(x) for x in text.split(",")]
    except ValueError:
        raise DuokaError(f"parallel.balance_weights {text!r} is not a list of numbers",
                         "write one relative speed per data-parallel rank, e.g. 1,1,0.5,1") from None
    if len(weights) != dp_size or min(weights) <= 0:
        raise DuokaError(f"parallel.balance_weights has {len(weights)} positive values needed, got {text!r} "
                         f"for {dp_size} data-parallel ranks",
                         f"give {dp_size} positive relative speeds (duoka doctor --bench measures them)")
    return weights


def check_config(parallel, debug, model_parallel: bool, tp: int, pp: int, dp_size: int, world: int) -> list[float] | None:
    """The balance and debug settings, checked before launch and again in each worker;
    returns the static weights (or None)."""
    parse_rank_factors(debug.slow_ranks, world)
    if parallel.balance != "off" and model_parallel:
        raise DuokaError(f"parallel.balance={parallel.balance} shares the batch among data-parallel ranks; with "
                         f"tp={tp} and pp={pp} a rank's speed is its group's",
                         "use balance with data parallelism only; for pipeline stages on GPUs of different speed "
                         "use --parallel.pp_layers=measured")
    weights = parse_weights(parallel.balance_weights, dp_size) if parallel.balance_weights else None
    if parallel.balance == "static" and weights is None:
        raise DuokaError("parallel.balance=static needs parallel.balance_weights",
                         f"give {dp_size} relative speeds, e.g. --parallel.balance_weights={','.join(['1'] * dp_size)}"
                         ", or use --parallel.balance=auto")
    return weights


def proportional_shares(total: int, weights: list[float], floor: int = 1) -> list[int]:
    """Integers >= floor summing to total, as close to proportional to weights as the
    floor allows: round down, then hand out (or take back) single samples by the largest
    shortfall (excess) against the exact proportion."""
    n = len(weights)
    if total < floor * n:
        raise ValueError(f"cannot give {n} ranks at least {floor} of {total} samples")
    exact = [total * w / sum(weights) for w in weights]
    shares = [max(floor, int(e)) for e in exact]
    while sum(shares) < total:
        shares[max(range(n), key=lambda i: (exact[i] - shares[i], -i))] += 1
    while sum(shares) > total:
        shares[min((i for i in range(n) if shares[i] > floor), key=lambda i: (exact[i] - shares[i], i))] -= 1
    return shares


def split_sizes(share: int, count: int) -> list[int]:
    """share samples in count micro-batches as equal as possible, larger ones first."""
    base, extra = divmod(share, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def micro_batch_sizes(shares: list[int], micro_batch: int, equal_count: bool) -> list[list[int]]:
    """Per rank, the sizes of its micro-batches (each <= micro_batch)."""
    counts = [math.ceil(s / micro_batch) for s in shares]
    if equal_count:
        counts = [max(counts)] * len(shares)
    return [split_sizes(s, c) for s, c in zip(shares, counts)]


class Balancer:
    """Shares of each step's global batch per data-parallel rank (see the module doc)."""

    def __init__(self, mode: str, dp_size: int, global_batch: int, micro_batch: int, equal_count: bool,
                 weights: list[float] | None = None, window: int = 8, hysteresis: float = 0.05, lag: int = 4):
        self.mode, self.dp_size, self.global_batch = mode, dp_size, global_batch
        self.micro_batch, self.equal_count = micro_batch, equal_count
        self.window, self.hysteresis, self.lag = window, hysteresis, lag
        start = self.fit(weights) if weights is not None and mode != "off" else [global_batch // dp_size] * dp_size
        self.schedule: list[tuple[int, list[int]]] = [(0, start)]  # (first step, shares), by step
        self.samples: deque = deque(maxlen=window)  # per step: every rank's seconds per sample
        self.skip_next = True  # a process's first step compiles and warms the allocator: not a speed

    def fit(self, weights: list[float]) -> list[int]:
        """Shares proportional to weights; under equal counts none below the micro-batch count."""
        shares = proportional_shares(self.global_batch, weights)
        if self.equal_count:
            count = max(math.ceil(s / self.micro_batch) for s in shares)
            shares = proportional_shares(self.global_batch, weights, floor=count)
        return shares

    def shares_for(self, step: int) -> list[int]:
        return next(s for first, s in reversed(self.schedule) if first <= step)

    def plan(self, step: int, dp_rank: int) -> tuple[int, list[int]]:
        """This rank's (offset into the step's global batch, micro-batch sizes)."""
        shares = self.shares_for(step)
        return sum(shares[:dp_rank]), micro_batch_sizes(shares, self.micro_batch, self.equal_count)[dp_rank]

    def observe(self, step: int, seconds: list[float], samples: list[int]) -> str | None:
        """Record the step just finished (0-based `step`) and, in auto mode, maybe schedule
        new shares from step + lag. Returns a log line when the shares change."""
        if self.mode != "auto" or min(samples) == 0 or min(seconds) <= 0:
            return None
        if self.skip_next:
            self.skip_next = False
            return None
        if any(first > step for first, _ in self.schedule):
            return None  # a change is still on its way in; measure the new split first
        if len(self.schedule) > 1 and step < self.schedule[-1][0] + SETTLE_STEPS:
            return None  # new micro-batch sizes: compilation may still fall in the timed work
        self.samples.append([t / n for t, n in zip(seconds, samples)])
        if len(self.samples) < self.window:
            return None
        per_sample = [statistics.median(col) for col in zip(*self.samples)]
        current = self.shares_for(step)
        proposed = self.fit([1.0 / t for t in per_sample])
        now = max(s * t for s, t in zip(current, per_sample))
        then = max(s * t for s, t in zip(proposed, per_sample))
        if proposed == current or then > (1.0 - self.hysteresis) * now:
            return None
        first = step + self.lag
        self.schedule.append((first, proposed))
        self.samples.clear()
        speeds = ", ".join(f"{per_sample[0] / t:.2f}" for t in per_sample)
        return (f"balance: shares {current} -> {proposed} from step {first + 1}: measured speeds relative to "
                f"rank 0 [{speeds}] (median of {self.window} steps); predicted compute per step "
                f"{now * 1e3:.0f} -> {then * 1e3:.0f} ms")

    def state_dict(self) -> dict:
        return {"mode": self.mode, "dp_size": self.dp_size, "global_batch": self.global_batch,
                "schedule": [[first, list(s)] for first, s in self.schedule], "samples": [list(x) for x in self.samples]}

    def load_state_dict(self, state: dict) -> bool:
        """Restore shares and measurements from a checkpoint of the same data-parallel size
        and global batch; returns False (keeping the fresh start) when they differ."""
        if state.get("dp_size") != self.dp_size or state.get("global_batch") != self.global_batch:
            return False
        if state.get("mode") == "off" and self.mode != "off":
            return False
        self.schedule = [(int(first), [int(x) for x in s]) for first, s in state["schedule"]]
        self.samples = deque((list(x) for x in state["samples"]), maxlen=self.window)
        return True


class LoadBalancing:
    """The trainer's component: the balancer (each data-parallel rank's share of the global
    batch), the block timer that measures each rank's own compute, and the debug slowdown
    (debug.slow_ranks) that the timer applies. The trainer asks it for the step's share, hands
    its timer to parallelize_qwen2 as module hooks, and feeds it the gathered figures at each
    step's end."""

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
