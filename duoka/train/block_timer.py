"""The load balancer's measure of a rank's speed (its own compute in every decoder block and
the LM head, forward and backward) and the debug slowdown (debug.slow_ranks). Attached by
parallelize_qwen2 through named module hooks (the ModuleHooks protocol)."""

from __future__ import annotations

import functools
import statistics
import time
from collections import deque

import torch

from duoka import runtime
from duoka.timing import Mark

SLOWDOWN_HISTORY = 5  # steps whose median sizes the debug slowdown


class _Interval:
    """One timed forward or backward of a module for one micro-batch: marks at its start, at
    the end of its own work, and after the debug slowdown."""

    __slots__ = ("batch", "end", "key", "real_end", "spin_cycles", "start")

    def __init__(self, key: tuple[int, str], batch: int):
        self.key, self.batch = key, batch
        self.start: Mark | None = None
        self.real_end: Mark | None = None
        self.end: Mark | None = None
        self.spin_cycles = 0  # the debug slowdown's device spin after the work (GPU)


class BlockTimer:
    """This rank's compute seconds per step in its timed modules, forward and backward, with
    waits for other ranks left out, plus the debug slowdown (bench/NOTES.md, "BlockTimer: why
    it is built this way").

    Forward runs from a pre-hook after FSDP2's (which waits for the all-gather) to a forward
    hook before FSDP2's post-forward. Backward runs from the output gradient's hook, added
    after FSDP2's pre-backward hook (after_shard), to the input gradient's hook, added before
    the next module's FSDP2 hooks (before_shard). `slow_factor` < 1 adds (1/slow_factor - 1)
    times each interval's own work: a device spin sized from the module's recent work per
    sample (median of SLOWDOWN_HISTORY steps, the compiling first step left out) on GPU, a
    host sleep on CPU; slow_untimed and slow_optimizer stretch the rest of the step alike.
    Wall clock on CPU."""

    def __init__(self, device: torch.device, slow_factor: float = 1.0, varying_batch: bool = False):
        self.cuda = device.type == "cuda"
        self.device = device
        self.slow_factor = slow_factor
        # Balanced shares give micro-batches of changing sizes: the batch dimension is marked
        # dynamic before the first compile, so one graph serves every size instead of recompiling.
        self.varying_batch = varying_batch
        self.intervals: list[_Interval] = []
        self._modules = 0  # keys for the timed modules
        self._open: dict[int, _Interval] = {}  # module key -> its forward, from pre-hook to forward hook
        self._pending_backward: _Interval | None = None  # from before_shard's forward hook to after_shard's
        # id(output tensor) -> the interval of the module that consumed it, filled in forward
        # and read by the output's gradient hook; cleared every step.
        self._consumer: dict[int, list] = {}
        # Own seconds per sample of each timed module over the last SLOWDOWN_HISTORY steps: the
        # slowdown follows their medians, so one step that compiled for new micro-batch sizes
        # does not become a spin of seconds in the next.
        self._work_history: dict[tuple[int, str], deque] = {}
        self._cycles_per_s: float | None = None
        # The last step's timed forward seconds (slowdown included), and the timed modules'
        # own work in total and in forward: the untimed part of the slowdown is sized from them.
        self._timed_forward_s = self._own_s = self._own_forward_s = 0.0
        self._untimed_history: deque = deque(maxlen=SLOWDOWN_HISTORY)  # untimed seconds per sample
        self._optimizer_history: deque = deque(maxlen=SLOWDOWN_HISTORY)  # optimizer seconds per step
        self._steps = 0  # steps read by step_seconds(); the first (compiling) is kept out of the histories

    # -- the ModuleHooks protocol

    def before_shard(self, modules: list[torch.nn.Module]) -> None:
        """Time each module's forward and register its backward's end; call before
        fully_shard, so that the forward hook runs before FSDP2's post-forward hook."""
        for module in modules:
            key = self._modules
            self._modules += 1
            # FSDP2 registers its pre-forward hook with prepend=True (torch/distributed/fsdp/
            # _fully_shard/_fsdp_state.py), so this start still follows its all-gather wait.
            module.register_forward_pre_hook(functools.partial(self._forward_start, key), with_kwargs=True)
            module.register_forward_hook(functools.partial(self._forward_end, key))

    def after_shard(self, modules: list[torch.nn.Module]) -> None:
        """Register each module's backward start; call after fully_shard, so the gradient hook
        runs after FSDP2's pre-backward hook (which waits for the all-gather)."""
        for module in modules:
            module.register_forward_hook(self._register_backward_start)

    def _forward_start(self, key: int, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if self.varying_batch and x is not None:
            for t in (*args, *kwargs.values()):
                if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[0] == x.shape[0]:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        fwd = _Interval((key, "forward"), x.shape[0] if x is not None and x.dim() >= 1 else 1)
        fwd.start = Mark(self.device)
        self._open[key] = fwd

    def _forward_end(self, key: int, module: torch.nn.Module, args: tuple, out) -> None:
        fwd = self._open.pop(key)
        self._finish(fwd)
        self.intervals.append(fwd)
        if not (torch.is_grad_enabled() and isinstance(out, torch.Tensor) and out.requires_grad):
            return
        bwd = _Interval((key, "backward"), fwd.batch)
        self._pending_backward = bwd  # after_shard's forward hook registers its start
        # The end of this module's backward is its input's gradient. If another timed module
        # produced the input, that module's own hook (registered before FSDP2's on the same
        # tensor) marks it; else a hook on the input does.
        x = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if x is not None and x.requires_grad:
            box = self._consumer.get(id(x))
            if box is not None:
                box.append(bwd)
            else:
                x.register_hook(functools.partial(self._input_grad_ready, [bwd]))
        # Registered before FSDP2's post-forward hook adds its pre-backward hook to this output:
        # the consumer's backward end is marked before this module's all-gather wait.
        box = []
        self._consumer[id(out)] = box
        out.register_hook(functools.partial(self._input_grad_ready, box))

    def _register_backward_start(self, module: torch.nn.Module, args: tuple, out) -> None:
        bwd, self._pending_backward = self._pending_backward, None
        if bwd is not None and isinstance(out, torch.Tensor) and out.requires_grad:
            out.register_hook(functools.partial(self._output_grad_ready, bwd))

    def _output_grad_ready(self, interval: _Interval, grad: torch.Tensor) -> torch.Tensor:
        interval.start = Mark(self.device)
        return grad

    def _input_grad_ready(self, box: list, grad: torch.Tensor) -> torch.Tensor:
        for interval in box:  # the consumer of this tensor, when it was timed and ran backward
            if interval.start is not None and interval.end is None:
                self._finish(interval)
                self.intervals.append(interval)
        return grad

    # -- the slowdown

    def _finish(self, interval: _Interval) -> None:
        """Mark the end of the interval's own work, then add the debug slowdown."""
        interval.real_end = Mark(self.device)
        if self.slow_factor >= 1:
            interval.end = interval.real_end  # one event less per interval when nothing is added
            return
        if self.cuda:
            history = self._work_history.get(interval.key)
            if history:
                interval.spin_cycles = self._extra(statistics.median(history) * interval.batch)
        else:
            self._extra(interval.real_end.seconds_since(interval.start))
        interval.end = Mark(self.device)

    def _spin(self, seconds: float) -> int:
        """Queue a device-side spin of about `seconds`; returns its length in cycles."""
        if self._cycles_per_s is None:
            # The spin counts SM clock cycles: a first estimate of how many pass per second,
            # corrected every step from the spins' measured durations (the clock rises when
            # the GPU idles in a spin, so a calibration under load runs short).
            for _ in range(2):  # the first run includes the kernel's first launch
                start = Mark(self.device)
                runtime.device_sleep(50_000_000)
                seconds_50m = Mark(self.device).seconds_since(start)
            self._cycles_per_s = 50_000_000 / seconds_50m
        cycles = int(seconds * self._cycles_per_s)
        runtime.device_sleep(cycles)
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
        which a slowed rank must not stretch."""
        if self._steps <= 1 or not samples or self._own_forward_s <= 0:
            return
        untimed_forward = max(0.0, forward_s - self._timed_forward_s)
        self._untimed_history.append(untimed_forward * self._own_s / self._own_forward_s / samples)
        self._optimizer_history.append(optimizer_s)

    # -- per step

    def step_seconds(self) -> float:
        """Timed seconds of the step just finished, slowdown included (call after the
        step's synchronize); also keeps each module's own work per sample for sizing the
        next step's slowdown."""
        work: dict[tuple[int, str], list[float]] = {}
        total = timed_forward = spun_s = 0.0
        spun_cycles = 0
        for iv in self.intervals:
            timed = iv.end.seconds_since(iv.start)
            own = iv.real_end.seconds_since(iv.start)
            if iv.spin_cycles:
                spun_cycles += iv.spin_cycles
                spun_s += iv.end.seconds_since(iv.real_end)
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
