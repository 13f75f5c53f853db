"""Points in time and intervals on the compute device: CUDA events on the current stream
(GPU time, read later without stopping the host) or the wall clock on CPU."""

from __future__ import annotations

import contextlib
import statistics
import time

import torch


class Mark:
    """A point in the step's timeline: a CUDA event recorded on the current stream, or the
    wall clock on CPU."""

    __slots__ = ("cuda", "event", "time")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.time = time.perf_counter()

    def wait(self) -> None:
        if self.cuda:
            self.event.synchronize()

    def seconds_since(self, earlier: Mark) -> float:
        """Seconds from `earlier` to this mark; on GPU waits for this mark's event."""
        if not self.cuda:
            return self.time - earlier.time
        self.event.synchronize()
        return earlier.event.elapsed_time(self.event) / 1000


class PhaseTimer:
    """Time spent in each phase of a step: GPU time between CUDA events recorded on the
    compute stream (read once the GPU has finished the step, so timing adds no sync), or
    wall clock on CPU. A phase's interval includes waiting for communication it depends on
    (FSDP2's all-gathers in forward, the last gradient reduction in backward)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.intervals: list[tuple[str, Mark, Mark]] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = Mark(self.device)
        with torch.profiler.record_function(f"duoka.{name}"):  # names the phase in a profiled step's trace
            yield
        self.intervals.append((name, start, Mark(self.device)))

    def seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, start, end in self.intervals:
            out[name] = out.get(name, 0.0) + end.seconds_since(start)
        return out


def median_seconds(fn, device: torch.device, iters: int, warmup: int = 3) -> float:
    """Median wall time of `fn` over `iters` calls after `warmup` untimed ones (kernels
    and allocator warm), each bracketed by device synchronizes on GPU."""
    times = []
    for i in range(warmup + iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return statistics.median(times)
