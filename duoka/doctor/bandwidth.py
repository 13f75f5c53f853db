"""`duoka doctor --bench`: short active probes. Per-GPU bf16 matmul TFLOP/s (also the
static load-balance weights), host<->device copy bandwidth, and all-reduce bus bandwidth
over the local GPUs (or CPU processes over gloo) with the nccl-tests definition:
algbw = bytes / time, busbw = algbw x 2 (n - 1) / n, the figure comparable across GPU
counts (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md). Under a
multi-node launcher (torchrun sets WORLD_SIZE) the all-reduce spans every node's ranks.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

from duoka.timing import median_seconds

SIZES = (2**20, 2**24, 2**28, 2**30)  # 1 MiB .. 1 GiB per rank


def matmul_tflops(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """Dense matmul throughput: bf16 n^3 on GPU, fp32 (n/4)^3 on CPU."""
    if device.type != "cuda":
        n = n // 4
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    seconds = median_seconds(lambda: a @ b, device, iters)
    return 2 * n**3 / seconds / 1e12


def copy_bandwidth(device: torch.device, size: int = 2**30) -> tuple[float, float]:
    """Host-to-device and device-to-host GB/s with pinned host memory."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    h2d = size / median_seconds(lambda: dev.copy_(host, non_blocking=True), device, 5) / 1e9
    d2h = size / median_seconds(lambda: host.copy_(dev, non_blocking=True), device, 5) / 1e9
    return h2d, d2h


def _allreduce_rank(rank: int, world: int, init: str, sizes, out: str) -> None:
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init, rank=rank, world_size=world)
    _allreduce_loop(torch.device("cuda", rank) if cuda else torch.device("cpu"), sizes, out)
    dist.destroy_process_group()


def bandwidth_row(size: int, seconds: float, world: int) -> dict:
    """nccl-tests' figures for one all-reduce of `size` bytes per rank taking `seconds`."""
    algbw = size / seconds / 1e9
    return {"bytes": size, "seconds": seconds, "algbw_gbps": algbw, "busbw_gbps": algbw * 2 * (world - 1) / world}


def _allreduce_loop(device: torch.device, sizes, out: str | None) -> list[dict]:
    world, rows = dist.get_world_size(), []
    for size in sizes:
        x = torch.ones(size // 4, dtype=torch.float32, device=device)
        iters = 20 if size <= 2**24 else 5
        rows.append(bandwidth_row(size, median_seconds(lambda: dist.all_reduce(x), device, iters), world))
    if out is not None and dist.get_rank() == 0:
        Path(out).write_text(repr(rows))
    return rows


def allreduce_busbw(world: int, sizes=SIZES) -> list[dict]:
    """All-reduce over `world` local processes (one per GPU; gloo CPU processes without
    GPUs), or over the launcher's job when one is running (torchrun's env)."""
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:
        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        local = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        return _allreduce_loop(device, sizes, None)
    import ast
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "rows")
        mp.start_processes(_allreduce_rank, args=(world, f"tcp://127.0.0.1:{port}", sizes, out), nprocs=world,
                           start_method="spawn")
        return ast.literal_eval(Path(out).read_text())


def run_bench(n_gpus: int, cpu_processes: int = 2) -> dict:
    """Every probe this machine allows; the keys say what ran."""
    result: dict = {}
    if n_gpus:
        devices = [torch.device("cuda", i) for i in range(n_gpus)]
        result["matmul_tflops"] = [matmul_tflops(d) for d in devices]
        result["copy_gbps"] = [dict(zip(("host_to_device", "device_to_host"), copy_bandwidth(d))) for d in devices]
        fastest = max(result["matmul_tflops"])
        result["balance_weights"] = ",".join(f"{t / fastest:.2f}" for t in result["matmul_tflops"])
        if n_gpus > 1 or int(os.environ.get("WORLD_SIZE", 1)) > 1:
            result["allreduce"] = allreduce_busbw(n_gpus)
    else:
        result["cpu_matmul_tflops"] = matmul_tflops(torch.device("cpu"))
        result["allreduce_gloo_cpu"] = allreduce_busbw(cpu_processes, sizes=(2**20, 2**24))
    return result


def render_bench(bench: dict, console) -> None:
    """run_bench's figures, one line each, on a rich console."""
    if "matmul_tflops" in bench:
        for i, (t, c) in enumerate(zip(bench["matmul_tflops"], bench["copy_gbps"])):
            console.print(f"GPU {i}: bf16 matmul {t:.0f} TFLOP/s, host->device {c['host_to_device']:.1f} GB/s, "
                          f"device->host {c['device_to_host']:.1f} GB/s")
        console.print(f"static load-balance weights: --parallel.balance_weights={bench['balance_weights']}")
    else:
        console.print(f"CPU mode: fp32 matmul {bench['cpu_matmul_tflops'] * 1e3:.0f} GFLOP/s")
    for row in bench.get("allreduce") or bench.get("allreduce_gloo_cpu") or []:
        console.print(f"all-reduce {row['bytes'] / 2**20:8.0f} MiB: algbw {row['algbw_gbps']:7.1f} GB/s, "
                      f"busbw {row['busbw_gbps']:7.1f} GB/s")
