"""Failures that kill a rank while it trains, and what follows on the other ranks, one
detector each (named after the kind of Diagnosis it returns, None when its failure is not
in the log): GPU memory, host memory (the OOM killer, a SIGKILL), device-side asserts,
tensors on different devices, and NCCL's errors and watchdog timeouts, which on the other
ranks are most often the consequence of one rank's failure (duoka.doctor.diagnose says so).

The patterns are the real messages of PyTorch 2.x, NCCL, the kernel, Slurm and duoka,
each quoted above it. What stops a job before it trains: duoka.doctor.start_failures.
"""

from __future__ import annotations

import re

from duoka.doctor.log_reader import Diagnosis, Log, human_size, parse_size, ranks_text, rx
from duoka.doctor.start_failures import DUPLICATE_GPU, NO_SPACE, SHM_CREATE, SHM_EXTEND, shm

# --- CUDA out of memory ---------------------------------------------------------------------
_SIZE = r"([\d.]+ (?:bytes|[KMGT]iB))"
# torch >= 2.1: "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity
#   of 79.11 GiB of which 1.19 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use.
#   Of the allocated memory 74.21 GiB is allocated by PyTorch, and 2.19 GiB is reserved by PyTorch but unallocated.
#   If reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ..."
#   (torch 2.1 printed "total capacty"; another process shows as "Process 4242 has 40.00 GiB memory in use")
_OOM_NEW = re.compile(r"(?:CUDA|HIP) out of memory\. Tried to allocate " + _SIZE + r"\. GPU (\d+) has a total "
                      r"capac(?:i)?ty of " + _SIZE + r" of which " + _SIZE + r" is free\.")
_OOM_IN_USE = re.compile(r"(this process|Process \d+) has " + _SIZE + r" memory in use")
_OOM_SPLIT = re.compile(r"Of the allocated memory " + _SIZE + r" is allocated by PyTorch, and " + _SIZE
                        + r" is reserved by PyTorch but unallocated")
# torch <= 2.0: "RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity;
#   14.56 GiB already allocated; 3.44 MiB free; 14.69 GiB reserved in total by PyTorch) If reserved memory is >>
#   allocated memory try setting max_split_size_mb to avoid fragmentation."
_OOM_OLD = re.compile(r"(?:CUDA|HIP) out of memory\. Tried to allocate " + _SIZE + r" \(GPU (\d+); " + _SIZE
                      + r" total capacity; " + _SIZE + r" already allocated; " + _SIZE + r" free; " + _SIZE
                      + r" reserved in total by PyTorch\)")
# The bare forms: "CUDA out of memory" (any version), "CUDA error: out of memory" (a raw cudaMalloc, e.g. in
#   NCCL's setup or torch.AcceleratorError in torch >= 2.8), NCCL's "NCCL WARN Cuda failure 'out of memory'",
#   cuBLAS' "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
_OOM_ANY = rx(r"(?:CUDA|HIP) out of memory|CUDA error: out of memory|Cuda failure 'out of memory'|"
              r"CUBLAS_STATUS_ALLOC_FAILED", "out of memory", "cublas_status_alloc_failed")
# duoka's worker (train/worker.py): "CUDA out of memory on rank 1 (micro-batch 8, seq_len 4096)"
_DUOKA_OOM = re.compile(r"CUDA out of memory on rank (\d+) \(micro-batch (\w+), seq_len (\d+)\)")


def cuda_oom(log: Log) -> Diagnosis | None:
    found = log.find(_OOM_ANY)
    if not found:
        return None
    ranks = log.ranks(found)
    facts, fragmented = [], None
    new, old = _OOM_NEW.search(log.text), _OOM_OLD.search(log.text)
    if new:
        want, gpu, total, free = new.groups()
        facts.append(f"it tried to allocate {want} on GPU {gpu}, which has {total} in total of which {free} was free")
        tail = log.text[new.end():new.end() + 600].split("\n", 1)[0]
        users = _OOM_IN_USE.findall(tail)
        others = [(who, size) for who, size in users if who != "this process"]
        if others:
            facts.append("other processes hold memory on that GPU too ("
                         + ", ".join(f"{who.lower()}: {size}" for who, size in others[:4]) + ")")
        split = _OOM_SPLIT.search(tail)
        if split:
            facts.append(f"PyTorch had {split.group(1)} allocated and {split.group(2)} reserved but unallocated")
            fragmented = (split.group(2), _fragmented(parse_size(split.group(2)), parse_size(want)))
    elif old:
        want, gpu, total, allocated, free, reserved = old.groups()
        facts.append(f"it tried to allocate {want} on GPU {gpu}, which has {total} in total of which {free} was free; "
                     f"PyTorch had {allocated} allocated and {reserved} reserved")
        gap = parse_size(reserved) - parse_size(allocated)
        if gap > 0:
            fragmented = (human_size(gap), _fragmented(gap, parse_size(want)))
    duoka = _DUOKA_OOM.search(log.text)
    if duoka:
        facts.append(f"micro-batch {duoka.group(2)}, seq_len {duoka.group(3)}")
        ranks = sorted(set(ranks) | {int(duoka.group(1))})
    who = ranks_text(ranks) if ranks else "a process"
    cause = f"{who} ran out of GPU memory" + (": " + "; ".join(facts) if facts else "")
    steps = ["lower training.micro_batch_size (or set it to auto; gradient accumulation keeps the global batch)",
             "turn on training.activation_checkpointing=full and training.fused_loss=true",
             "shard weights, gradients and optimizer state with parallel.dp_mode=fsdp",
             "check the layout first with `duoka plan --model ... --gpus N --gpu-memory GB`"]
    alloc = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
    if fragmented and fragmented[1]:
        steps.insert(0, f"{fragmented[0]} was reserved but unallocated, which is fragmentation: set {alloc}")
    else:
        here = f" (here {fragmented[0]})" if fragmented else ""
        steps.append(f"{alloc} helps when much memory is reserved but unallocated{here}, i.e. fragmented")
    return Diagnosis("cuda_oom", cause, "; ".join(steps), log.evidence(found, most=2))


def _fragmented(reserved_unallocated: float, wanted: float) -> bool:
    """Whether fragmentation, not the total, is what failed the allocation: the cache held
    more than the request (at least 512 MiB) in blocks that could not serve it."""
    return reserved_unallocated >= max(wanted, 2**29)


# --- A worker was killed: the host's OOM killer, or SIGKILL from outside ---------------------
# torchrun's summary: "exitcode  : -9 (pid: 4242)" / "traceback : Signal 9 (SIGKILL) received by PID 4242"
_SIGKILL = re.compile(r"Signal 9 \(SIGKILL\) received by PID (\d+)")
# the elastic agent's own line: "... api.py:869] failed (exitcode: -9) local_rank: 2 (pid: 4187) of binary: ..."
_AGENT_SIGKILL = re.compile(r"failed \(exitcode: -9\) local_rank: (\d+)")
# kernel (dmesg): "Out of memory: Killed process 4242 (python) total-vm:..., anon-rss:..."
_KERNEL_OOM = re.compile(r"Out of memory: Killed process (\d+) \(([^)]*)\)")
# Slurm: "slurmstepd: error: Detected 1 oom_kill event in StepId=1234.0. Some of the step tasks have been OOM Killed."
_SLURM_OOM = re.compile(r"Detected (\d+) oom[-_]kill events? in (\S+?)\.? ")
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):")
_FIELD_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)", re.MULTILINE)
_FIELD_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.MULTILINE)


def _root_cause(log: Log) -> tuple[int, int] | None:
    """torchrun's "Root Cause (first observed failure)": (rank, exit code)."""
    m = _ROOT_CAUSE.search(log.text)
    if not m:
        return None
    block = log.around(m, 0, 8)
    r, e = _FIELD_RANK.search(block), _FIELD_EXIT.search(block)
    return (int(r.group(1)), int(e.group(1))) if r and e else None


def host_oom(log: Log) -> Diagnosis | None:
    oom = log.find(_KERNEL_OOM, _SLURM_OOM)
    killed = log.find(_SIGKILL, _AGENT_SIGKILL)
    if not oom and not killed:
        return None
    root = _root_cause(log)
    who = f"rank {root[0]}" if root and root[1] == -9 else "a worker"
    if oom:
        k = _KERNEL_OOM.search(log.text)
        detail = (f" (the kernel killed process {k.group(1)}, {k.group(2)})" if k else
                  " (Slurm counted an oom_kill event)")
        cause = (f"{who} was killed by the Linux OOM killer: the machine ran out of host memory (RAM), not GPU "
                 f"memory{detail}")
        fix = ("give the job more RAM (Slurm: --mem), run fewer processes or DataLoader workers per node, load "
               "checkpoints once instead of a full copy per rank, and watch `free -g` while it starts")
        return Diagnosis("host_oom", cause, fix, log.evidence(sorted(oom + killed, key=lambda m: m.start())))
    cause = (f"{who} was killed with SIGKILL from outside the program: most often the Linux OOM killer (host RAM "
             "ran out), otherwise a scheduler's time or memory limit, or a user")
    fix = ("look for the OOM killer with `dmesg -T | grep -i -E 'killed process|out of memory'` (or `journalctl "
           "-k`) and for the scheduler's limits in its job log; if host memory ran out, run fewer processes or "
           "DataLoader workers per node or give the job more RAM")
    return Diagnosis("worker_killed", cause, fix, log.evidence(killed))


# --- A device-side assertion (an index out of range inside a kernel) ---------------------------
# "../aten/src/ATen/native/cuda/Indexing.cu:1289: indexSelectLargeIndex: block: [14,0,0], thread: [0,0,0]
#   Assertion `srcIndex < srcSelectDimSize` failed."            (an embedding lookup: a token id >= vocabulary)
# "../aten/src/ATen/native/cuda/Loss.cu:250: nll_loss_forward_reduce_cuda_kernel_2d: block: [0,0,0], thread:
#   [5,0,0] Assertion `t >= 0 && t < n_classes` failed."        (a cross-entropy label out of range)
# "RuntimeError: CUDA error: device-side assert triggered"
_ASSERT_EMBEDDING = re.compile(r"Assertion `srcIndex < srcSelectDimSize` failed")
_ASSERT_LABELS = re.compile(r"Assertion `t >= 0 && t < n_classes` failed")
_ASSERT_INDEX = re.compile(r"Assertion `[^`]*index out of bounds[^`]*` failed")
_DEVICE_ASSERT = re.compile(r"device-side assert triggered")


def device_assert(log: Log) -> Diagnosis | None:
    found = log.find(_ASSERT_EMBEDDING, _ASSERT_LABELS, _ASSERT_INDEX, _DEVICE_ASSERT)
    if not found:
        return None
    kinds = {m.re for m in found}
    if _ASSERT_EMBEDDING in kinds:
        cause = ("a GPU kernel's bounds check failed in an index_select, which is how the embedding looks up "
                 "tokens: most likely a token id is at least the model's vocabulary size, so the data was tokenized "
                 "with another tokenizer or the model's vocabulary is too small")
        fix = ("tokenize the data with the model's own tokenizer (duoka prepare --tokenizer MODEL_DIR) and check that "
               "the largest token id is below vocab_size in config.json; rerun with CUDA_LAUNCH_BLOCKING=1 (or on "
               "CPU, where the same bug raises IndexError) to see the failing operation")
    elif _ASSERT_LABELS in kinds:
        cause = ("a GPU kernel's bounds check failed in the cross-entropy loss: a label is negative or at least the "
                 "number of classes (the vocabulary size)")
        fix = ("labels must lie in 0..vocab_size-1, or be the ignore index -100 for masked positions; check the "
               "data pipeline's labels; rerun with CUDA_LAUNCH_BLOCKING=1 (or on CPU) to see the failing operation")
    else:
        cause = ("a GPU kernel's bounds check (device-side assert) failed, typically an index out of range; after "
                 "it every later CUDA call on that process fails too")
        fix = ("rerun with CUDA_LAUNCH_BLOCKING=1 so the traceback points at the failing operation (or on CPU, where "
               "the same bug raises an ordinary IndexError with the values); the assertion line above the "
               "traceback names the kernel")
    return Diagnosis("device_assert", cause, fix, log.evidence(found))


# --- Tensors on different devices --------------------------------------------------------------
# torch <= 2.2: "RuntimeError: Expected all tensors to be on the same device, but found at least two devices,
#   cuda:0 and cpu!"
# torch >= 2.3: "RuntimeError: Expected all tensors to be on the same device, but got index is on cpu, different
#   from other tensors on cuda:0 (when checking argument in method wrapper_CUDA__index_select)"
_SAME_DEVICE_OLD = re.compile(r"Expected all tensors to be on the same device, but found at least two devices, "
                              r"(\S+) and ([^\s!]+)!")
_SAME_DEVICE_NEW = re.compile(r"Expected all tensors to be on the same device, but got (\w+) is on (\S+), different "
                              r"from other tensors on ([^\s(]+)")


def device_mismatch(log: Log) -> Diagnosis | None:
    found = log.find(_SAME_DEVICE_OLD, _SAME_DEVICE_NEW)
    if not found:
        return None
    m = found[0]
    if m.re is _SAME_DEVICE_OLD:
        a, b, arg = m.group(1), m.group(2), ""
    else:
        a, b, arg = m.group(3), m.group(2), f", argument '{m.group(1)}' on {m.group(2)}"
    cause = (f"one operation got tensors on different devices ({a} and {b}{arg}): a tensor or module was not "
             "moved to the process's GPU")
    if a.startswith("cuda") and b.startswith("cuda"):
        cause += "; between two GPUs this usually means a rank uses another rank's GPU"
    fix = ("move the model and every input to one device per process (torch.device('cuda', LOCAL_RANK)) with .to(); "
           "call torch.cuda.set_device(LOCAL_RANK) before building anything; duoka moves its own tensors, so look "
           "at custom code in the traceback")
    return Diagnosis("device_mismatch", cause, fix, log.evidence(found))


# --- Other NCCL errors -----------------------------------------------------------------------
# torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970,
#   unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5
# ncclUnhandledCudaError: Call to CUDA function failed.
# Last error:
# Cuda failure 'peer access is not supported between these two devices'
_NCCL_ERROR = re.compile(r"NCCL error in: \S+?, (unhandled cuda error|unhandled system error|internal error|"
                         r"invalid usage|invalid argument|remote process exited or there was a network error)"
                         r"[^\n]*?(?:NCCL version (\d+(?:\.\d+)+)[^\n]*)?$", re.MULTILINE)
_NCCL_CODE = rx(r"nccl(UnhandledCudaError|SystemError|InternalError|RemoteError|InvalidUsage)\b",
                "ncclunhandledcudaerror", "ncclsystemerror", "ncclinternalerror", "ncclremoteerror",
                "ncclinvalidusage")
_LAST_ERROR = re.compile(r"Last error:\s*\n(?:\s*\[(?:rank|default)\d+\]:)?\s*([^\n]+)")


def nccl_error(log: Log) -> Diagnosis | None:
    found = log.find(_NCCL_ERROR, _NCCL_CODE)
    if not found:
        return None
    head = next((m for m in found if m.re is _NCCL_ERROR), None)
    window = log.text[found[0].start():found[0].start() + 2000]
    last = _LAST_ERROR.search(window)
    last_text = last.group(1).strip() if last else ""
    # Failures another detector explains better: the same event, not a second one.
    if any(p.search(last_text) for p in (NO_SPACE, _OOM_ANY, DUPLICATE_GPU)):
        return None
    if any(p.search(last_text) for p in (SHM_CREATE, SHM_EXTEND)) and shm(log) is not None:
        return None
    code = head.group(1) if head else {"UnhandledCudaError": "unhandled cuda error", "SystemError": "unhandled "
                                       "system error", "InternalError": "internal error", "RemoteError": "remote "
                                       "process exited or there was a network error",
                                       "InvalidUsage": "invalid usage"}[found[0].group(1)]
    version = head.group(2) if head and head.group(2) else None
    ranks = log.ranks(found)
    cause = (f"NCCL failed with '{code}'" + (f" (NCCL {version})" if version else "")
             + (f" on {ranks_text(ranks)}" if ranks else "") + (f"; last error: {last_text}" if last_text else ""))
    if code == "unhandled cuda error":
        fix = ("a CUDA call inside NCCL failed: check `dmesg -T | grep -i xid` for a GPU fault and `nvidia-smi topo "
               "-m`; if peer-to-peer access is the problem (IOMMU/ACS, some virtual machines), try NCCL_P2P_DISABLE=1; "
               "rerun with NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,P2P to see which call")
    elif code == "unhandled system error":
        fix = ("a system call inside NCCL failed (sockets, memory, devices): rerun with NCCL_DEBUG=INFO to see which; "
               "on several nodes set NCCL_SOCKET_IFNAME to the interface the nodes reach each other on (`ip addr`) "
               "and check the firewall; on InfiniBand check `ibstat` and NCCL_IB_HCA")
    elif code.startswith("remote process"):
        fix = ("another rank exited or the network dropped: first look for the rank that failed first in the log; "
               "if none did, check the network between the nodes (NCCL_DEBUG=INFO, NCCL_SOCKET_IFNAME, `ibstat`)")
    else:
        fix = ("rerun with NCCL_DEBUG=INFO to see the failing call; check that every rank runs the same collectives "
               "with the same tensor shapes and dtypes, on its own GPU")
    return Diagnosis("nccl_error", cause, fix, log.evidence(found))


# --- The NCCL watchdog timed out: one rank stopped joining collectives ---------------------------
# [rank1]:[E1130 10:22:41.123456 ProcessGroupNCCL.cpp:616] [PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught
#   collective operation timeout: WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000)
#   ran for 600054 milliseconds before timing out.
_WATCHDOG = re.compile(r"Watchdog caught collective operation timeout")
_WORK_TIMEOUT = re.compile(r"WorkNCCL\(SeqNum=(\d+), OpType=(\w+)[^\n]*?Timeout\(ms\)=(\d+)\) ran for (\d+) "
                           r"milliseconds before timing out")
# [PG ID 0 PG GUID 0(default_pg) Rank 0] ProcessGroupNCCL's watchdog got stuck for 480 seconds without making
#   progress in monitoring enqueued collectives. This typically indicates a NCCL/CUDA API (e.g., CudaEventDestroy)
#   hang blocking the watchdog, ...
_WATCHDOG_STUCK = re.compile(r"ProcessGroupNCCL's watchdog got stuck for (\d+) seconds")
# Older and third-party wording.
_NCCL_TIMEOUT = rx(r"\bNCCL timeout\b", "nccl timeout", flags=re.IGNORECASE)
# gloo (CPU processes): "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out
#   waiting 1800000ms for recv operation to complete"
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (send|recv) operation to complete")


def nccl_timeout(log: Log) -> Diagnosis | None:
    found = log.find(_WATCHDOG, _WORK_TIMEOUT, _WATCHDOG_STUCK, _NCCL_TIMEOUT, _GLOO_TIMEOUT)
    if not found:
        return None
    facts = []
    works = log.find(_WORK_TIMEOUT)
    timed = log.ranks(found)
    if works:
        seq, op, limit, ran = works[0].groups()
        facts.append(f"{op} number {seq} ran for {int(ran) / 1000:.0f} s against a limit of {int(limit) / 60000:g} min")
        per_rank = {}
        for m in works:
            r = log.rank(m)
            if r is not None:
                per_rank.setdefault(r, (int(m.group(1)), m.group(2)))
        if len(set(per_rank.values())) > 1:
            facts.append("the ranks wait in different collectives ("
                         + ", ".join(f"rank {r}: {op} {seq}" for r, (seq, op) in sorted(per_rank.items())[:6])
                         + "), so they run different code paths or numbers of collectives")
    elif (g := _GLOO_TIMEOUT.search(log.text)):
        facts.append(f"a gloo {g.group(2)} waited {int(g.group(1)) / 1000:.0f} s")
    if timed:
        facts.append(f"{ranks_text(timed)} timed out waiting")
        silent = sorted(log.all_ranks() - set(timed))
        if silent:
            facts.append(f"{ranks_text(silent)} reported no timeout: look there first")
    root = _root_cause(log)
    if root:
        facts.append(f"torchrun's first observed failure is rank {root[0]} (exit code {root[1]}"
                     + (", SIGABRT: the watchdog's own abort, so that rank was waiting, not failing" if root[1] == -6
                        else "") + ")")
    stuck = _WATCHDOG_STUCK.search(log.text)
    if stuck and not works:
        facts.append(f"the watchdog itself was stuck for {stuck.group(1)} s in a CUDA/NCCL call")
    cause = ("a collective operation timed out: one rank stopped joining collectives (it crashed, hangs, or runs a "
             "different code path or number of collectives than the others), and the rest waited for it until "
             "the watchdog stopped the job" + (" (" + "; ".join(facts) + ")" if facts else ""))
    fix = ("find the first rank that failed in the log above the timeouts: its traceback is the real error (duoka "
           "also writes it to error-rank*.json in the run directory); to see which collective each rank was in, rerun "
           "with TORCH_NCCL_TRACE_BUFFER_SIZE=2000 TORCH_NCCL_DUMP_ON_TIMEOUT=1 (the flight recorder dumps one file "
           "per rank at TORCH_NCCL_DEBUG_INFO_TEMP_FILE, /tmp/nccl_trace_rank_N by default) and with NCCL_DEBUG=INFO; "
           "raise the timeout (init_process_group(timeout=...)) only for a slow first step such as torch.compile "
           "or a large checkpoint load")
    if stuck:
        fix += ("; a stuck watchdog's heartbeat limit is TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    return Diagnosis("nccl_timeout", cause, fix, log.evidence(found, most=2))

