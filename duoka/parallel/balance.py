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

How the speed is measured. BlockTimer times each decoder block and the LM head on the
rank itself, forward and backward: CUDA events placed after FSDP2's waits for all-gathers
(so waiting for a slower peer is not counted), wall clock on CPU. Seconds per sample over
a window of steps, the median per rank (one slow outlier step does not move it).

When shares change. Only at optimizer-step boundaries, decided from gathered (identical)
figures on every rank, and applied `lag` steps later: the data thread builds batches a
few steps ahead, and a fixed lag keeps every rank's batches and a resumed run's stream
the same. A change needs the predicted step time to fall by `hysteresis`; after a change
the window restarts, from the SETTLE_STEPS-th step on the new shares.
"""

from __future__ import annotations

import functools
import math
import statistics
import time
from collections import deque

import torch

from duoka.errors import DuokaError

MODES = ("off", "static", "auto")
# Steps not measured after a change of shares. The first steps on new micro-batch sizes can
# compile inside the timed modules: on 2 x H200 two such steps (4 s and 17 s) entered the
# window, and the balancer moved the batch further the wrong way ([41, 23] -> [53, 11]).
SETTLE_STEPS = 2
SLOWDOWN_HISTORY = 5  # steps whose median sizes the debug slowdown (BlockTimer)


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


class _Interval:
    """One timed forward or backward of a module for one micro-batch: marks (CUDA events on
    GPU, perf_counter on CPU) at its start, at the end of its own work, and after the debug
    slowdown."""

    __slots__ = ("batch", "end", "key", "real_end", "spin_cycles", "start")

    def __init__(self, key: tuple[int, str], batch: int):
        self.key, self.batch = key, batch
        self.start = self.real_end = self.end = None
        self.spin_cycles = 0  # the debug slowdown's device spin after the work (GPU)


class BlockTimer:
    """This rank's compute time per step in its timed modules (every decoder block and the
    LM head), forward and backward, and the debug slowdown.

    Forward is timed inside the module's forward (wrap()), so after FSDP2's pre-forward
    hook: on GPU the start event is queued behind the stream's wait for the all-gather, and
    waiting for a slower peer is not counted. Backward is timed between two tensor hooks:
    the start on the module's output gradient, registered by a forward hook added after
    FSDP2's (attach()), so it runs after FSDP2's pre-backward hook and its all-gather wait;
    the end on its input gradient, registered on the producing module's output before
    FSDP2's hooks, so the end is marked before the next module's all-gather wait. A rank's
    figure is therefore its own work, which is what its share should follow. (Timing only
    the blocks' forward, as before, let the balancer see another speed ratio than the
    whole step showed: on 2 x H200 with a competing process, 0.49 against the solo runs'
    0.47, and it left GPU 1 with a micro-batch too many.) Wall clock on CPU.

    `slow_factor` < 1 (debug.slow_ranks) makes the rank 1/slow_factor times slower in every
    timed interval: it adds (1/slow_factor - 1) times the interval's own work. On GPU the
    extra is a device-side spin on the compute stream, sized from the same module's work
    per sample (median of the last SLOWDOWN_HISTORY steps), so the host never waits and
    nothing but the timed work is stretched (synchronising after each block to time it on
    the host left launch gaps in the slowed rank that made it look 3.5 times slower
    instead of 2: the balancer then gave it 13 of 64 samples, bench/results/balance_gpu.md).
    On CPU the host sleeps
    for the extra right after the work. The first step of a process is not slowed on GPU
    and not taken into the history: it compiles, and sizing the next steps' spins from it
    made them seconds long (run 9: the balancer then saw GPU 1 at a ninth of GPU 0's speed
    and gave it 7 of 64 samples). The rest of the step's compute is stretched too, so that
    the whole step and the timed modules slow by the same factor (on one H200 with only the
    modules slowed by 0.5, the step ran at 0.58; with the rest stretched, 0.543 against the
    timer's 0.544): the per-sample rest (embedding, final norm, loss) before each
    micro-batch (slow_untimed), the optimizer after it (slow_optimizer), both sized from
    the recent steps' forward and optimizer phases (account_step). The per-sample part runs
    where a really slower GPU spends it, between the step's synchronising collectives; at
    the step's end it was serial with every other rank (run 9: +40 ms a step, 0.87 of the
    ideal on the right shares)."""

    def __init__(self, device: torch.device, slow_factor: float = 1.0, varying_batch: bool = False):
        self.cuda = device.type == "cuda"
        self.device = device
        self.slow_factor = slow_factor
        # Balanced shares give micro-batches of changing sizes. Marking the batch dimension
        # dynamic before the first compile makes one graph serve every size; otherwise the
        # first new size recompiles mid-run (a 27 s stall on one H200 rank for Qwen2-0.5B,
        # bench/results/balance_gpu.md). The dynamic graph ran as fast as the static one.
        self.varying_batch = varying_batch
        self.intervals: list[_Interval] = []
        self._modules = 0  # keys for the wrapped modules
        self._pending_backward: _Interval | None = None  # from wrap()'s forward to attach()'s hook
        # id(output tensor) -> the interval of the module that consumed it, filled in forward
        # and read by the output's gradient hook; cleared every step.
        self._consumer: dict[int, list] = {}
        # Own seconds per sample of each timed module, and of the untimed rest, over the last
        # SLOWDOWN_HISTORY steps: the slowdown follows their medians, so one step that
        # compiled for new micro-batch sizes (seconds of work) does not become a spin of
        # seconds in the next (a 17 s step on 2 x H200, run 8).
        self._work_history: dict[tuple[int, str], deque] = {}
        self._cycles_per_s: float | None = None
        # The last step's timed forward seconds (slowdown included), and the timed modules'
        # own work in total and in forward: the untimed part of the slowdown is sized from them.
        self._timed_forward_s = self._own_s = self._own_forward_s = 0.0
        self._untimed_history: deque = deque(maxlen=SLOWDOWN_HISTORY)  # untimed seconds per sample
        self._optimizer_history: deque = deque(maxlen=SLOWDOWN_HISTORY)  # optimizer seconds per step
        self._steps = 0  # steps read by step_seconds(); the first (compiling) is kept out of the histories

    # -- marks and the slowdown

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _finish(self, interval: _Interval) -> None:
        """Mark the end of the interval's own work, then add the debug slowdown."""
        interval.real_end = self._mark()
        if self.slow_factor >= 1:
            interval.end = interval.real_end  # one event less per interval when nothing is added
            return
        if self.cuda:
            history = self._work_history.get(interval.key)
            if history:
                interval.spin_cycles = self._extra(statistics.median(history) * interval.batch)
        else:
            self._extra(interval.real_end - interval.start)
        interval.end = self._mark()

    def _spin(self, seconds: float) -> int:
        """Queue a device-side spin of about `seconds`; returns its length in cycles."""
        if self._cycles_per_s is None:
            # torch.cuda._sleep counts SM clock cycles: a first estimate of how many pass per
            # second, corrected every step from the spins' measured durations (the clock
            # rises when the GPU idles in a spin: calibrated once under load, spins ran 0.8
            # of the asked time on one H200).
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for _ in range(2):  # the first run includes the kernel's first launch
                start.record()
                torch.cuda._sleep(50_000_000)
                end.record()
                end.synchronize()
            self._cycles_per_s = 50_000_000 / (start.elapsed_time(end) / 1e3)
        cycles = int(seconds * self._cycles_per_s)
        torch.cuda._sleep(cycles)
        return cycles

    def slow_untimed(self, samples: int) -> None:
        """Debug slowdown of a micro-batch's untimed per-sample work (embedding, final norm,
        loss): call before the micro-batch, outside the step's phases, so that the spin is
        not counted as untimed work in turn."""
        if self.slow_factor < 1 and self._untimed_history:
            self._extra(statistics.median(self._untimed_history) * samples)

    def slow_optimizer(self) -> None:
        """Debug slowdown of the optimizer step: call right after it, outside its phase."""
        if self.slow_factor < 1 and self._optimizer_history:
            self._extra(statistics.median(self._optimizer_history))

    def _extra(self, own_seconds: float) -> int:
        """Add (1/slow_factor - 1) times `own_seconds`: a device spin (returns its cycles) or,
        on CPU, a sleep (returns 0)."""
        extra = (1.0 / self.slow_factor - 1.0) * own_seconds
        if self.cuda:
            return self._spin(extra)
        time.sleep(extra)
        return 0

    def account_step(self, forward_s: float, optimizer_s: float, samples: int) -> None:
        """The step's forward and optimizer phase seconds on this rank (after step_seconds()).
        The untimed per-sample work is the forward phase's rest (embedding, final norm, loss),
        with a backward in the timed modules' backward-to-forward proportion. The backward
        phase itself is not used: under DDP it ends waiting for the other ranks' all-reduce,
        and stretching that wait too made a slowed rank slower still and noisy on 2 x H200
        (run 7, bench/results/balance_gpu.md)."""
        if self._steps <= 1 or not samples or self._own_forward_s <= 0:
            return
        untimed_forward = max(0.0, forward_s - self._timed_forward_s)
        self._untimed_history.append(untimed_forward * self._own_s / self._own_forward_s / samples)
        self._optimizer_history.append(optimizer_s)

    # -- forward and backward

    def wrap(self, forward):
        """Time a module's forward; also registers the backward's end mark (see the class doc)."""
        key = self._modules
        self._modules += 1

        def timed_forward(*args, **kwargs):
            x = args[0] if args and isinstance(args[0], torch.Tensor) else None
            if self.varying_batch and x is not None:
                for t in (*args, *kwargs.values()):
                    if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == x.shape[0]:
                        torch._dynamo.maybe_mark_dynamic(t, 0)
            batch = x.shape[0] if x is not None and x.dim() >= 1 else 1
            fwd = _Interval((key, "forward"), batch)
            fwd.start = self._mark()
            out = forward(*args, **kwargs)
            self._finish(fwd)
            self.intervals.append(fwd)
            if torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad:
                bwd = _Interval((key, "backward"), batch)
                self._pending_backward = bwd  # attach()'s forward hook registers its start
                # The end of this module's backward is its input's gradient. If another timed
                # module produced the input, that module's own hook (registered before
                # FSDP2's on the same tensor) marks it; else a hook on the input does.
                if x is not None and x.requires_grad:
                    box = self._consumer.get(id(x))
                    if box is not None:
                        box.append(bwd)
                    else:
                        x.register_hook(functools.partial(self._input_grad_ready, [bwd]))
                # Registered now, before FSDP2's post-forward hook adds its pre-backward hook
                # to this output: the consumer's backward end is marked before this module's
                # all-gather wait.
                box = []
                self._consumer[id(out)] = box
                out.register_hook(functools.partial(self._input_grad_ready, box))
            return out

        return timed_forward

    def attach(self, module: torch.nn.Module) -> None:
        """Registers the backward start of a wrapped module; call after fully_shard, so the
        hook runs after FSDP2's pre-backward hook (which waits for the all-gather)."""
        def after_forward(mod, args, out):
            bwd, self._pending_backward = self._pending_backward, None
            if bwd is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                out.register_hook(functools.partial(self._output_grad_ready, bwd))

        module.register_forward_hook(after_forward)

    def _output_grad_ready(self, interval: _Interval, grad: torch.Tensor) -> torch.Tensor:
        interval.start = self._mark()
        return grad

    def _input_grad_ready(self, box: list, grad: torch.Tensor) -> torch.Tensor:
        for interval in box:  # the consumer of this tensor, when it was timed and ran backward
            if interval.start is not None and interval.end is None:
                self._finish(interval)
                self.intervals.append(interval)
        return grad

    # -- per step

    def step_seconds(self) -> float:
        """Timed seconds of the step just finished, slowdown included (call after the
        step's synchronize); also keeps each module's own work per sample for sizing the
        next step's slowdown."""
        work: dict[tuple[int, str], list[float]] = {}
        total = timed_forward = spun_s = 0.0
        spun_cycles = 0
        for iv in self.intervals:
            if self.cuda:
                timed = iv.start.elapsed_time(iv.end) / 1e3
                own = iv.start.elapsed_time(iv.real_end) / 1e3
                if iv.spin_cycles:
                    spun_cycles += iv.spin_cycles
                    spun_s += iv.real_end.elapsed_time(iv.end) / 1e3
            else:
                timed = iv.end - iv.start
                own = iv.real_end - iv.start
            total += timed
            if iv.key[1] == "forward":
                timed_forward += timed
            sums = work.setdefault(iv.key, [0.0, 0])
            sums[0] += own
            sums[1] += iv.batch
        self._steps += 1
        for key, (t, n) in work.items():
            if n and self._steps > 1:
                self._work_history.setdefault(key, deque(maxlen=SLOWDOWN_HISTORY)).append(t / n)
        if spun_s > 1e-3:
            self._cycles_per_s = spun_cycles / spun_s
        self._timed_forward_s = timed_forward
        self._own_s = sum(t for t, _ in work.values())
        self._own_forward_s = sum(t for (_, direction), (t, _) in work.items() if direction == "forward")
        self.intervals = []
        self._consumer.clear()
        return total
