"""Training steps under torch.profiler (`metrics.profile_step`), for finding where the
time goes: which attention kernel runs, how long the loss and the optimizer take, how much
communication is exposed. Writes a Chrome/Perfetto trace and a per-kernel table per rank."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


def start_profile(device: torch.device):
    """Start torch.profiler for `metrics.profile_step` (and the `profile_steps` after it)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    prof = profile(activities=activities, record_shapes=False)
    prof.start()
    return prof


def write_profile(prof, out_dir: Path, rank: int, device: torch.device, top: int = 40) -> None:
    """Stop the profiler and write the Chrome/Perfetto trace and the per-kernel table. The
    caller has waited for the GPU to finish the profiled steps, so all their kernels are in."""
    prof.stop()
    out_dir.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(out_dir / f"trace-rank{rank}.json"))
    table = kernel_table(prof, device.type == "cuda", top)
    (out_dir / f"kernels-rank{rank}.json").write_text(json.dumps(table, indent=1) + "\n")


def kernel_table(prof, cuda: bool, top: int) -> dict:
    """Device time per kernel (GPU) or self CPU time per operator (CPU), largest first."""
    rows = []
    for e in prof.key_averages():
        if cuda:
            # Kernels are device-side events; operators carry their kernels' time as well.
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = e.self_cuda_time_total
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:
            t = e.self_cpu_time_total
        if t > 0:
            rows.append({"name": e.key, "ms": t / 1e3, "calls": e.count})
    rows.sort(key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    for r in rows:
        r["share"] = r["ms"] / total if total else 0.0
    return {"device": "cuda" if cuda else "cpu", "total_ms": total, "kernels": rows[:top]}


class StepProfiler:
    """metrics.profile_step (1-based) and the profile_steps after it under torch.profiler;
    inactive when profile_step is 0."""

    def __init__(self, cfg, device: torch.device, out_dir: Path, rank: int, steps: int):
        self.first, self.device, self.out_dir, self.rank = cfg.profile_step, device, out_dir, rank
        self.final = min(steps, cfg.profile_step + cfg.profile_steps - 1)  # the last profiled step, 1-based
        self.prof = None

    def before(self, step: int) -> None:
        """Call before 0-based `step`."""
        if self.first and step + 1 == self.first:
            self.prof = start_profile(self.device)

    def last(self, step: int) -> bool:
        """Whether 0-based `step` is the last profiled one: its end must be waited for, so
        that the trace holds every kernel."""
        return self.prof is not None and step + 1 == self.final

    def write(self) -> None:
        write_profile(self.prof, self.out_dir, self.rank, self.device)
        self.prof = None
