"""`duoka doctor --explain`: the known failures in real-looking logs, their numbers, their
order (the root cause before its consequences), and nothing from a clean log."""

import dataclasses

import pytest

from duoka.doctor.diagnose import explain
from duoka.doctor.log_reader import EVIDENCE_CHARS, Diagnosis


def kinds(text: str) -> list[str]:
    return [d.kind for d in explain(text)]


def one(text: str, kind: str) -> Diagnosis:
    found = explain(text)
    assert [d.kind for d in found] == [kind], found
    return found[0]


# --- Logs as torchrun, PyTorch, NCCL, the driver and duoka print them -------------------------

OOM_NEW = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 79.11 GiB "
    "of which 1.19 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. Of the "
    "allocated memory 74.21 GiB is allocated by PyTorch, and 2.19 GiB is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
    "fragmentation.  See documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)

OOM_THEN_TIMEOUT = f"""\
[rank1]: Traceback (most recent call last):
[rank1]:   File "/work/train.py", line 211, in <module>
[rank1]:     main()
[rank1]:   File "/work/train.py", line 187, in main
[rank1]:     loss.backward()
[rank1]:   File "/usr/local/lib/python3.11/site-packages/torch/_tensor.py", line 626, in backward
[rank1]:     torch.autograd.backward(
[rank1]:   File "/usr/local/lib/python3.11/site-packages/torch/autograd/graph.py", line 823, in _engine_run_backward
[rank1]:     return Variable._execution_engine.run_backward(  # Calls into the C++ engine to run the backward pass
[rank1]:            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\
^^^^^^^^^^^^
[rank1]: {OOM_NEW}
[rank0]:[E1130 10:32:41.528302146 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600054 milliseconds before \
timing out.
[rank0]:[E1130 10:32:41.528567903 ProcessGroupNCCL.cpp:1785] [PG ID 0 PG GUID 0(default_pg) Rank 0] Exception \
(either an error or timeout) detected by watchdog at work: 12, last enqueued NCCL work: 12, last completed NCCL work: \
11.
[rank2]:[E1130 10:32:41.530112877 ProcessGroupNCCL.cpp:616] [Rank 2] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=12, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600057 milliseconds before \
timing out.
[rank0]:[E1130 10:32:41.528601234 ProcessGroupNCCL.cpp:630] [Rank 0] Some NCCL operations have failed or timed out. \
Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on corrupted/incomplete data.
[rank0]:[E1130 10:32:41.528613021 ProcessGroupNCCL.cpp:636] [Rank 0] To avoid data inconsistency, we are taking the \
entire process down.
[rank0]:[E1130 10:32:41.529847161 ProcessGroupNCCL.cpp:1595] [PG ID 0 PG GUID 0(default_pg) Rank 0] Process group \
watchdog thread terminated with exception: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, \
OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600054 milliseconds before timing out.
terminate called after throwing an instance of 'c10::DistBackendError'
"""

TIMEOUT_WITH_SUMMARY = """\
[rank0]:[E1130 11:02:17.771203388 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=87, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600321 \
milliseconds before timing out.
[rank1]:[E1130 11:02:17.771884020 ProcessGroupNCCL.cpp:616] [Rank 1] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=88, OpType=_ALLGATHER_BASE, NumelIn=4096, NumelOut=8192, Timeout(ms)=600000) ran for 600304 \
milliseconds before timing out.
W1130 11:02:20.113000 4183 torch/distributed/elastic/multiprocessing/api.py:897] Sending process 4186 closing signal \
SIGTERM
E1130 11:02:20.447000 4183 torch/distributed/elastic/multiprocessing/api.py:869] failed (exitcode: -6) local_rank: 0 \
(pid: 4185) of binary: /usr/bin/python3
Traceback (most recent call last):
  File "/usr/local/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2024-11-30_11:02:20
  host      : gpu-node-07
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 4185)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 4185
============================================================
"""

PORT_IN_USE = """\
[W1130 09:12:03.861434511 socket.cpp:697] [c10d] The server socket has failed to listen on [::]:29500 (errno: 98 - \
Address already in use).
[W1130 09:12:03.861612298 socket.cpp:697] [c10d] The server socket has failed to listen on 0.0.0.0:29500 (errno: \
98 - Address already in use).
[E1130 09:12:03.861708331 socket.cpp:735] [c10d] The server socket has failed to listen on any local network address.
Traceback (most recent call last):
  File "/usr/local/bin/torchrun", line 8, in <module>
    sys.exit(main())
  File "/usr/local/lib/python3.11/site-packages/torch/distributed/run.py", line 919, in main
    run(args)
torch.distributed.DistNetworkError: The server socket has failed to listen on any local network address. port: \
29500, useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use
"""

DRIVER_TOO_OLD = """\
$ pip list | grep torch
torch                    2.5.1+cu124
/usr/local/lib/python3.10/dist-packages/torch/cuda/__init__.py:129: UserWarning: CUDA initialization: The NVIDIA \
driver on your system is too old (found version 11040). Please update your GPU driver by downloading and installing a \
new version from the URL: http://www.nvidia.com/Download/index.aspx Alternatively, go to: https://pytorch.org to \
install a PyTorch version that has been compiled with your version of the CUDA driver. (Triggered internally at \
../c10/cuda/CUDAFunctions.cpp:108.)
  return torch._C._cuda_getDeviceCount() > 0
"""

DRIVER_MISMATCH = """\
$ nvidia-smi
Failed to initialize NVML: Driver/library version mismatch
NVML library version: 535.183
$ dmesg | tail -4
[ 1234.567890] NVRM: API mismatch: the client has the version 535.183.01, but
               NVRM: this kernel module has the version 535.161.08.  Please
               NVRM: make sure that this kernel module and all NVIDIA driver
               NVRM: components have the same version.
"""

SHM_NCCL = """\
gpu-node-07:4185:4302 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
gpu-node-07:4185:4302 [0] misc/shmutils.cc:72 NCCL WARN Error: failed to extend /dev/shm/nccl-vzIpS6 to 9637892 \
bytes, error: No space left on device (28)
gpu-node-07:4185:4302 [0] misc/shmutils.cc:113 NCCL WARN Error while creating shared memory segment \
/dev/shm/nccl-vzIpS6 (size 9637888), error: No space left on device (28)
gpu-node-07:4185:4302 [0] NCCL INFO transport/shm.cc:114 -> 2
[rank0]: Traceback (most recent call last):
[rank0]:   File "/work/train.py", line 52, in <module>
[rank0]:     dist.all_reduce(t)
[rank0]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, \
unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5
[rank0]: ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error.
[rank0]: Last error:
[rank0]: Error while creating shared memory segment /dev/shm/nccl-vzIpS6 (size 9637888), error: No space left on \
device (28)
"""

SHM_DATALOADER = """\
ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm).
Traceback (most recent call last):
  File "/usr/local/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1251, in _try_get_data
    data = self._data_queue.get(timeout=timeout)
RuntimeError: DataLoader worker (pid 4321) is killed by signal: Bus error. It is possible that dataloader's workers \
are out of shared memory. Please try to raise your shared memory limit.
"""

INVALID_ORDINAL = """\
+ CUDA_VISIBLE_DEVICES=0,1,2,3 torchrun --nproc-per-node=8 train.py
[rank5]: Traceback (most recent call last):
[rank5]:   File "/work/train.py", line 40, in <module>
[rank5]:     torch.cuda.set_device(local_rank)
[rank5]:   File "/usr/local/lib/python3.11/site-packages/torch/cuda/__init__.py", line 478, in set_device
[rank5]:     torch._C._cuda_setDevice(device)
[rank5]: RuntimeError: CUDA error: invalid device ordinal
[rank5]: CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might \
be incorrect.
[rank5]: For debugging consider passing CUDA_LAUNCH_BLOCKING=1
[rank5]: Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.
"""

TOKENIZER_HF = """\
Traceback (most recent call last):
  File "/work/sft.py", line 12, in <module>
    tok = AutoTokenizer.from_pretrained("/models/ckpt-1000")
OSError: Can't load tokenizer for '/models/ckpt-1000'. If you were trying to load it from \
'https://huggingface.co/models', make sure you don't have a local directory with the same name. Otherwise, make sure \
'/models/ckpt-1000' is the correct path to a directory containing all relevant files for a Qwen2TokenizerFast \
tokenizer.
"""

CLEAN = """\
duoka: data /data/tokens: 48,812 windows of 4096 tokens (0.4 s)
duoka: 8 process(es) (1 node(s) x 8), run directory runs/qwen2.5-0.5b-20241130-101500
duoka: rendezvous port 29500 is in use; using 41234 instead
gpu-node-07:4185:4185 [0] NCCL INFO Bootstrap : Using eth0:10.0.3.7<0>
gpu-node-07:4185:4185 [0] NCCL INFO cudaDriverVersion 12040
NCCL version 2.21.5+cuda12.4
gpu-node-07:4185:4302 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
gpu-node-07:4185:4302 [0] NCCL INFO Connected all rings
[W socket.cpp:601] [c10d] The client socket has failed to connect to [gpu-node-07]:41234 (errno: 111 - Connection \
refused).
duoka train 494.0M parameters | FSDP2 x8 on 8 x cuda | bfloat16 | global batch 256 = micro-batch 8 x accumulation 4 \
x dp 8 | seq 4096 | peak lr 0.0003
step    10/1000 | loss 9.8123 | lr 3.00e-05 | 412,331 tok/s | MFU 41.2% | 2.54 s/step | ETA 41m 54s
step    20/1000 | loss 8.1290 | lr 6.00e-05 | 415,020 tok/s | MFU 41.5% | 2.53 s/step | ETA 41m 19s
checkpoint step-500 written: training blocked 1.84 s
done in 42m 10s. Run directory: runs/qwen2.5-0.5b-20241130-101500
"""

MEMORY_TALK = """\
alert (memory): GPU 0 (rank 0) memory 96% full: close to out of memory; lower training.micro_batch_size or turn on \
training.activation_checkpointing / training.fused_loss (duoka plan)
step   300/1000 | loss 3.2011 | lr 3.00e-04 | 98,114 tok/s | MFU 48.0% | 5.34 s/step | ETA 1h 2m
peak memory 131.7 GiB of 139.8 GiB; memory_used_bytes=141400000000
Out of memory errors are avoided with activation checkpointing. PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
The device has 80 GB of memory; shared memory /dev/shm is 16G.
"""


# --- The eight required kinds -------------------------------------------------------------

def test_oom_first_then_the_timeout_it_caused():
    found = explain(OOM_THEN_TIMEOUT)
    assert [d.kind for d in found] == ["cuda_oom", "nccl_timeout"]
    oom, timeout = found
    for number in ("rank 1", "2.00 GiB", "GPU 1", "79.11 GiB", "1.19 GiB", "74.21 GiB", "2.19 GiB"):
        assert number in oom.cause, number
    # 2.19 GiB reserved but unallocated > the 2 GiB asked for: fragmentation leads the fix
    assert oom.fix.startswith("2.19 GiB was reserved but unallocated")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in oom.fix
    assert "training.micro_batch_size" in oom.fix and "activation_checkpointing" in oom.fix
    assert "fsdp" in oom.fix and "duoka plan" in oom.fix
    assert "CUDA out of memory. Tried to allocate 2.00 GiB" in oom.evidence
    assert "follows from the cuda_oom above" in timeout.cause
    assert timeout.fix.startswith("fix the cuda_oom first")
    assert "ALLREDUCE number 12" in timeout.cause and "10 min" in timeout.cause
    assert "ranks 0 and 2 timed out" in timeout.cause
    assert "rank 1 reported no timeout" in timeout.cause
    assert "Watchdog caught collective operation timeout" in timeout.evidence


def test_timeout_alone_points_to_the_first_failure_and_the_flight_recorder():
    d = one(TIMEOUT_WITH_SUMMARY, "nccl_timeout")
    assert "one rank stopped joining collectives" in d.cause
    assert "rank 0: ALLREDUCE 87" in d.cause and "rank 1: _ALLGATHER_BASE 88" in d.cause
    assert "different code paths" in d.cause
    assert "first observed failure is rank 0 (exit code -6, SIGABRT: the watchdog's own abort" in d.cause
    for word in ("first rank that failed", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "NCCL_DEBUG=INFO", "raise the timeout", "compile"):
        assert word in d.fix, word


def test_watchdog_stuck_and_gloo_timeouts():
    stuck = ("[rank3]:[E1130 12:00:01.000 ProcessGroupNCCL.cpp:1423] [PG ID 0 PG GUID 0(default_pg) Rank 3] "
             "ProcessGroupNCCL's watchdog got stuck for 480 seconds without making progress in monitoring enqueued "
             "collectives. This typically indicates a NCCL/CUDA API (e.g., CudaEventDestroy) hang blocking the "
             "watchdog, and could be triggered by another thread holding the GIL inside a CUDA api\n")
    d = one(stuck, "nccl_timeout")
    assert "stuck for 480 s" in d.cause and "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC" in d.fix
    gloo = ("RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms "
            "for recv operation to complete\n")
    assert "gloo recv waited 1800 s" in one(gloo, "nccl_timeout").cause


def test_port_in_use():
    d = one(PORT_IN_USE, "port_in_use")
    assert "port 29500" in d.cause and "rendezvous" in d.cause
    assert "--rdzv-endpoint" in d.fix and "MASTER_PORT" in d.fix and "ss -ltnp | grep :29500" in d.fix
    old = ("[W socket.cpp:426] [c10d] The server socket has failed to bind to [::]:29400 (errno: 98 - Address "
           "already in use).\n[E socket.cpp:462] [c10d] The server socket has failed to listen on any local network "
           "address.\nRuntimeError: The server socket has failed to listen on any local network address.\n")
    assert "port 29400" in one(old, "port_in_use").cause
    duoka = ("error: rendezvous port 29500 on node0 is already in use (another job, or a stale one)\n"
             "  fix: pick another port for every node, e.g. --rdzv-endpoint node0:38211\n")
    assert "port 29500" in one(duoka, "port_in_use").cause


def test_port_in_use_by_the_metrics_endpoint():
    log = """\
Traceback (most recent call last):
  File "/work/main/duoka/monitor/sinks.py", line 70, in __init__
    self.server, self.thread = start_http_server(port, addr=host, registry=reg)
  File "/usr/local/lib/python3.11/socketserver.py", line 466, in server_bind
    self.socket.bind(self.server_address)
OSError: [Errno 98] Address already in use
"""
    d = one(log, "port_in_use")
    assert "Prometheus" in d.cause and "metrics.prometheus_port" in d.fix


def test_driver_too_old_decodes_the_version():
    d = one(DRIVER_TOO_OLD, "driver_too_old")
    assert "CUDA up to 11.4 (found version 11040)" in d.cause
    assert "built for CUDA 12.4" in d.cause
    assert "PyTorch build for CUDA 11.x" in d.fix and "whl/cu118" in d.fix and "update the NVIDIA driver" in d.fix
    insufficient = """\
| NVIDIA-SMI 470.182.03   Driver Version: 470.182.03   CUDA Version: 11.4     |
RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA runtime version
"""
    d = one(insufficient, "driver_too_old")
    assert "CUDA Version 11.4" in d.cause and "driver 470.182.03" in d.cause


def test_driver_library_mismatch():
    d = one(DRIVER_MISMATCH, "driver_mismatch")
    assert "libraries are version 535.183.01, the loaded kernel module is 535.161.08" in d.cause
    assert "reboot" in d.fix and "modprobe nvidia" in d.fix
    assert one("Failed to initialize NVML: Driver/library version mismatch\n", "driver_mismatch").cause
    assert "535.104" in one("Failed to initialize NVML: Driver/library version mismatch\nNVML library version: "
                            "535.104\n", "driver_mismatch").cause


def test_shm_from_nccl_is_one_diagnosis():
    d = one(SHM_NCCL, "shm")  # the NCCL "unhandled system error" is the same event, not a second one
    assert "/dev/shm/nccl-vzIpS6" in d.cause and "9.2 MiB" in d.cause and "64 MB" in d.cause
    assert "--shm-size=16g" in d.fix and "--ipc=host" in d.fix and "NCCL_SHM_DISABLE=1" in d.fix
    assert "failed to extend /dev/shm/nccl-vzIpS6" in d.evidence


def test_shm_from_old_nccl_and_not_from_a_cuda_failure():
    old = """\
gpu2-ru7:2143:2561 [1] include/shm.h:28 NCCL WARN Call to posix_fallocate failed : No space left on device
gpu2-ru7:2143:2561 [1] NCCL INFO include/shm.h:41 -> 2
gpu2-ru7:2143:2561 [1] include/shm.h:48 NCCL WARN Error while creating shared memory segment \
nccl-shm-recv-1462445a6f01cbfc-1-2-3 (size 9637888)
"""
    assert "nccl-shm-recv-1462445a6f01cbfc-1-2-3" in one(old, "shm").cause
    cuda = """\
[1] misc/shmutils.cc:103 NCCL WARN Cuda failure 'invalid argument'

[1] misc/shmutils.cc:114 NCCL WARN Error while creating shared memory segment /dev/shm/nccl-NzwJ7O (size 9637888)
torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1691, \
unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3
ncclUnhandledCudaError: Call to CUDA function failed.
Last error:
Cuda failure 'invalid argument'
"""
    assert "Cuda failure 'invalid argument'" in one(cuda, "nccl_error").cause


def test_shm_from_dataloader_workers_and_sigbus():
    d = one(SHM_DATALOADER, "shm")
    assert "DataLoader" in d.cause and "--shm-size" in d.fix
    sigbus = """\
Root Cause (first observed failure):
[0]:
  time      : 2024-11-30_10:22:39
  host      : gpu-node-07
  rank      : 0 (local_rank: 0)
  exitcode  : -7 (pid: 4185)
  error_file: <N/A>
  traceback : Signal 7 (SIGBUS) received by PID 4185
"""
    assert "SIGBUS" in one(sigbus, "shm").cause


def test_disk_full_is_not_shm():
    log = """\
Traceback (most recent call last):
  File "/usr/local/lib/python3.11/site-packages/torch/distributed/checkpoint/filesystem.py", line 311, in _write_files
    stream.write(data)
OSError: [Errno 28] No space left on device: 'runs/a/checkpoints/step-1000/__3_0.distcp'
"""
    d = one(log, "disk_full")
    assert "runs/a/checkpoints/step-1000/__3_0.distcp" in d.cause
    assert "df -h runs/a/checkpoints/step-1000" in d.fix and "checkpoint.keep" in d.fix


def test_invalid_device_ordinal():
    d = one(INVALID_ORDINAL, "gpu_order")
    assert ("--nproc-per-node 8 but CUDA_VISIBLE_DEVICES=0,1,2,3 shows 4 GPUs, so LOCAL_RANK 4 and up have none"
            in d.cause)
    assert "rank 5" in d.cause
    assert "fastest-first" in d.cause
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in d.fix and "UUID" in d.fix and "--nproc-per-node" in d.fix
    duoka = ("error: --nproc-per-node 8 but only 4 GPUs are selected ([0, 1, 2, 3])\n  fix: one process drives one "
             "GPU: lower --nproc-per-node or select more GPUs\n")
    assert "8 processes per node but only 4 GPUs" in one(duoka, "gpu_order").cause
    assert one("AssertionError: Invalid device id\n", "gpu_order")
    gpus = ("error: --gpus 0,5: GPU 5 is not among the GPUs this machine offers ([0, 1, 2, 3])\n  fix: pick from "
            "those, or unset CUDA_VISIBLE_DEVICES (indices are nvidia-smi's)\n")
    assert "GPU 5 is not among the GPUs this machine offers" in one(gpus, "gpu_order").cause


def test_tp_heads_duoka_wording_lists_valid_sizes():
    log = ("error: parallel.tp=8 does not divide the model's 28 attention heads and 4 KV heads (each tensor-parallel "
           "rank must own whole heads; KV heads are not replicated)\n  fix: use parallel.tp in [1, 2, 4]\n")
    d = one(log, "tp_heads")
    assert "size 8" in d.cause and "28 attention heads and 4 KV heads" in d.cause
    assert "1, 2 or 4" in d.fix and "--parallel.tp=4" in d.fix


def test_tp_heads_generic_wording():
    vllm = ('config.json: {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4}\n'
            "ValueError: Total number of attention heads (28) must be divisible by tensor parallel size (8).\n")
    d = one(vllm, "tp_heads")
    assert "28 attention heads and 4 KV heads" in d.cause and "1, 2 or 4" in d.fix
    bare = "AssertionError: num_attention_heads (28) must be divisible by tensor parallel size (8)\n"
    d = one(bare, "tp_heads")
    assert "1, 2, 4, 7, 14 or 28" in d.fix and "num_key_value_heads" in d.fix


def test_tokenizer_missing():
    duoka = ("error: /models/Qwen2-7B-weights has no tokenizer.json (found: config.json, generation_config.json, "
             "model-00001-of-00004.safetensors)\n  fix: copy tokenizer.json and tokenizer_config.json from the "
             "original model folder\n")
    d = one(duoka, "tokenizer_missing")
    assert "/models/Qwen2-7B-weights has no tokenizer.json" in d.cause
    assert "model.tokenizer" in d.fix and "tokenizer_config.json" in d.fix and "/models/Qwen2-7B-weights" in d.fix
    assert "no tokenizer files it can read in /models/ckpt-1000" in one(TOKENIZER_HF, "tokenizer_missing").cause
    hub = ("OSError: /models/ckpt-1000 does not appear to have a file named tokenizer.json. Checkout "
           "'https://huggingface.co//models/ckpt-1000/tree/None' for available files.\n")
    assert "/models/ckpt-1000 has no tokenizer.json" in one(hub, "tokenizer_missing").cause
    flavor = "error: model.flavor=qwen2-7b has no tokenizer to read data.path with\n"
    assert "model.tokenizer" in one(flavor, "tokenizer_missing").fix


# --- The further kinds -----------------------------------------------------------------------

def test_oom_old_format_and_duoka_wording():
    old = ("RuntimeError: CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity; 14.56 GiB "
           "already allocated; 3.44 MiB free; 14.69 GiB reserved in total by PyTorch) If reserved memory is >> "
           "allocated memory try setting max_split_size_mb to avoid fragmentation.  See documentation for Memory "
           "Management and PYTORCH_CUDA_ALLOC_CONF\n")
    d = one(old, "cuda_oom")
    assert "20.00 MiB on GPU 0" in d.cause and "15.78 GiB" in d.cause and "3.44 MiB" in d.cause
    assert d.fix.startswith("lower training.micro_batch_size") and "expandable_segments" in d.fix
    duoka = ("error: training stopped on rank(s) 3: CUDA out of memory on rank 3 (micro-batch 8, seq_len 4096)\n"
             "  fix: lower training.micro_batch_size (or set it to auto), set training.activation_checkpointing=full, "
             "or shard with parallel.dp_mode=fsdp\n")
    d = one(duoka, "cuda_oom")
    assert d.cause.startswith("rank 3 ran out of GPU memory") and "micro-batch 8, seq_len 4096" in d.cause


def test_oom_with_another_process_on_the_gpu():
    log = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.02 GiB. GPU 0 has a total capacity of "
           "139.72 GiB of which 611.94 MiB is free. Process 91822 has 70.12 GiB memory in use. Including non-PyTorch "
           "memory, this process has 68.99 GiB memory in use. Of the allocated memory 66.10 GiB is allocated by "
           "PyTorch, and 1.42 GiB is reserved by PyTorch but unallocated.\n")
    d = one(log, "cuda_oom")
    assert "process 91822: 70.12 GiB" in d.cause
    assert d.fix.startswith("1.42 GiB was reserved but unallocated")


def test_gpu_hardware_fault_comes_first():
    log = """\
[Sat Nov 30 10:11:12 2024] NVRM: Xid (PCI:0000:3b:00): 79, pid=4186, name=python3, GPU has fallen off the bus.
[rank1]: RuntimeError: CUDA error: unspecified launch failure
[rank0]:[E1130 10:21:12.000 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 milliseconds before \
timing out.
"""
    found = explain(log)
    assert [d.kind for d in found] == ["gpu_hardware", "nccl_timeout"]
    assert "Xid 79 on PCI:0000:3b:00" in found[0].cause and "ROW_REMAPPER" in found[0].fix
    ecc = "RuntimeError: CUDA error: uncorrectable ECC error encountered\n"
    assert "ECC" in one(ecc, "gpu_hardware").cause
    assert explain("NVRM: Xid (PCI:0000:3b:00): 13, Graphics SM Warp Exception on (GPC 0, TPC 1)\n") == []


def test_nccl_error_and_the_timeout_after_it():
    log = """\
[rank3]: torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, \
unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5
[rank3]: ncclUnhandledCudaError: Call to CUDA function failed.
[rank3]: Last error:
[rank3]: Cuda failure 'peer access is not supported between these two devices'
[rank0]:[E1130 10:21:12.000 ProcessGroupNCCL.cpp:616] [Rank 0] Watchdog caught collective operation timeout: \
WorkNCCL(SeqNum=1, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600010 milliseconds before \
timing out.
"""
    err, timeout = explain(log)
    assert (err.kind, timeout.kind) == ("nccl_error", "nccl_timeout")
    assert "unhandled cuda error" in err.cause and "NCCL 2.20.5" in err.cause and "rank 3" in err.cause
    assert "last error: Cuda failure 'peer access" in err.cause
    assert "peer access is not supported" in err.cause and "NCCL_P2P_DISABLE=1" in err.fix
    assert "follows from the nccl_error above" in timeout.cause


def test_rendezvous_timeout():
    log = """\
[W socket.cpp:601] [c10d] The client socket has failed to connect to [node0]:29500 (errno: 111 - Connection refused).
Traceback (most recent call last):
  File "/usr/local/lib/python3.11/site-packages/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py", line \
680, in next_rendezvous
    raise RendezvousTimeoutError
torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError
"""
    d = one(log, "rendezvous")
    assert "node0:29500" in d.cause and "Connection refused" in d.cause
    assert "--nnodes" in d.fix and "--rdzv-endpoint" in d.fix and "nc -zv" in d.fix
    store = "torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.\n"
    assert "only 1 of 2 processes" in one(store, "rendezvous").cause


def test_workers_killed_by_the_host_oom_killer():
    log = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
train.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2024-11-30_10:22:39
  host      : gpu-node-07
  rank      : 2 (local_rank: 2)
  exitcode  : -9 (pid: 4187)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4187
============================================================
"""
    d = one(log, "worker_killed")
    assert "rank 2" in d.cause and "OOM killer" in d.cause and "dmesg" in d.fix
    slurm = log + ("slurmstepd: error: Detected 1 oom_kill event in StepId=81234.0. Some of the step tasks have been "
                   "OOM Killed.\n")
    d = one(slurm, "host_oom")
    assert "host memory" in d.cause and "--mem" in d.fix


def test_device_side_assert_from_a_token_id_outside_the_vocabulary():
    log = """\
../aten/src/ATen/native/cuda/Indexing.cu:1289: indexSelectLargeIndex: block: [14,0,0], thread: [64,0,0] Assertion \
`srcIndex < srcSelectDimSize` failed.
[rank0]: RuntimeError: CUDA error: device-side assert triggered
[rank0]: CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be \
incorrect.
"""
    d = one(log, "device_assert")
    assert "token id" in d.cause and "duoka prepare" in d.fix and "CUDA_LAUNCH_BLOCKING=1" in d.fix
    labels = ("../aten/src/ATen/native/cuda/Loss.cu:250: nll_loss_forward_reduce_cuda_kernel_2d: block: [0,0,0], "
              "thread: [5,0,0] Assertion `t >= 0 && t < n_classes` failed.\n")
    assert "-100" in one(labels, "device_assert").fix


def test_tensors_on_two_devices():
    old = ("RuntimeError: Expected all tensors to be on the same device, but found at least two devices, cuda:0 and "
           "cpu!\n")
    assert "cuda:0 and cpu" in one(old, "device_mismatch").cause
    new = ("RuntimeError: Expected all tensors to be on the same device, but got index is on cuda:1, different from "
           "other tensors on cuda:0 (when checking argument in method wrapper_CUDA__index_select)\n")
    d = one(new, "device_mismatch")
    assert "cuda:0 and cuda:1" in d.cause and "another rank's GPU" in d.cause and "set_device" in d.fix


def test_two_ranks_on_one_gpu_and_busy_gpus():
    dup = """\
torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, invalid usage \
(run with NCCL_DEBUG=WARN for details), NCCL version 2.20.5
ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
Last error:
Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000
"""
    d = one(dup, "duplicate_gpu")
    assert "ranks 0 and 1" in d.cause and "1b000" in d.cause and "set_device" in d.fix
    busy = "[rank2]: RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable\n"
    d = one(busy, "gpu_busy")
    assert "rank 2" in d.cause and "nvidia-smi -q -d COMPUTE" in d.fix


# --- Nothing known, nothing loose ------------------------------------------------------------

def test_clean_training_log_gives_nothing():
    assert explain(CLEAN) == []
    assert explain("") == []


def test_talk_about_memory_is_no_out_of_memory_error():
    assert explain(MEMORY_TALK) == []


def test_colour_codes_and_carriage_returns_do_not_hide_a_failure():
    coloured = "\x1b[31m" + OOM_NEW.replace("CUDA out of memory", "CUDA out of\x1b[0m memory", 1) + "\x1b[0m\r\n"
    assert kinds(coloured) == ["cuda_oom"]
    assert kinds("step 3/10\rstep 4/10\r" + OOM_NEW) == ["cuda_oom"]


def test_diagnosis_is_frozen_and_evidence_is_short():
    d = explain(OOM_THEN_TIMEOUT * 20)[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.kind = "x"
    assert all(len(x.evidence) <= EVIDENCE_CHARS for x in explain(OOM_THEN_TIMEOUT * 20))
    assert [f.name for f in dataclasses.fields(Diagnosis)] == ["kind", "cause", "fix", "evidence"]


@pytest.mark.parametrize("log, kind", [
    (OOM_THEN_TIMEOUT, "cuda_oom"), (PORT_IN_USE, "port_in_use"), (DRIVER_TOO_OLD, "driver_too_old"),
    (DRIVER_MISMATCH, "driver_mismatch"), (SHM_NCCL, "shm"), (INVALID_ORDINAL, "gpu_order"),
    (TOKENIZER_HF, "tokenizer_missing"), (TIMEOUT_WITH_SUMMARY, "nccl_timeout"),
])
def test_a_failure_inside_a_long_clean_log(log, kind):
    assert kinds(CLEAN * 200 + log + CLEAN * 50)[0] == kind
