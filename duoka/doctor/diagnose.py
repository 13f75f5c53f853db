"""Explain a failed run's log: name each known failure in it, its cause and its fix.

`explain(text)` reads what a failed job printed (the stderr of torchrun or `duoka train`,
Python tracebacks, NCCL_DEBUG output, dmesg or nvidia-smi lines pasted in) and returns one
`Diagnosis` per kind of failure it recognises, root causes first: when one rank runs out
of memory the others later hit the NCCL watchdog timeout, and the out-of-memory error is
the one to fix, so it comes first and the timeout says that it follows from it.

The patterns are the real messages of PyTorch 2.x, NCCL, the NVIDIA driver and duoka
itself, and they are matched strictly: a log that merely talks about memory is no
out-of-memory error. A log with nothing known in it gives [].
"""

from __future__ import annotations

import bisect
import functools
import math
import re
from dataclasses import dataclass, replace

EVIDENCE_CHARS = 300  # the evidence is a quote, not the log


@dataclass(frozen=True)
class Diagnosis:
    kind: str  # a stable name: "cuda_oom", "nccl_timeout", ...
    cause: str  # what happened, with the numbers the log gives
    fix: str  # what to do
    evidence: str  # the matching log line(s), trimmed to about EVIDENCE_CHARS


# ---------------------------------------------------------------------------------------
# The log
# ---------------------------------------------------------------------------------------

# Colour codes (rich, tqdm) would split the words the patterns look for.
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
# torchrun's per-rank prefix "[rank1]:" (torch >= 2.2), the older --tee prefix "[default1]:",
# the process-group tag "[PG ID 0 PG GUID 0(default_pg) Rank 1]" / "[Rank 1]", and duoka's
# "... on rank 1".
_RANK_PREFIX = re.compile(r"^[ \t]*\[(?:rank|default)(\d+)\]:", re.MULTILINE)
_RANK_TAG = re.compile(r"\bRank (\d+)\]")
_RANK_WORDS = re.compile(r"\bon rank (\d+)\b")


_NEEDLES: dict[re.Pattern, tuple[str, ...]] = {}


def _rx(pattern: str, *needles: str, flags: int = 0) -> re.Pattern:
    """A compiled pattern with its needles: lower-case words of which every match contains
    one. A log without any of them skips the pattern, which keeps a pattern that does not
    start with a literal (an alternation, \\S+, IGNORECASE) from crawling through a large log."""
    compiled = re.compile(pattern, flags)
    _NEEDLES[compiled] = needles
    return compiled


class _Log:
    """The text with its lines, and where each match sits."""

    def __init__(self, text: str):
        text = _ANSI.sub("", text).replace("\r\n", "\n").replace("\r", "\n")
        self.text = text
        self.lines = text.split("\n")
        self.starts = []
        pos = 0
        for line in self.lines:
            self.starts.append(pos)
            pos += len(line) + 1

    @functools.cached_property
    def lower(self) -> str:
        return self.text.lower()

    def find(self, *patterns: re.Pattern) -> list[re.Match]:
        """Every match of the patterns, in the order they appear in the log."""
        out = [m for p in patterns if self._may_match(p) for m in p.finditer(self.text)]
        return sorted(out, key=lambda m: m.start())

    def _may_match(self, pattern: re.Pattern) -> bool:
        needles = _NEEDLES.get(pattern)
        return not needles or any(n in self.lower for n in needles)

    def line_no(self, m: re.Match | int) -> int:
        pos = m if isinstance(m, int) else m.start()
        return bisect.bisect_right(self.starts, pos) - 1

    def line(self, m: re.Match | int) -> str:
        return self.lines[self.line_no(m)]

    def around(self, m: re.Match, before: int, after: int) -> str:
        i = self.line_no(m)
        return "\n".join(self.lines[max(0, i - before):i + after + 1])

    def rank(self, m: re.Match) -> int | None:
        line = self.line(m)
        for p in (_RANK_PREFIX, _RANK_TAG, _RANK_WORDS):
            r = p.search(line)
            if r:
                return int(r.group(1))
        return None

    def ranks(self, matches: list[re.Match]) -> list[int]:
        return sorted({r for r in (self.rank(m) for m in matches) if r is not None})

    def all_ranks(self) -> set[int]:
        return {int(m.group(1)) for m in _RANK_PREFIX.finditer(self.text)}

    def evidence(self, matches: list[re.Match], most: int = 3) -> str:
        seen: list[int] = []
        for m in matches:
            i = self.line_no(m)
            if i not in seen:
                seen.append(i)
            if len(seen) == most:
                break
        text = "\n".join(" ".join(self.lines[i].split()) for i in seen)
        return text if len(text) <= EVIDENCE_CHARS else text[:EVIDENCE_CHARS - 3].rstrip() + "..."


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 8:
        return "ranks " + ", ".join(map(str, ranks[:6])) + f", ... ({len(ranks)} in all)"
    return "ranks " + ", ".join(map(str, ranks[:-1])) + f" and {ranks[-1]}"


_UNITS = {"bytes": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def _bytes(size: str) -> float:
    number, unit = size.split()
    return float(number) * _UNITS[unit]


def _human(n: float) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.1f} {unit}"
    return f"{n:.0f} bytes"


# ---------------------------------------------------------------------------------------
# The failures, one detector each. Each returns a Diagnosis or None.
# ---------------------------------------------------------------------------------------

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


def _driver_too_old(log: _Log) -> Diagnosis | None:
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
_NVML_MISMATCH = _rx(r"Driver/library version mismatch|NVML library version mismatch|NVML/RM version mismatch|"
                     r"NVMLError_LibRmVersionMismatch", "version mismatch", "versionmismatch")
_NVML_LIB_VERSION = re.compile(r"NVML library version: (\d+(?:\.\d+)+)")
# dmesg: "NVRM: API mismatch: the client has the version 535.129.03, but
#         NVRM: this kernel module has the version 535.104.05.  Please make sure that this ..."
_NVRM_CLIENT = re.compile(r"NVRM: API mismatch: the client has the version (\d+(?:\.\d+)+)")
_NVRM_MODULE = re.compile(r"this kernel module has the version (\d+(?:\.\d+)+)")
# UserWarning: CUDA initialization: Unexpected error from cudaGetDeviceCount(). ... Error 803: system has
#   unsupported display driver / cuda driver combination
_CUDA_803 = re.compile(r"system has unsupported display driver / cuda driver combination")


def _driver_mismatch(log: _Log) -> Diagnosis | None:
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
_GPU_LOST = _rx(r"GPU has fallen off the bus|GPU is lost\b", "fallen off the bus", "gpu is lost")
# Xids that point to the hardware (NVIDIA's Xid catalog): 48 double-bit ECC, 61/62 internal micro-controller,
# 63/64 ECC page retirement / row remapping, 74 NVLink, 79 fallen off the bus, 92 high single-bit ECC rate,
# 94/95 contained/uncontained ECC, 119/120 GSP. Others (13, 31, 43, 45) usually come from the program.
_HARDWARE_XIDS = {48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120}


def _gpu_hardware(log: _Log) -> Diagnosis | None:
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
_ADDR_IN_USE = _rx(r"Address already in use|EADDRINUSE|The server socket has failed to listen on any local "
                   r"network address", "address already in use", "eaddrinuse", "failed to listen on any",
                   flags=re.IGNORECASE)
_BIND_PORT = re.compile(r"failed to (?:bind to|listen on) \S*?:(\d+)|\bport: (\d+), useIpv6")
# duoka: "error: rendezvous port 29500 on node0 is already in use (another job, or a stale one)"
_DUOKA_PORT = re.compile(r"rendezvous port (\d+) on (\S+) is already in use")
# Which server it was: PyTorch's store ("[c10d]", DistNetworkError, socket.cpp) or duoka's Prometheus endpoint
# (a traceback through prometheus_client's start_http_server).
_C10D_SERVER = re.compile(r"c10d|DistNetworkError|socket\.cpp|server socket|rendezvous|MASTER_PORT", re.IGNORECASE)
_METRICS_SERVER = re.compile(r"start_http_server|prometheus", re.IGNORECASE)


def _port_in_use(log: _Log) -> Diagnosis | None:
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
_RDZV_CONNECTION = _rx(r"RendezvousConnectionError|The connection to the C10d store has failed",
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


def _rendezvous(log: _Log) -> Diagnosis | None:
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
_HEADS_TP = _rx(r"(?:num_attention_heads|attention heads|query heads|num_heads|n_heads) ?\((\d+)\) " + _TP_WORDS,
                "divisible by", "multiple of", flags=re.IGNORECASE)
_KV_HEADS_TP = _rx(r"(?:num_key_value_heads|KV heads|key[- ]value heads|n_kv_heads) ?\((\d+)\) " + _TP_WORDS,
                   "divisible by", "multiple of", flags=re.IGNORECASE)
# config.json printed in the log: "num_attention_heads": 28, "num_key_value_heads": 4
_HEADS_FIELD = re.compile(r"\"?\b(?:num_attention_heads|n_heads)\"?\s*[:=]\s*(\d+)")
_KV_FIELD = re.compile(r"\"?\b(?:num_key_value_heads|n_kv_heads)\"?\s*[:=]\s*(\d+)")


def _tp_heads(log: _Log) -> Diagnosis | None:
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
_DUOKA_NO_TOKENIZER = _rx(r"(\S+) has no tokenizer\.json", "has no tokenizer.json")
# duoka (launcher.py): "error: model.flavor=qwen2-7b has no tokenizer to read data.path with"
_DUOKA_FLAVOR_TOKENIZER = re.compile(r"model\.flavor=(\S+) has no tokenizer to read data\.path with")
# transformers: "OSError: Can't load tokenizer for 'Qwen/Qwen2-7B'. If you were trying to load it from
#   'https://huggingface.co/models', make sure you don't have a local directory with the same name. ..."
_CANT_LOAD_TOKENIZER = re.compile(r"Can't load tokenizer for '([^']+)'")
# transformers / huggingface_hub: "OSError: /models/x does not appear to have a file named tokenizer.json.
#   Checkout 'https://huggingface.co//models/x/tree/None' for available files."
_NO_FILE_NAMED = _rx(r"(\S+) does not appear to have a file named (tokenizer\.json|tokenizer_config\.json|"
                     r"vocab\.json|merges\.txt|tokenizer\.model)", "does not appear to have a file named")
_TOKENIZER_NOT_FOUND = _rx(r"tokenizer(?:\.json|_config\.json)? (?:file )?not found", "not found",
                           flags=re.IGNORECASE)


def _tokenizer_missing(log: _Log) -> Diagnosis | None:
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
_INVALID_ORDINAL = _rx(r"invalid device ordinal|AssertionError: Invalid device id", "invalid device ordinal",
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


def _gpu_order(log: _Log) -> Diagnosis | None:
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
        facts.append(f"failing on {_ranks_text(ranks)}")
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
_DUPLICATE_GPU = re.compile(r"Duplicate GPU detected ?: rank (\d+) and rank (\d+) both on CUDA device (\w+)")


def _duplicate_gpu(log: _Log) -> Diagnosis | None:
    found = log.find(_DUPLICATE_GPU)
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
_GPU_BUSY = _rx(r"CUDA-capable device\(s\) is/are busy or unavailable|all CUDA-capable devices are busy or "
                r"unavailable", "busy or unavailable")


def _gpu_busy(log: _Log) -> Diagnosis | None:
    found = log.find(_GPU_BUSY)
    if not found:
        return None
    ranks = log.ranks(found)
    cause = ("CUDA could not open the GPU" + (f" on {_ranks_text(ranks)}" if ranks else "")
             + ": it is in exclusive compute mode and another process already holds it (another job, a stale "
             "worker of an earlier run, or a second rank on the same GPU), or it is unavailable")
    fix = ("check `nvidia-smi` for the processes on that GPU and `nvidia-smi -q -d COMPUTE` for its compute mode; "
           "end leftovers, choose free GPUs (duoka train --gpus auto:N), make sure each rank uses its own GPU, or "
           "ask an administrator for the Default compute mode (nvidia-smi -c DEFAULT)")
    return Diagnosis("gpu_busy", cause, fix, log.evidence(found))


# --- /dev/shm is too small (NCCL, DataLoader workers) --------------------------------------
# NCCL 2.19+: "node0:1234:5678 [1] misc/shmutils.cc:72 NCCL WARN Error: failed to extend /dev/shm/nccl-vzIpS6 to
#   9637892 bytes"  (and "..., error: No space left on device (28)")
_SHM_EXTEND = re.compile(r"failed to extend (/dev/shm/\S+?) to (\d+) bytes")
# The line after it, also the "Last error:" of the "unhandled system error" that follows:
#   "Error while creating shared memory segment /dev/shm/nccl-vzIpS6 (size 9637888)"
#   (NCCL <= 2.10 names it "nccl-shm-recv-1462445a6f01cbfc-1-2-3" after "NCCL WARN Call to posix_fallocate
#   failed : No space left on device"). After "NCCL WARN Cuda failure 'invalid argument'" the same line is a
#   CUDA problem, not a full /dev/shm.
_SHM_CREATE = re.compile(r"Error while creating shared memory segment (\S+) \(size (\d+)\)")
_CUDA_FAILURE = re.compile(r"Cuda failure '")
# PyTorch DataLoader workers:
#   "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared memory (shm)."
#   "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Bus error. It is possible that dataloader's
#   workers are out of shared memory. Please try to raise your shared memory limit."
#   "RuntimeError: unable to write to file </torch_4242_1954506624_0>: No space left on device (28)"
_SHM_DATALOADER = _rx(r"insufficient shared memory \(shm\)|DataLoader worker \(pid \d+\) is killed by signal: "
                      r"Bus error|unable to write to file </torch_\w+>", "insufficient shared memory",
                      "killed by signal: bus error", "</torch_")
# torchrun's summary of a worker killed by SIGBUS: "traceback : Signal 7 (SIGBUS) received by PID 4242"
_SIGBUS = re.compile(r"Signal 7 \(SIGBUS\) received by PID (\d+)")
# errno 28 (ENOSPC): "No space left on device"; it is /dev/shm when shm or an NCCL warning is in the lines
# around it (not NCCL INFO lines, which NCCL_DEBUG=INFO prints everywhere).
_NO_SPACE = re.compile(r"No space left on device")
# Older NCCL: "include/shm.h:28 NCCL WARN Call to posix_fallocate failed : No space left on device"
_SHM_CONTEXT = re.compile(r"/dev/shm|\bshm\b|shared memory|</torch_|NCCL WARN|posix_fallocate|ncclSystemError")


def _no_space_lines(log: _Log) -> tuple[list[re.Match], list[re.Match]]:
    """ENOSPC errors split into those about shared memory and those about a disk."""
    shm, disk = [], []
    for m in log.find(_NO_SPACE):
        (shm if _SHM_CONTEXT.search(log.around(m, 3, 3)) else disk).append(m)
    return shm, disk


def _shm(log: _Log) -> Diagnosis | None:
    shm_enospc, _ = _no_space_lines(log)
    nccl = [m for m in log.find(_SHM_EXTEND, _SHM_CREATE)
            if m.re is _SHM_EXTEND or not _CUDA_FAILURE.search(log.around(m, 3, 0))]
    loader = log.find(_SHM_DATALOADER)
    sigbus = log.find(_SIGBUS)
    found = sorted(nccl + loader + shm_enospc + sigbus, key=lambda m: m.start())
    if not found:
        return None
    if nccl:
        size = int(nccl[0].group(2))
        where = nccl[0].group(1).rstrip(",")
        who = (f"NCCL could not create its {_human(size)} intra-node buffer {where}: /dev/shm is full or too small")
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


def _disk_full(log: _Log) -> Diagnosis | None:
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
_OOM_ANY = _rx(r"(?:CUDA|HIP) out of memory|CUDA error: out of memory|Cuda failure 'out of memory'|"
               r"CUBLAS_STATUS_ALLOC_FAILED", "out of memory", "cublas_status_alloc_failed")
# duoka's worker (train/worker.py): "CUDA out of memory on rank 1 (micro-batch 8, seq_len 4096)"
_DUOKA_OOM = re.compile(r"CUDA out of memory on rank (\d+) \(micro-batch (\w+), seq_len (\d+)\)")


def _cuda_oom(log: _Log) -> Diagnosis | None:
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
            fragmented = (split.group(2), _fragmented(_bytes(split.group(2)), _bytes(want)))
    elif old:
        want, gpu, total, allocated, free, reserved = old.groups()
        facts.append(f"it tried to allocate {want} on GPU {gpu}, which has {total} in total of which {free} was free; "
                     f"PyTorch had {allocated} allocated and {reserved} reserved")
        gap = _bytes(reserved) - _bytes(allocated)
        if gap > 0:
            fragmented = (_human(gap), _fragmented(gap, _bytes(want)))
    duoka = _DUOKA_OOM.search(log.text)
    if duoka:
        facts.append(f"micro-batch {duoka.group(2)}, seq_len {duoka.group(3)}")
        ranks = sorted(set(ranks) | {int(duoka.group(1))})
    who = _ranks_text(ranks) if ranks else "a process"
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


def _root_cause(log: _Log) -> tuple[int, int] | None:
    """torchrun's "Root Cause (first observed failure)": (rank, exit code)."""
    m = _ROOT_CAUSE.search(log.text)
    if not m:
        return None
    block = log.around(m, 0, 8)
    r, e = _FIELD_RANK.search(block), _FIELD_EXIT.search(block)
    return (int(r.group(1)), int(e.group(1))) if r and e else None


def _host_oom(log: _Log) -> Diagnosis | None:
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


def _device_assert(log: _Log) -> Diagnosis | None:
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


def _device_mismatch(log: _Log) -> Diagnosis | None:
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
_NCCL_CODE = _rx(r"nccl(UnhandledCudaError|SystemError|InternalError|RemoteError|InvalidUsage)\b",
                 "ncclunhandledcudaerror", "ncclsystemerror", "ncclinternalerror", "ncclremoteerror",
                 "ncclinvalidusage")
_LAST_ERROR = re.compile(r"Last error:\s*\n(?:\s*\[(?:rank|default)\d+\]:)?\s*([^\n]+)")


def _nccl_error(log: _Log) -> Diagnosis | None:
    found = log.find(_NCCL_ERROR, _NCCL_CODE)
    if not found:
        return None
    head = next((m for m in found if m.re is _NCCL_ERROR), None)
    window = log.text[found[0].start():found[0].start() + 2000]
    last = _LAST_ERROR.search(window)
    last_text = last.group(1).strip() if last else ""
    # Failures another detector explains better: the same event, not a second one.
    if any(p.search(last_text) for p in (_NO_SPACE, _OOM_ANY, _DUPLICATE_GPU)):
        return None
    if any(p.search(last_text) for p in (_SHM_CREATE, _SHM_EXTEND)) and _shm(log) is not None:
        return None
    code = head.group(1) if head else {"UnhandledCudaError": "unhandled cuda error", "SystemError": "unhandled "
                                       "system error", "InternalError": "internal error", "RemoteError": "remote "
                                       "process exited or there was a network error",
                                       "InvalidUsage": "invalid usage"}[found[0].group(1)]
    version = head.group(2) if head and head.group(2) else None
    ranks = log.ranks(found)
    cause = (f"NCCL failed with '{code}'" + (f" (NCCL {version})" if version else "")
             + (f" on {_ranks_text(ranks)}" if ranks else "") + (f"; last error: {last_text}" if last_text else ""))
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
_NCCL_TIMEOUT = _rx(r"\bNCCL timeout\b", "nccl timeout", flags=re.IGNORECASE)
# gloo (CPU processes): "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out
#   waiting 1800000ms for recv operation to complete"
_GLOO_TIMEOUT = re.compile(r"Timed out waiting (\d+)ms for (send|recv) operation to complete")


def _nccl_timeout(log: _Log) -> Diagnosis | None:
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
        facts.append(f"{_ranks_text(timed)} timed out waiting")
        silent = sorted(log.all_ranks() - set(timed))
        if silent:
            facts.append(f"{_ranks_text(silent)} reported no timeout: look there first")
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


# ---------------------------------------------------------------------------------------
# Ordering
# ---------------------------------------------------------------------------------------

# Most important first: what stops everything (driver, hardware), what stops the start
# (ports, rendezvous, config, files, devices), what kills one rank (memory, asserts), and
# last what follows from a dead rank (NCCL errors and timeouts on the others).
_DETECTORS = (
    _driver_too_old, _driver_mismatch, _gpu_hardware,
    _port_in_use, _rendezvous, _tp_heads, _tokenizer_missing,
    _gpu_order, _duplicate_gpu, _gpu_busy, _shm, _disk_full,
    _cuda_oom, _host_oom, _device_assert, _device_mismatch,
    _nccl_error, _nccl_timeout,
)
# Failures that are usually the consequence of another rank's failure.
_CONSEQUENCES = {"nccl_error", "nccl_timeout"}


def explain(text: str) -> list[Diagnosis]:
    """The known failures in a log, one Diagnosis per kind, root causes first; [] when
    nothing known is in it."""
    log = _Log(text)
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
