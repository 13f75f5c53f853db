"""Where a profiled step's time went, from the Chrome trace `duoka train` writes with
`--metrics.profile_step` (`duoka bench --profile`; bench/speed_sweep.py keeps the traces).

    python bench/trace_summary.py OUT/<case>-trace/trace-rank0.json.gz [more traces]

Per phase (the trainer's `duoka.forward`, `duoka.backward`, `duoka.optimizer` ranges) it
prints: the host time of the phase; the GPU span of the kernels it launched; how long the
compute stream was busy inside that span and how long idle; the NCCL kernels' time and how
much of it ran while the compute stream was busy (overlapped) or not (exposed); and the
median delay from a kernel's launch on the host to its start on the GPU. A median delay of
a few microseconds means the GPU waits for the host (the step is host-bound there).

docs/bench.md cites it (the per-phase breakdown of `duoka bench --profile`'s traces);
bench/lora_vs_peer.py --profile-dir runs it on its profiled step.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import defaultdict
from pathlib import Path

PHASES = ("duoka.forward", "duoka.backward", "duoka.optimizer")


def load(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def overlap_length(intervals: list[tuple[float, float]], busy: list[tuple[float, float]]) -> float:
    """Length of the union of `intervals` that lies inside the union of `busy`."""
    merged: list[list[float]] = []
    for a, b in sorted(busy):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = 0.0
    for a, b in sorted(intervals):
        for m0, m1 in merged:
            if m1 <= a:
                continue
            if m0 >= b:
                break
            total += min(b, m1) - max(a, m0)
    return total


def summarize(events: list[dict]) -> dict:
    launches = {}  # correlation id -> host launch time
    kernels = []
    phases = defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        cat = e.get("cat", "")
        if cat in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e["ts"]
        elif cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels.append(e)
        elif cat == "user_annotation" and e.get("name") in PHASES:
            phases[e["name"]].append((e["ts"], e["ts"] + e["dur"]))
    # The compute stream: the one with the most kernel time outside NCCL.
    per_stream = defaultdict(float)
    for k in kernels:
        if "nccl" not in k["name"].lower():
            per_stream[k["tid"]] += k["dur"]
    if not per_stream:
        return {}  # a CPU run's trace: no kernels
    compute = max(per_stream, key=per_stream.get)
    out = {}
    for name in PHASES:
        for i, (h0, h1) in enumerate(phases.get(name, [])):
            mine = [k for k in kernels if h0 <= launches.get(k["args"].get("correlation"), -1) <= h1]
            if not mine:
                continue
            span0 = min(k["ts"] for k in mine)
            span1 = max(k["ts"] + k["dur"] for k in mine)
            comp = [(k["ts"], k["ts"] + k["dur"]) for k in mine if k["tid"] == compute and "nccl" not in k["name"].lower()]
            nccl = [(k["ts"], k["ts"] + k["dur"]) for k in mine if "nccl" in k["name"].lower()]
            busy = union_length(comp)
            delays = [k["ts"] - launches[k["args"]["correlation"]] for k in mine if k["tid"] == compute
                      and k["args"].get("correlation") in launches]
            nccl_total = union_length(nccl)
            nccl_overlapped = overlap_length(nccl, comp)
            by_kernel = defaultdict(float)
            for k in mine:
                by_kernel[_kernel_kind(k["name"])] += k["dur"]
            out[f"{name}#{i}" if i else name] = {
                "host_ms": (h1 - h0) / 1e3,
                "gpu_span_ms": (span1 - span0) / 1e3,
                "compute_busy_ms": busy / 1e3,
                "compute_idle_ms": ((span1 - span0) - busy) / 1e3,
                "nccl_ms": nccl_total / 1e3,
                "nccl_exposed_ms": (nccl_total - nccl_overlapped) / 1e3,
                "launch_to_start_median_us": statistics.median(delays) if delays else None,
                "kernels": len(mine),
                "by_kind_ms": {k: round(v / 1e3, 2) for k, v in sorted(by_kernel.items(), key=lambda x: -x[1])},
            }
    return out


def _kernel_kind(name: str) -> str:
    n = name.lower()
    if "nccl" in n:
        return "nccl"
    if "gemm" in n or "cutlass" in n or "sm90_xmma" in n or "nvjet" in n:
        return "matmul"
    if "cudnn" in n or "flash" in n or "fmha" in n or "attention" in n:
        return "attention"
    if "triton" in n:
        return "triton"
    if "adam" in n:
        return "adamw"
    if "memcpy" in n or "copy" in n or "memset" in n:
        return "copy"
    if "reduce" in n or "norm" in n:
        return "reduce"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("traces", nargs="+", type=Path)
    a = ap.parse_args()
    for path in a.traces:
        print(f"== {path}")
        for phase, row in summarize(load(path)).items():
            kinds = ", ".join(f"{k} {v}" for k, v in row.pop("by_kind_ms").items())
            print(f"{phase:18s} " + "  ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                              for k, v in row.items()))
            print(f"{'':18s} by kind (ms): {kinds}")


if __name__ == "__main__":
    main()
