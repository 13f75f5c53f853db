"""Explain a failed run's log: name each known failure in it, its cause and its fix.

`explain(text)` reads what a failed job printed (the stderr of torchrun or `duoka train`,
Python tracebacks, NCCL_DEBUG output, dmesg or nvidia-smi lines pasted in) and returns one
`Diagnosis` per kind of failure it recognises, root causes first: when one rank runs out
of memory the others later hit the NCCL watchdog timeout, and the out-of-memory error is
the one to fix, so it comes first and the timeout says that it follows from it.

The patterns are the real messages of PyTorch 2.x, NCCL, the NVIDIA driver and duoka
itself, and they are matched strictly: a log that merely talks about memory is no
out-of-memory error. A log with nothing known in it gives [].

The detectors, one per kind of failure: duoka.doctor.start_failures (what stops a job
before it trains) and duoka.doctor.rank_failures (what kills a rank, and what follows on
the others); the log as they read it: duoka.doctor.log_reader.
"""

from __future__ import annotations

from dataclasses import replace

from duoka.doctor.log_reader import Diagnosis, Log
from duoka.doctor.rank_failures import cuda_oom, device_assert, device_mismatch, host_oom, nccl_error, nccl_timeout
from duoka.doctor.start_failures import (
    disk_full,
    driver_mismatch,
    driver_too_old,
    duplicate_gpu,
    gpu_busy,
    gpu_hardware,
    gpu_order,
    port_in_use,
    rendezvous,
    shm,
    tokenizer_missing,
    tp_heads,
)

# Most important first: what stops everything (driver, hardware), what stops the start
# (ports, rendezvous, config, files, devices), what kills one rank (memory, asserts), and
# last what follows from a dead rank (NCCL errors and timeouts on the others).
_DETECTORS = (
    driver_too_old, driver_mismatch, gpu_hardware,
    port_in_use, rendezvous, tp_heads, tokenizer_missing,
    gpu_order, duplicate_gpu, gpu_busy, shm, disk_full,
    cuda_oom, host_oom, device_assert, device_mismatch,
    nccl_error, nccl_timeout,
)
# Failures that are usually the consequence of another rank's failure.
_CONSEQUENCES = {"nccl_error", "nccl_timeout"}


def explain(text: str) -> list[Diagnosis]:
    """The known failures in a log, one Diagnosis per kind, root causes first; [] when
    nothing known is in it."""
    log = Log(text)
    found = [d for d in (detect(log) for detect in _DETECTORS) if d is not None]
    out: list[Diagnosis] = []
    for d in found:
        before = [x.kind for x in out]  # everything before it is a failure it may follow from
        if d.kind in _CONSEQUENCES and before:
            names = " and ".join(before[:3])
            d = replace(d, cause=f"{d.cause}. Here it most likely follows from the {names} above: the failed rank "
                                 "stopped joining collectives and the others waited for it",
                        fix=f"fix the {names} first; this goes away with it. Otherwise: {d.fix}")
        out.append(d)
    return out
