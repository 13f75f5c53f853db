"""Failures that stop a job before it trains or as it starts, one detector each (named after
the kind of Diagnosis it returns, None when its failure is not in the log): what stops
every GPU program (a driver too old or mismatched, a failing GPU), what stops the start
(a port taken, a rendezvous never met, tp not dividing the heads, tokenizer files
missing), a process's choice of GPU (an index that does not exist, two ranks on one GPU, a
GPU held by another process), and the space a run needs (/dev/shm, a disk).

The patterns are the real messages of PyTorch 2.x, NCCL, the NVIDIA driver and duoka
itself, each quoted above it. What kills a rank while it trains: duoka.doctor.rank_failures.
"""

from __future__ import annotations

import math
import re

from duoka.doctor.log_reader import Diagnosis, Log, human_size, ranks_text, rx

# --- The driver is older than the CUDA that PyTorch was built for ---------------------
# RuntimeError: The NVIDIA driver on your system is too old (found version 11040). Please update your GPU
#   driver by downloading and installing a new version from the URL: http://www.nvidia.com/Download/index.aspx
#   Alternatively, go to: https://pytorch.org to install a PyTorch version that has been compiled with your
#   version of the CUDA driver.  (also as "UserWarning: CUDA initialization: The NVIDIA driver ...")
_DRIVER_TOO_OLD = re.compile(r"The NVIDIA driver on your system is too old \(found version (\d+)\)")
# RuntimeError: CUDA error: CUDA driver version is insufficient for CUDA runtime version
# UserWarning: CUDA initialization: ... Error 35: CUDA driver version is insufficient for CUDA runtime version
_DRIVER_INSUFFICIENT = re.compile(r"CUDA driver version is insufficient for CUDA runtime version")
# nvidia-smi's header: "| NVIDIA-SMI 470.182.03   Driver Version: 470.182.03   CUDA Version: 11.4 |"
_SMI_DRIVER = re.compile(r"Driver Version: (\d+(?:\.\d+)+)")
_SMI_CUDA = re.compile(r"CUDA Version: (\d+(?:\.\d+)+)")
# PyTorch's version in a pip list / torch.__version__ line: "torch 2.5.1+cu124", "2.5.1+cu124"
_TORCH_CUDA = re.compile(r"\d+\.\d+(?:\.\d+)?\+cu(\d{2,3})\b")


def driver_too_old(log: Log) -> Diagnosis | None:
    found = log.find(_DRIVER_TOO_OLD, _DRIVER_INSUFFICIENT)
    if not found:
        return None
    facts = []
    old = next((m for m in found if m.re is _DRIVER_TOO_OLD), None)
    driver_cuda = None
    if old:
        v = int(old.group(1))
        driver_cuda = f"{v // 1000}.{v % 1000 // 10}"
        facts.append(f"the driver supports CUDA up to {driver_cuda} (found version {v})")
    else:
        smi = _SMI_CUDA.search(log.text)
        if smi:
            driver_cuda = smi.group(1)
            facts.append(f"nvidia-smi reports CUDA Version {driver_cuda} for the driver")
    drv = _SMI_DRIVER.search(log.text)
    if drv:
        facts.append(f"driver {drv.group(1)}")
    built = _TORCH_CUDA.search(log.text)
    if built:
        cu = built.group(1)
        facts.append(f"PyTorch was built for CUDA {cu[:-1]}.{cu[-1]}")
    cause = ("the NVIDIA driver is older than the CUDA runtime this PyTorch build needs, so CUDA cannot start"
             + (": " + ", ".join(facts) if facts else ""))
    major = driver_cuda.split(".")[0] if driver_cuda else None
    wheel = (f"install a PyTorch build for CUDA {major}.x, which this driver runs"
             + (" (pip install torch --index-url https://download.pytorch.org/whl/cu118)" if major == "11" else "")
             if major else "install a PyTorch build for the CUDA version `nvidia-smi` shows (pytorch.org lists "
                           "the builds)")
    fix = (f"{wheel}, or update the NVIDIA driver to one whose `nvidia-smi` 'CUDA Version' is at least the "
           "CUDA of the PyTorch build (`python -c 'import torch; print(torch.version.cuda)'`)")
    return Diagnosis("driver_too_old", cause, fix, log.evidence(found))


# --- The loaded kernel module and the user-space driver libraries differ ---------------
# nvidia-smi: "Failed to initialize NVML: Driver/library version mismatch" (newer ones add
#   "NVML library version: 535.129")
_NVML_MISMATCH = rx(r"Driver/library version mismatch|NVML library version mismatch|NVML/RM version mismatch|"
                    r"NVMLError_LibRmVersionMismatch", "version mismatch", "versionmismatch")
_NVML_LIB_VERSION = re.compile(r"NVML library version: (\d+(?:\.\d+)+)")
# dmesg: "NVRM: API mismatch: the client has the version 535.129.03, but
#         NVRM: this kernel module has the version 535.104.05.  Please make sure that this ..."
_NVRM_CLIENT = re.compile(r"NVRM: API mismatch: the client has the version (\d+(?:\.\d+)+)")
_NVRM_MODULE = re.compile(r"this kernel module has the version (\d+(?:\.\d+)+)")
# UserWarning: CUDA initialization: Unexpected error from cudaGetDeviceCount(). ... Error 803: system has
#   unsupported display driver / cuda driver combination
_CUDA_803 = re.compile(r"system has unsupported display driver / cuda driver combination")


def driver_mismatch(log: Log) -> Diagnosis | None:
    found = log.find(_NVML_MISMATCH, _NVRM_CLIENT, _CUDA_803)
    if not found:
        return None
    lib = _NVRM_CLIENT.search(log.text) or _NVML_LIB_VERSION.search(log.text)
    module = _NVRM_MODULE.search(log.text)
    versions = []
    if lib:
        versions.append(f"the driver libraries are version {lib.group(1)}")
    if module:
        versions.append(f"the loaded kernel module is {module.group(1)}")
    cause = ("the NVIDIA kernel module that is loaded and the driver's user-space libraries (NVML, libcuda) are "
             "different versions, typically after a driver update without a reboot; no GPU program can start"
             + (": " + ", ".join(versions) if versions else ""))
    fix = ("reboot the machine, or with no GPU process running reload the modules (sudo rmmod nvidia_uvm "
           "nvidia_drm nvidia_modeset nvidia && sudo modprobe nvidia); in a container the NVIDIA libraries must "
           "come from the host (NVIDIA Container Toolkit), not be installed in the image. `nvidia-smi` works "
           "again when they match")
    return Diagnosis("driver_mismatch", cause, fix, log.evidence(found))


# --- A GPU is failing (ECC errors, Xid events, fallen off the bus) --------------------
# RuntimeError: CUDA error: uncorrectable ECC error encountered
_ECC = re.compile(r"uncorrectable ECC error encountered")
# dmesg: "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
_XID = re.compile(r"NVRM: Xid \((PCI:[0-9A-Fa-f:.]+)\): (\d+)")
# nvidia-smi: "Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  Reboot the system ..."
_GPU_LOST = rx(r"GPU has fallen off the bus|GPU is lost\b", "fallen off the bus", "gpu is lost")
# Xids that point to the hardware (NVIDIA's Xid catalog): 48 double-bit ECC, 61/62 internal micro-controller,
# 63/64 ECC page retirement / row remapping, 74 NVLink, 79 fallen off the bus, 92 high single-bit ECC rate,
# 94/95 contained/uncontained ECC, 119/120 GSP. Others (13, 31, 43, 45) usually come from the program.
_HARDWARE_XIDS = {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}


def gpu_hardware(log: Log) -> Diagnosis | None:
    xids = [m for m in log.find(_XID) if int(m.group(2)) in _HARDWARE_XIDS]
    found = sorted(log.find(_ECC, _GPU_LOST) + xids, key=lambda m: m.start())
    if not found:
        return None
    facts = []
    if xids:
        by_gpu: dict[str, list[int]] = {}
        for m in xids:
            by_gpu.setdefault(m.group(1), [])
            if int(m.group(2)) not in by_gpu[m.group(1)]:
                by_gpu[m.group(1)].append(int(m.group(2)))
        facts.append("; ".join(f"Xid {', '.join(map(str, x))} on {gpu}" for gpu, x in by_gpu.items()))
    if any(m.re is _ECC for m in found):
        facts.append("an uncorrectable ECC memory error")
    if any(m.re is _GPU_LOST for m in found):
        facts.append("a GPU fell off the bus")
    cause = ("a GPU has a hardware fault, not the program: " + "; ".join(facts)
             + ". The process on that GPU fails, and every other rank then waits for it")
    fix = ("check it with `nvidia-smi -q -d ECC,ROW_REMAPPER` and `dmesg -T | grep -i xid`; leave that GPU out "
           "(--gpus / CUDA_VISIBLE_DEVICES) or have the node drained and the GPU reset or replaced by an "
           "administrator, then continue from the last checkpoint (--checkpoint.resume=auto)")
    return Diagnosis("gpu_hardware", cause, fix, log.evidence(found))


# --- The rendezvous / master port is taken --------------------------------------------
# torch >= 2.4: torch.distributed.DistNetworkError: The server socket has failed to listen on any local network
#   address. port: 29500, useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use
# torch 2.0-2.3: [W socket.cpp:436] [c10d] The server socket has failed to bind to [::]:29500 (errno: 98 -
#   Address already in use). ... The server socket has failed to listen on any local network address.
# (torch >= 2.4 warns "... has failed to listen on [::]:29500 (errno: 98 - Address already in use).")
# plain sockets: OSError: [Errno 98] Address already in use
_ADDR_IN_USE = rx(r"Address already in use|EADDRINUSE|The server socket has failed to listen on any local "
                  r"network address", "address already in use", "eaddrinuse", "failed to listen on any",
                  flags=re.IGNORECASE)
_BIND_PORT = re.compile(r"failed to (?:bind to|listen on) \S*?:(\d+)|\bport: (\d+), useIpv6")
# duoka: "error: rendezvous port 29500 on node0 is already in use (another job, or a stale one)"
_DUOKA_PORT = re.compile(r"rendezvous port (\d+) on (\S+) is already in use")
# Which server it was: PyTorch's store ("[c10d]", DistNetworkError, socket.cpp) or duoka's Prometheus endpoint
# (a traceback through prometheus_client's start_http_server).
_C10D_SERVER = re.compile(r"c10d|DistNetworkError|socket\.cpp|server socket|rendezvous|MASTER_PORT", re.IGNORECASE)
_METRICS_SERVER = re.compile(r"start_http_server|prometheus", re.IGNORECASE)


def port_in_use(log: Log) -> Diagnosis | None:
    found = log.find(_ADDR_IN_USE, _DUOKA_PORT)
    if not found:
        return None
    port = None
    for m in log.find(_DUOKA_PORT, _BIND_PORT):
        port = m.group(1) or m.group(2)
        break
    where = f"port {port}" if port else "a port"
    near = log.around(found[0], 30, 5)
    if _METRICS_SERVER.search(near) and not _C10D_SERVER.search(near):
        cause = (f"{where} is already taken on this machine, so the Prometheus metrics endpoint could not listen "
                 "on it: another job, or a stale process of an earlier run, holds it")
        fix = ("choose another metrics.prometheus_port (one per job on a machine), or find the holder with "
               f"`ss -ltnp | grep :{port or 'PORT'}` and end it if it is a leftover")
        return Diagnosis("port_in_use", cause, fix, log.evidence(found))
    cause = (f"{where} is already taken on this machine, so the rendezvous store (torchrun's / duoka's "
             "MASTER_PORT) could not listen on it: another job, or a stale process of an earlier run, holds it")
    fix = ("pick another free port, the same on every node (duoka: --rdzv-endpoint HOST:PORT; torchrun: "
           "--rdzv-endpoint / --master-port, or MASTER_PORT), or find the holder with "
           f"`ss -ltnp | grep :{port or 'PORT'}` and end it if it is a leftover")
    return Diagnosis("port_in_use", cause, fix, log.evidence(found))


# --- The nodes never all met at the rendezvous ----------------------------------------
# torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError
# torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed.
# torch.distributed.DistStoreError: Timed out after 901 seconds waiting for clients. 1/2 clients joined.
# torch.distributed.DistNetworkError: The client socket has failed to connect to any network address of (node0, 29500).
_RDZV_TIMEOUT = re.compile(r"RendezvousTimeoutError")
_RDZV_CONNECTION = rx(r"RendezvousConnectionError|The connection to the C10d store has failed",
                      "rendezvousconnectionerror", "connection to the c10d store")
_STORE_CLIENTS = re.compile(r"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined")
_CLIENT_GAVE_UP = re.compile(r"DistNetworkError: The client socket has failed to connect")
# Details only, never a finding alone: these warnings repeat while a node waits for node 0 to come up, and a
# run that then starts well prints them too.
#   "[W socket.cpp:601] [c10d] The client socket has failed to connect to [node0]:29500 (errno: 111 - Connection
#   refused)."   "... failed to connect to any network address of (node0, 29500)"
#   "TCP client failed to connect/validate to host node0:29500 - timed out (try=0, timeout=600000ms, ...)"
_CLIENT_TARGET = re.compile(r"failed to connect to \[?([\w.\-]+)\]?:(\d+)|failed to connect to any network address "
                            r"of \(([\w.\-]+), (\d+)\)|connect/validate to host ([\w.\-]+):(\d+)")
_CLIENT_REASON = re.compile(r"Connection refused|No route to host|Name or service not known|timed out")


def rendezvous(log: Log) -> Diagnosis | None:
    found = log.find(_RDZV_TIMEOUT, _RDZV_CONNECTION, _STORE_CLIENTS, _CLIENT_GAVE_UP)
    if not found:
        return None
    facts = []
    clients = _STORE_CLIENTS.search(log.text)
    if clients:
        facts.append(f"after {clients.group(1)} s only {clients.group(2)} of {clients.group(3)} processes had "
                     "joined the store")
    target = _CLIENT_TARGET.search(log.text)
    if target:
        host, port = [g for g in target.groups() if g is not None][:2]
        reason = _CLIENT_REASON.search(log.line(target))
        facts.append(f"connecting to {host}:{port} failed" + (f" ({reason.group(0)})" if reason else ""))
    if not facts and _RDZV_TIMEOUT.search(log.text):
        facts.append("the rendezvous timed out waiting for the other nodes")
    cause = ("the processes of the job never all met at the rendezvous, so training could not start: "
             + "; ".join(facts or ["this node could not reach the rendezvous store"])
             + ". A node was not started, was started with other --nnodes / endpoint values, or cannot reach "
             "node 0's address and port")
    fix = ("run the same command on every node with the same --nnodes and --rdzv-endpoint HOST:PORT (node 0's "
           "address, which hosts the store: start node 0 too); from each node check `nc -zv HOST PORT`; open the "
           "port in the firewall; if HOST resolves to the wrong interface use the IP address")
    return Diagnosis("rendezvous", cause, fix, log.evidence(found))


# --- Tensor parallelism does not divide the attention heads ----------------------------
# duoka (ParallelDims.check_model): "error: parallel.tp=8 does not divide the model's 28 attention heads and
#   4 KV heads (each tensor-parallel rank must own whole heads; KV heads are not replicated)"
_DUOKA_HEADS = re.compile(r"parallel\.tp=(\d+) does not divide the model's (\d+) attention heads and (\d+) KV heads")
# vLLM and others: "ValueError: Total number of attention heads (28) must be divisible by tensor parallel size (8)."
#   "num_attention_heads (28) must be divisible by tensor parallel size (8)"
_TP_WORDS = (r"(?:must|should) be (?:divisible by|a multiple of) (?:the )?"
             r"(?:tensor[ _-]?(?:model[ _-]?)?parallel(?:ism)?(?:[ _-]?(?:size|degree|world size))?|tp(?:[ _]size)?)"
             r" ?\((\d+)\)")
_HEADS_TP = rx(r"(?:num_attention_heads|attention heads|query heads|num_heads|n_heads) ?\((\d+)\) " + _TP_WORDS,
               "divisible by", "multiple of", flags=re.IGNORECASE)
_KV_HEADS_TP = rx(r"(?:num_key_value_heads|KV heads|key[- ]value heads|n_kv_heads) ?\((\d+)\) " + _TP_WORDS,
                  "divisible by", "multiple of", flags=re.IGNORECASE)
# config.json printed in the log: "num_attention_heads": 28, "num_key_value_heads": 4
_HEADS_FIELD = re.compile(r"\"?\b(?:num_attention_heads|n_heads)\"?\s*[:=]\s*(\d+)")
_KV_FIELD = re.compile(r"\"?\b(?:num_key_value_heads|n_kv_heads)\"?\s*[:=]\s*(\d+)")


def tp_heads(log: Log) -> Diagnosis | None:
    found = log.find(_DUOKA_HEADS, _HEADS_TP, _KV_HEADS_TP)
    if not found:
        return None
    heads = kv = tp = None
    for m in found:
        if m.re is _DUOKA_HEADS:
            tp, heads, kv = int(m.group(1)), int(m.group(2)), int(m.group(3))
        elif m.re is _HEADS_TP:
            heads, tp = heads or int(m.group(1)), tp or int(m.group(2))
        else:
            kv, tp = kv or int(m.group(1)), tp or int(m.group(2))
    if heads is None and (f := _HEADS_FIELD.search(log.text)):
        heads = int(f.group(1))
    if kv is None and (f := _KV_FIELD.search(log.text)):
        kv = int(f.group(1))
    counts = " and ".join(x for x in (f"{heads} attention heads" if heads else "",
                                      f"{kv} KV heads" if kv else "") if x)
    cause = (f"tensor parallelism of size {tp} does not divide the model's {counts}: each tensor-parallel rank "
             "must own whole query and KV heads")
    if heads and kv:
        g = math.gcd(heads, kv)
        valid = [d for d in range(1, g + 1) if g % d == 0]
        fix = (f"use a tp that divides both {heads} and {kv}: {_or_list(valid)} (e.g. --parallel.tp={valid[-1]}), "
               "and give the other GPUs to data parallelism; `duoka plan` ranks the layouts that fit")
    else:
        n = heads or kv
        valid = [d for d in range(1, n + 1) if n % d == 0]
        other = "KV heads (num_key_value_heads" if heads else "attention heads (num_attention_heads"
        fix = (f"use a tp that divides {n}: {_or_list(valid)}, and that also divides the model's {other} in "
               "config.json); give the other GPUs to data parallelism; `duoka plan` ranks the layouts that fit")
    return Diagnosis("tp_heads", cause, fix, log.evidence(found))


def _or_list(xs: list[int]) -> str:
    return str(xs[0]) if len(xs) == 1 else ", ".join(map(str, xs[:-1])) + f" or {xs[-1]}"


# --- Tokenizer files are missing ------------------------------------------------------
# duoka (data/tokenizer.py): "error: /models/qwen2-7b has no tokenizer.json (found: config.json,
#   model-00001-of-00004.safetensors, ...)"
_DUOKA_NO_TOKENIZER = rx(r"(\S+) has no tokenizer\.json", "has no tokenizer.json")
# duoka (launcher.py): "error: model.flavor=qwen2-7b has no tokenizer to read data.path with"
_DUOKA_FLAVOR_TOKENIZER = re.compile(r"model\.flavor=(\S+) has no tokenizer to read data\.path with")
# transformers: "OSError: Can't load tokenizer for 'Qwen/Qwen2-7B'. If you were trying to load it from
#   'https://huggingface.co/models', make sure you don't have a local directory with the same name. ..."
_CANT_LOAD_TOKENIZER = re.compile(r"Can't load tokenizer for '([^']+)'")
# transformers / huggingface_hub: "OSError: /models/x does not appear to have a file named tokenizer.json.
#   Checkout 'https://huggingface.co//models/x/tree/None' for available files."
_NO_FILE_NAMED = rx(r"(\S+) does not appear to have a file named (tokenizer\.json|tokenizer_config\.json|"
                    r"vocab\.json|merges\.txt|tokenizer\.model)", "does not appear to have a file named")
_TOKENIZER_NOT_FOUND = rx(r"tokenizer(?:\.json|_config\.json)? (?:file )?not found", "not found",
                          flags=re.IGNORECASE)


def tokenizer_missing(log: Log) -> Diagnosis | None:
    found = log.find(_DUOKA_NO_TOKENIZER, _DUOKA_FLAVOR_TOKENIZER, _CANT_LOAD_TOKENIZER, _NO_FILE_NAMED,
                     _TOKENIZER_NOT_FOUND)
    if not found:
        return None
    first = found[0]
    if first.re is _DUOKA_FLAVOR_TOKENIZER:
        cause = (f"model.flavor={first.group(1)} is a bare shape without a tokenizer, and the data has to be "
                 "tokenized")
        fix = ("set model.tokenizer to a Qwen2 tokenizer folder holding tokenizer.json and tokenizer_config.json "
               "(or a hub id such as Qwen/Qwen2-7B), or use --model.path with a full model folder")
        return Diagnosis("tokenizer_missing", cause, fix, log.evidence(found))
    if first.re is _CANT_LOAD_TOKENIZER:
        where = first.group(1)
        cause = (f"the tokenizer cannot be loaded: transformers found no tokenizer files it can read in {where} "
                 "(a folder with weights alone is not enough to read text; or a hub id that does not exist)")
    else:
        where = first.group(1).rstrip(".,:") if first.re is not _TOKENIZER_NOT_FOUND else None
        what = first.group(2) if first.re is _NO_FILE_NAMED else "tokenizer.json"
        cause = (f"the tokenizer cannot be loaded: {where or 'the model folder'} has no {what}"
                 + (" (a folder with weights alone is not enough to read text)" if what == "tokenizer.json" else ""))
    fix = ("point model.tokenizer at a folder with tokenizer.json and tokenizer_config.json (the original model's "
           "folder or its hub id), or copy those files from the original model next to the weights"
           + (f" in {where}" if where else "")
           + "; a slow-only tokenizer converts once with AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
    return Diagnosis("tokenizer_missing", cause, fix, log.evidence(found))


# --- A GPU index that does not exist for this process ---------------------------------
# RuntimeError: CUDA error: invalid device ordinal  (HIP error: invalid device ordinal on ROCm)
# AssertionError: Invalid device id  (torch.cuda.get_device_properties(n) with n too large)
_INVALID_ORDINAL = rx(r"invalid device ordinal|AssertionError: Invalid device id", "invalid device ordinal",
                      "invalid device id")
# duoka (parallel/devices.py, launch.py):
#   "CUDA_VISIBLE_DEVICES names 'GPU-3f2a', which is no GPU of this machine"
#   "--nproc-per-node 8 but only 4 GPUs are selected ([0, 1, 2, 3])"
#   "--gpus 0,5: GPU 5 is not among the GPUs this machine offers ([0, 1, 2, 3])"
_DUOKA_VISIBLE = re.compile(r"CUDA_VISIBLE_DEVICES names '([^']*)', which is no GPU of this machine")
_DUOKA_NPROC = re.compile(r"--nproc-per-node (\d+) but only (\d+) GPUs are selected")
_DUOKA_GPU_NOT_AMONG = re.compile(r"GPU (\d+) is not among the GPUs (.+?) offers")
_VISIBLE_VALUE = re.compile(r"CUDA_VISIBLE_DEVICES=([\w,\-]+)")
_NPROC_VALUE = re.compile(r"--nproc[-_]per[-_]node[= ](\d+)")


def gpu_order(log: Log) -> Diagnosis | None:
    found = log.find(_INVALID_ORDINAL, _DUOKA_VISIBLE, _DUOKA_NPROC, _DUOKA_GPU_NOT_AMONG)
    if not found:
        return None
    facts = []
    nproc = _DUOKA_NPROC.search(log.text)
    visible = _VISIBLE_VALUE.search(log.text)
    n = _NPROC_VALUE.search(log.text)
    if nproc:
        facts.append(f"{nproc.group(1)} processes per node but only {nproc.group(2)} GPUs")
    elif n and visible and int(n.group(1)) > len(visible.group(1).split(",")):
        shown = len(visible.group(1).split(","))
        facts.append(f"--nproc-per-node {n.group(1)} but CUDA_VISIBLE_DEVICES={visible.group(1)} shows {shown} GPUs, "
                     f"so LOCAL_RANK {shown} and up have none")
    else:
        if n:
            facts.append(f"--nproc-per-node {n.group(1)}")
        if visible:
            facts.append(f"CUDA_VISIBLE_DEVICES={visible.group(1)} (CUDA then numbers those GPUs from 0)")
    if (named := _DUOKA_VISIBLE.search(log.text)):
        facts.append(f"CUDA_VISIBLE_DEVICES names {named.group(1)!r}, which is no GPU of this machine")
    if (outside := _DUOKA_GPU_NOT_AMONG.search(log.text)):
        facts.append(f"GPU {outside.group(1)} is not among the GPUs {outside.group(2)} offers")
    ranks = log.ranks([m for m in found if m.re is _INVALID_ORDINAL])
    if ranks:
        facts.append(f"failing on {ranks_text(ranks)}")
    cause = ("a process asked for a GPU that does not exist for it: CUDA numbers only the GPUs that "
             "CUDA_VISIBLE_DEVICES leaves visible, from 0, and numbers them fastest-first unless "
             "CUDA_DEVICE_ORDER=PCI_BUS_ID, so 'GPU 1' of nvidia-smi can be another card, or no card, for CUDA; "
             "more processes per node than visible GPUs fail the same way"
             + (" (" + "; ".join(facts) + ")" if facts else ""))
    fix = ("set CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA's indices are nvidia-smi's (duoka's launcher does), or name "
           "GPUs by UUID in CUDA_VISIBLE_DEVICES (`nvidia-smi -L`); make --nproc-per-node at most the number of "
           "visible GPUs, and pick each process's GPU by LOCAL_RANK (cuda:LOCAL_RANK)")
    return Diagnosis("gpu_order", cause, fix, log.evidence(found))


# --- Two ranks on one GPU ---------------------------------------------------------------
# torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275, invalid usage
#   (run with NCCL_DEBUG=WARN for details), NCCL version 2.20.5
#   ncclInvalidUsage: This usually reflects invalid usage of NCCL library.
#   Last error:
#   Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1b000
DUPLICATE_GPU = re.compile(r"Duplicate GPU detected ?: rank (\d+) and rank (\d+) both on CUDA device (\w+)")


def duplicate_gpu(log: Log) -> Diagnosis | None:
    found = log.find(DUPLICATE_GPU)
    if not found:
        return None
    m = found[0]
    cause = (f"ranks {m.group(2)} and {m.group(1)} use the same GPU (CUDA device {m.group(3)}, its PCI bus id): "
             "each process of a NCCL job needs its own GPU, but these did not select one (so all sit on cuda:0), "
             "or CUDA_VISIBLE_DEVICES showed them the same card")
    fix = ("in each process call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) (or pass device_id to "
           "init_process_group) before the first collective, as duoka train does; do not give all ranks of one "
           "torchrun the same single-GPU CUDA_VISIBLE_DEVICES; keep --nproc-per-node at most the number of GPUs")
    return Diagnosis("duplicate_gpu", cause, fix, log.evidence(found))


# --- The GPU is busy or unavailable (exclusive compute mode) -------------------------------
# RuntimeError: CUDA error: CUDA-capable device(s) is/are busy or unavailable
# (older CUDA: "all CUDA-capable devices are busy or unavailable")
_GPU_BUSY = rx(r"CUDA-capable device\(s\) is/are busy or unavailable|all CUDA-capable devices are busy or "
               r"unavailable", "busy or unavailable")


def gpu_busy(log: Log) -> Diagnosis | None:
    found = log.find(_GPU_BUSY)
    if not found:
        return None
    ranks = log.ranks(found)
    cause = ("CUDA could not open the GPU" + (f" on {ranks_text(ranks)}" if ranks else "")
             + ": it is in exclusive compute mode and another process already holds it (another job, a stale "
             "worker of an earlier run, or a second rank on the same GPU), or it is unavailable")
    fix = ("check `nvidia-smi` for the processes on that GPU and `nvidia-smi -q -d COMPUTE` for its compute mode; "
           "end leftovers, choose free GPUs (duoka train --gpus auto:N), make sure each rank uses its own GPU, or "
           "ask an administrator for the Default compute mode (nvidia-smi -c DEFAULT)")
    return Diagnosis("gpu_busy", cause, fix, log.evidence(found))


# --- /dev/shm is too small (NCCL, DataLoader workers) --------------------------------------
# NCCL 2.19+: "node0:1234:5678 [1] misc/shmutils.cc:72 NCCL WARN Error: failed to extend /dev/shm/nccl-vzIpS6 to
#   9637892 bytes"  (and "..., error: No space left on device (28)")
SHM_EXTEND = re.compile(r"failed to extend (/dev/shm/\S+?) to (\d+) bytes")
# The line after it, also the "Last error:" of the "unhandled system error" that follows:
#   "Error while creating shared memory segment /dev/shm/nccl-vzIpS6 (size 9637888)"
#   (NCCL <= 2.10 names it "nccl-shm-recv-1462445a6f01cbfc-1-2-3" after "NCCL WARN Call to posix_fallocate
#   failed : No space left on device"). After "NCCL WARN Cuda failure 'invalid argument'" the same line is a
#   CUDA problem, not a full /dev/shm.
SHM_CREATE = re.compile(r"Error while creating shared memory segment (\S+) \(size (\d+)\)")
_CUDA_FAILURE = re.compile(r"Cuda failure '")
# PyTorch DataLoader workers:
#   "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm)."
#   "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's
#   workers are out of shared memory. Please try to raise your shared memory limit."
#   "RuntimeError: unable to write to file </torch_4242_1954506624_0>: No space left on device (28)"
_SHM_DATALOADER = rx(r"insufficient shared memory \(shm\)|DataLoader worker \(pid \d+\) is killed by signal: "
                     r"Bus error|unable to write to file </torch_\w+>", "insufficient shared memory",
                     "killed by signal: bus error", "</torch_")
# torchrun's summary of a worker killed by SIGBUS: "traceback : Signal 7 (SIGBUS) received by PID 4242"
_SIGBUS = re.compile(r"Signal 7 \(SIGBUS\) received by PID (\d+)")
# errno 28 (ENOSPC): "No space left on device"; it is /dev/shm when shm or an NCCL warning is in the lines
# around it (not NCCL INFO lines, which NCCL_DEBUG=INFO prints everywhere).
NO_SPACE = re.compile(r"No space left on device")
# Older NCCL: "include/shm.h:28 NCCL WARN Call to posix_fallocate failed : No space left on device"
_SHM_CONTEXT = re.compile(r"/dev/shm|\bshm\b|shared memory|</torch_|NCCL WARN|posix_fallocate|ncclSystemError")


def _no_space_lines(log: Log) -> tuple[list[re.Match], list[re.Match]]:
    """ENOSPC errors split into those about shared memory and those about a disk."""
    shm, disk = [], []
    for m in log.find(NO_SPACE):
        (shm if _SHM_CONTEXT.search(log.around(m, 3, 3)) else disk).append(m)
    return shm, disk


def shm(log: Log) -> Diagnosis | None:
    shm_enospc, _ = _no_space_lines(log)
    nccl = [m for m in log.find(SHM_EXTEND, SHM_CREATE)
            if m.re is SHM_EXTEND or not _CUDA_FAILURE.search(log.around(m, 3, 0))]
    loader = log.find(_SHM_DATALOADER)
    sigbus = log.find(_SIGBUS)
    found = sorted(nccl + loader + shm_enospc + sigbus, key=lambda m: m.start())
    if not found:
        return None
    if nccl:
        size = int(nccl[0].group(2))
        where = nccl[0].group(1).rstrip(",")
        who = (f"NCCL could not create its {human_size(size)} intra-node buffer {where}: /dev/shm is full or too small")
    elif loader:
        who = "DataLoader workers could not pass batches through /dev/shm: it is full or too small"
    elif shm_enospc:
        who = "shared memory (/dev/shm) ran out of space"
    else:
        who = ("a worker died of SIGBUS, which in containers is most often a /dev/shm too small for NCCL's or the "
               "DataLoader's shared buffers")
    cause = who + ". Docker gives a container 64 MB of /dev/shm unless told otherwise"
    fix = ("give the container more shared memory: docker run --shm-size=16g (or --ipc=host); on Kubernetes mount "
           "an emptyDir with medium: Memory at /dev/shm; on a host, sudo mount -o remount,size=16G /dev/shm; check "
           "with `df -h /dev/shm`. As a slower last resort NCCL_SHM_DISABLE=1 sends intra-node traffic another way")
    return Diagnosis("shm", cause, fix, log.evidence(found))


# --- A disk is full ----------------------------------------------------------------------
# OSError: [Errno 28] No space left on device: 'runs/a/checkpoints/step-1000/__0_0.distcp'
_ERRNO28_PATH = re.compile(r"\[Errno 28\] No space left on device: '([^']+)'")


def disk_full(log: Log) -> Diagnosis | None:
    _, disk = _no_space_lines(log)
    if not disk:
        return None
    path = None
    for m in disk:
        p = _ERRNO28_PATH.search(log.line(m))
        if p:
            path = p.group(1)
            break
    folder = path.rsplit("/", 1)[0] if path and "/" in path else ""
    cause = ("a disk is full" + (f": writing {path} failed" if path else "")
             + " (checkpoints are large: a resumable one holds fp32 weights and two AdamW moments, 12 bytes per "
             "parameter, about 90 GB for a 7B model)")
    fix = ("free space or write to a larger disk: check `df -h" + (f" {folder}" if folder else "") + "`"
           + ", point job.output_dir elsewhere, keep fewer checkpoints (checkpoint.keep, checkpoint.interval), "
           "and delete old runs; then continue with --checkpoint.resume=auto")
    return Diagnosis("disk_full", cause, fix, log.evidence(disk))

