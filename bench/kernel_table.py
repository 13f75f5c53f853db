"""Where a profiled stretch's GPU time went: torch.profiler's CUDA kernels summed per name and
per kind, divided by the steps profiled (serve_batch1, serve_mixed_step, serve_lm_eval's
--kernels). On CPU the operators by self time instead, so the CPU smoke runs exercise it."""

from __future__ import annotations

import re
from collections import defaultdict

import torch

# Kernel names by what they do (a heuristic over CUDA kernel names: cuBLAS/CUTLASS gemms, flash
# and the paged decode kernel, inductor's fused Triton kernels, PyTorch's own elementwise ones).
# On CPU the same patterns sort the aten operators. First match wins: attention first, since
# flash attention's templated names carry cutlass types.
KERNEL_KINDS = (("attention", r"flash|fmha|attn|attention|_decode_kernel|_merge_kernel|_write_kv|_mixed_kernel"),
                ("matmul", r"gemm|cutlass|nvjet|sm90_|sm80_|matmul|splitk|aten::(add|b)?mm$"),
                ("softmax_topk", r"softmax|logsumexp|topk|sort|reduce"),
                ("triton", r"^triton"), ("copy_index", r"copy|index|gather|scatter|cat|fill"))


def kernel_table(prof: torch.profiler.profile, steps: int = 1, top: int = 25, cuda: bool = True) -> dict:
    """Per step: the summed device time (ms) of the kernels, by kind, and the `top` names."""
    times: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    if cuda:
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                entry = times[e.name[:100]]
                entry[0] += e.device_time_total / 1000
                entry[1] += 1
    else:
        for e in prof.key_averages():
            times[e.key[:100]] = [e.self_cpu_time_total / 1000, e.count]
    kinds: dict[str, float] = defaultdict(float)
    for name, (ms, _) in times.items():
        kinds[next((k for k, pattern in KERNEL_KINDS if re.search(pattern, name, re.IGNORECASE)), "other")] += ms / steps
    ranked = sorted(times.items(), key=lambda kv: -kv[1][0])[:top]
    return {("kernel_ms" if cuda else "self_cpu_ms"): sum(v[0] for v in times.values()) / steps,
            "by_kind_ms": dict(kinds),
            "top": [{"name": k, "ms": v[0] / steps, "calls": v[1] / steps} for k, v in ranked]}
