"""`duoka doctor`'s checks: is this machine fit for multi-GPU training, and if not, why and
what to do. Each check is a function of plain facts (gathered from the real system by
`gather`, or written by hand in tests) returning Results: PASS, WARN or FAIL with the
reason and the fix. Nothing here needs a GPU to run: without one the report says CPU
mode plainly.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from duoka.errors import DuokaError
from duoka.host.ports import port_is_free
from duoka.monitor.gpu import decode_clock_reasons, load_nvml, nvml_text
from duoka.plan.hardware import Hardware
from duoka.plan.model_choice import resolve_model
from duoka.plan.ranking import make_plan

PASS, WARN, FAIL, INFO = "PASS", "WARN", "FAIL", "INFO"
GIB = 2**30

# NCCL / PyTorch variables that are legitimate for debugging but slow or fragile when left on.
RISKY_ENV = {
    "NCCL_P2P_DISABLE": ("1", "turns off direct GPU-to-GPU copies (NVLink/PCIe P2P): collectives go through host "
                              "memory, several times slower", "unset NCCL_P2P_DISABLE"),
    "NCCL_IB_DISABLE": ("1", "turns off InfiniBand: multi-node traffic falls back to TCP sockets",
                        "unset NCCL_IB_DISABLE unless this machine has no working InfiniBand"),
    "NCCL_SHM_DISABLE": ("1", "turns off shared-memory transport between processes of one node",
                         "unset NCCL_SHM_DISABLE (give /dev/shm enough space instead)"),
    "NCCL_DEBUG": ("INFO|TRACE", "prints per-call logs: noisy and slower", "unset NCCL_DEBUG (or WARN) after debugging"),
    "NCCL_DEBUG_SUBSYS": ("*", "adds debug output", "unset NCCL_DEBUG_SUBSYS after debugging"),
    "TORCH_NCCL_BLOCKING_WAIT": ("1", "makes every collective wait on the host: hides overlap",
                                 "unset TORCH_NCCL_BLOCKING_WAIT"),
    "CUDA_LAUNCH_BLOCKING": ("1", "serialises every kernel launch: training runs many times slower",
                             "unset CUDA_LAUNCH_BLOCKING after debugging"),
    "TORCH_DISTRIBUTED_DEBUG": ("DETAIL", "checks every collective: slower", "unset TORCH_DISTRIBUTED_DEBUG"),
}


@dataclass
class Result:
    check: str
    status: str
    detail: str
    fix: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class GpuFacts:
    index: int
    name: str
    uuid: str
    capability: tuple[int, int] | None
    memory_total: int
    memory_used: int
    processes: list[tuple[int, str, int]] = field(default_factory=list)  # pid, name, bytes
    temperature_c: int | None = None
    clock_reasons: list[str] = field(default_factory=list)
    ecc_uncorrected: int | None = None
    retired_pages_pending: bool | None = None


@dataclass
class Facts:
    python: tuple[int, int, int]
    torch_version: str
    torch_cuda: str | None  # the CUDA version PyTorch was built with; None for a CPU build
    driver_version: str | None
    driver_cuda: tuple[int, int] | None  # the newest CUDA the driver supports
    nccl_version: str | None
    gpus: list[GpuFacts]
    links: dict[tuple[int, int], str] = field(default_factory=dict)  # (i, j) -> "NVLink x18" / "PCIe (same switch)"
    p2p: dict[tuple[int, int], bool] = field(default_factory=dict)
    cpu_cores: int = 1
    ram_bytes: int = 0
    shm_bytes: int | None = None
    infiniband: list[tuple[str, str, str]] = field(default_factory=list)  # device/port, state, rate
    env: dict[str, str] = field(default_factory=dict)
    port: int = 29500
    port_free: bool = True
    disk_path: str = "."
    disk_free: int = 0


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split("+")[0].split(".")[:2] if x.isdigit())


def check_python_torch(f: Facts) -> list[Result]:
    out = []
    if f.python < (3, 10):
        out.append(Result("python", FAIL, f"Python {'.'.join(map(str, f.python))}", "use Python 3.10 or newer"))
    else:
        out.append(Result("python", PASS, f"Python {'.'.join(map(str, f.python))}"))
    if _version_tuple(f.torch_version) < (2, 11):
        out.append(Result("pytorch", FAIL, f"PyTorch {f.torch_version}; duoka needs 2.11+ (FSDP2, DTensor, "
                                           "pipelining APIs)", "pip install 'torch>=2.11'"))
    elif f.gpus and f.torch_cuda is None:
        out.append(Result("pytorch", FAIL, f"PyTorch {f.torch_version} is a CPU build on a machine with "
                                           f"{len(f.gpus)} GPU(s)",
                          "install a CUDA build: pip install torch --index-url https://download.pytorch.org/whl/cu128 "
                          "(pick the CUDA version your driver supports)"))
    elif f.torch_cuda and f.driver_cuda and _version_tuple(f.torch_cuda) > f.driver_cuda:
        out.append(Result("pytorch", FAIL, f"PyTorch {f.torch_version} is built for CUDA {f.torch_cuda}, the driver "
                                           f"{f.driver_version} supports CUDA up to "
                                           f"{f.driver_cuda[0]}.{f.driver_cuda[1]}",
                          "update the NVIDIA driver, or install a PyTorch build for an older CUDA"))
    else:
        cuda = f"CUDA {f.torch_cuda}, driver {f.driver_version}" if f.torch_cuda else "CPU build"
        out.append(Result("pytorch", PASS, f"PyTorch {f.torch_version} ({cuda})"))
    return out


def check_gpus(f: Facts) -> list[Result]:
    if not f.gpus:
        return [Result("gpus", INFO, "no NVIDIA GPU found: CPU mode (training runs as CPU processes over gloo; "
                                     "fine for tests and small models, not for speed)",
                       "on a GPU machine, check `nvidia-smi` and the driver if GPUs are expected")]
    out = []
    names = sorted({g.name for g in f.gpus})
    out.append(Result("gpus", PASS if len(names) == 1 else WARN,
                      f"{len(f.gpus)} x {', '.join(names)}",
                      "" if len(names) == 1 else "mixed GPU models run at the slowest one's pace: use "
                                                 "--parallel.balance=auto or select one model with --gpus"))
    for g in f.gpus:
        tag = f"gpu {g.index}"
        if g.capability and g.capability < (8, 0):
            out.append(Result(tag, WARN, f"{g.name} has compute capability {g.capability[0]}.{g.capability[1]}: "
                                         "no bf16 tensor cores", "train with --training.dtype=fp32 (slow) or use "
                                                                 "an Ampere or newer GPU"))
        if g.processes:
            procs = ", ".join(f"{name} (pid {pid}, {mem / GIB:.1f} GiB)" for pid, name, mem in g.processes)
            out.append(Result(tag, WARN, f"busy: {procs}; {g.memory_used / GIB:.1f} of "
                                         f"{g.memory_total / GIB:.0f} GiB in use",
                              "stop those processes or pick free GPUs: duoka train --gpus auto:N"))
        if g.ecc_uncorrected:
            out.append(Result(tag, FAIL, f"{g.ecc_uncorrected} uncorrected ECC errors",
                              "drain this GPU and have it checked (nvidia-smi -q -d ECC); a reset may clear "
                              "volatile counts"))
        if g.retired_pages_pending:
            out.append(Result(tag, WARN, "retired memory pages pending", "reboot or reset the GPU to retire them"))
        throttled = [r for r in g.clock_reasons if r not in ("idle", "application clocks setting", "sync boost",
                                                             "display clock setting")]
        if throttled:
            out.append(Result(tag, WARN, f"clocks held back: {', '.join(throttled)} at {g.temperature_c} C",
                              "check cooling and power limits (nvidia-smi -q -d PERFORMANCE,POWER)"))
        elif g.temperature_c is not None and g.temperature_c >= 85:
            out.append(Result(tag, WARN, f"{g.temperature_c} C while idle or light", "check the cooling"))
    if len(out) == 1:
        out[0].detail += "; all idle, no errors, no throttling"
    return out


def check_memory_for(model: str | None, n_gpus: int, gpu_memory: float | None,
                     interconnect: str = "nvlink") -> list[Result]:
    """Whether `model` can train on these GPUs at all, through the planner."""
    if model is None:
        return []
    if not n_gpus or not gpu_memory:
        return [Result("memory", INFO, f"{model}: no GPUs here to plan for",
                       f"duoka plan --model {model} --gpus N --gpu-memory GiB plans for a target machine")]
    try:
        plan = make_plan(resolve_model(model), Hardware(gpus=n_gpus, nodes=1, gpu_memory_gib=gpu_memory,
                                                        interconnect=interconnect))
    except DuokaError as e:
        return [Result("memory", FAIL, f"{model} on {n_gpus} x {gpu_memory:.0f} GiB: {e.cause}", e.fix or "")]
    best = plan.best
    return [Result("memory", PASS, f"{model} fits on {n_gpus} x {gpu_memory:.0f} GiB: {best.describe()}, "
                                   f"{best.memory.allocated / GIB:.1f} GiB per GPU (duoka plan for the ranking)")]


def check_host(f: Facts) -> list[Result]:
    out = []
    if not f.gpus:
        out.append(Result("cpu", INFO, f"{f.cpu_cores} cores, {f.ram_bytes / GIB:.0f} GiB RAM (CPU mode)"))
    n = max(1, len(f.gpus))
    cores, ram = f.cpu_cores / n, f.ram_bytes / n
    status = PASS if cores >= 4 else WARN
    if f.gpus:
        out.append(Result("cpu", status, f"{f.cpu_cores} cores, {cores:.0f} per GPU",
                          "" if status == PASS else "data loading and kernel launches need CPU time: 4+ cores per "
                                                    "GPU"))
        status = PASS if ram >= 64 * GIB else WARN
        out.append(Result("ram", status, f"{f.ram_bytes / GIB:.0f} GiB, {ram / GIB:.0f} GiB per GPU",
                          "" if status == PASS else "checkpoint staging and data need host memory: 64+ GiB per GPU "
                                                    "for 7B-class models"))
    if f.shm_bytes is not None:
        need = 1 * GIB if len(f.gpus) > 1 else 0
        if f.shm_bytes < need:
            out.append(Result("shm", FAIL, f"/dev/shm is {f.shm_bytes / 2**20:.0f} MiB: NCCL's shared-memory "
                                           "transport fails with 'No space left on device'",
                              "docker run --shm-size=16g (or --ipc=host); on a host, remount /dev/shm larger"))
        else:
            out.append(Result("shm", PASS, f"/dev/shm {f.shm_bytes / GIB:.1f} GiB"))
    return out


def check_interconnect(f: Facts) -> list[Result]:
    out = []
    if f.nccl_version:
        out.append(Result("nccl", PASS, f"NCCL {f.nccl_version}"))
    elif f.gpus:
        out.append(Result("nccl", FAIL, "PyTorch has no NCCL", "install a CUDA build of PyTorch (it bundles NCCL)"))
    for (i, j), kind in sorted(f.links.items()):
        p2p = f.p2p.get((i, j))
        if "NVLink" in kind and p2p is not False:
            out.append(Result(f"link {i}-{j}", PASS, kind + ("" if p2p is None else ", P2P")))
        else:
            out.append(Result(f"link {i}-{j}", WARN, f"{kind}{', no P2P access' if p2p is False else ''}: "
                                                     "collectives between these GPUs are slower",
                              "prefer GPUs joined by NVLink for tensor parallelism (nvidia-smi topo -m); "
                              "check ACS/IOMMU settings if P2P is off"))
    for name, state, rate in f.infiniband:
        ok = "ACTIVE" in state.upper()
        out.append(Result(f"ib {name}", PASS if ok else WARN, f"{state}, {rate}",
                          "" if ok else "bring the port up (ibstat) or exclude it with NCCL_IB_HCA"))
    return out


def check_env(f: Facts) -> list[Result]:
    out = []
    set_vars = {k: v for k, v in f.env.items() if k.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED"))}
    for key, (bad, why, fix) in RISKY_ENV.items():
        value = f.env.get(key)
        if value is not None and (bad == "*" or value.upper() in bad.split("|")):
            out.append(Result("env", WARN, f"{key}={value} {why}", fix))
    if set_vars and not out:
        out.append(Result("env", PASS, "set: " + ", ".join(f"{k}={v}" for k, v in sorted(set_vars.items()))))
    cvd, order = f.env.get("CUDA_VISIBLE_DEVICES"), f.env.get("CUDA_DEVICE_ORDER")
    if cvd is not None and order != "PCI_BUS_ID" and len({g.name for g in f.gpus}) > 1:
        out.append(Result("gpu order", WARN, f"CUDA_VISIBLE_DEVICES={cvd} without CUDA_DEVICE_ORDER=PCI_BUS_ID on "
                                             "mixed GPUs: CUDA counts the fastest first, nvidia-smi by bus, so the "
                                             "numbers name different cards",
                          "export CUDA_DEVICE_ORDER=PCI_BUS_ID (duoka train sets it for its workers)"))
    return out


def check_port_and_disk(f: Facts, checkpoint_bytes: int | None = None) -> list[Result]:
    out = [Result("port", PASS, f"rendezvous port {f.port} is free") if f.port_free else
           Result("port", FAIL, f"port {f.port} is in use: torchrun/duoka would fail with 'Address already in use'",
                  f"pick another with --rdzv-endpoint 127.0.0.1:PORT, or find the owner: ss -ltnp | grep {f.port}")]
    need = checkpoint_bytes or 0
    if need and f.disk_free < 2 * need:  # two checkpoints are kept by default
        out.append(Result("disk", FAIL if f.disk_free < need else WARN,
                          f"{f.disk_free / GIB:.0f} GiB free at {f.disk_path}; one checkpoint of this model needs "
                          f"{need / GIB:.0f} GiB and two are kept", "free space or set job.output_dir elsewhere"))
    else:
        out.append(Result("disk", PASS, f"{f.disk_free / GIB:.0f} GiB free at {f.disk_path}"))
    return out


def run_checks(f: Facts, model: str | None = None) -> list[Result]:
    gpu_memory = min((g.memory_total for g in f.gpus), default=0) / GIB or None
    checkpoint = None
    if model:
        try:  # fp32 weights + two AdamW moments per parameter
            checkpoint = resolve_model(model).args.num_params() * 12
        except DuokaError:
            checkpoint = None  # the memory check reports the unknown model
    nvlink = any("NVLink" in kind for kind in f.links.values()) or len(f.gpus) < 2
    return [*check_python_torch(f), *check_gpus(f),
            *check_memory_for(model, len(f.gpus), gpu_memory, "nvlink" if nvlink else "pcie"),
            *check_host(f), *check_interconnect(f), *check_env(f), *check_port_and_disk(f, checkpoint)]


def exit_code(results: list[Result]) -> int:
    statuses = {r.status for r in results}
    return 2 if FAIL in statuses else 1 if WARN in statuses else 0


# ------------------------------------------------------------------ the real system


def _infiniband() -> list[tuple[str, str, str]]:
    out = []
    for port in sorted(Path("/sys/class/infiniband").glob("*/ports/*")):
        read = lambda name: (port / name).read_text().strip() if (port / name).exists() else "?"  # noqa: E731
        out.append((f"{port.parts[-3]}/{port.name}", read("state"), read("rate")))
    return out


def gather(port: int = 29500, disk_path: str = ".") -> Facts:
    import torch


    nvml = load_nvml()
    gpus, links, p2p, driver, driver_cuda = [], {}, {}, None, None
    if nvml is not None:
        def maybe(fn, *a):
            try:
                return fn(*a)
            except Exception:
                return None

        driver = maybe(nvml.nvmlSystemGetDriverVersion)
        driver = driver.decode() if isinstance(driver, bytes) else driver
        v = maybe(nvml.nvmlSystemGetCudaDriverVersion)
        driver_cuda = (v // 1000, (v % 1000) // 10) if v else None
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        for i, h in enumerate(handles):
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            procs = maybe(nvml.nvmlDeviceGetComputeRunningProcesses, h) or []
            name = nvml.nvmlDeviceGetName(h)
            cap = maybe(nvml.nvmlDeviceGetCudaComputeCapability, h)
            reasons = maybe(getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None)
                            or nvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)
            ecc = maybe(nvml.nvmlDeviceGetTotalEccErrors, h, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                        nvml.NVML_VOLATILE_ECC)
            pending = maybe(nvml.nvmlDeviceGetRetiredPagesPendingStatus, h)
            uuid = nvml.nvmlDeviceGetUUID(h)
            gpus.append(GpuFacts(
                i, nvml_text(name), nvml_text(uuid),
                tuple(cap) if cap else None, int(mem.total), int(mem.used),
                [(p.pid, _process_name(p.pid), int(p.usedGpuMemory or 0)) for p in procs],
                maybe(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU), decode_clock_reasons(reasons),
                ecc, None if pending is None else bool(pending)))
        for i in range(len(handles)):
            for j in range(i + 1, len(handles)):
                links[(i, j)] = _link_kind(nvml, handles, i, j)
        if torch.cuda.is_available() and torch.cuda.device_count() == len(handles):
            for (i, j) in links:
                p2p[(i, j)] = torch.cuda.can_device_access_peer(i, j)
    shm = shutil.disk_usage("/dev/shm").total if Path("/dev/shm").exists() else None
    nccl = None
    if torch.cuda.is_available():
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return Facts(python=tuple(sys.version_info[:3]), torch_version=torch.__version__, torch_cuda=torch.version.cuda,
                 driver_version=driver, driver_cuda=driver_cuda, nccl_version=nccl, gpus=gpus, links=links, p2p=p2p,
                 cpu_cores=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
                 ram_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), shm_bytes=shm,
                 infiniband=_infiniband(), env=dict(os.environ), port=port,
                 port_free=port_is_free("0.0.0.0", port),
                 disk_path=str(Path(disk_path).resolve()), disk_free=shutil.disk_usage(disk_path).free)


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def _link_kind(nvml, handles, i: int, j: int) -> str:
    """NVLink (direct links to the peer, or through NVSwitch as on HGX boards) or the PCIe
    path between two GPUs. On an NVSwitch board every link ends at a switch, never at the
    peer GPU, so matching link ends against the peer's PCI address alone finds nothing
    there (it reported an H200 HGX pair as PCIe); NVML's P2P status over NVLink says it."""

    handle = handles[i]
    try:
        peer_pci = nvml_text(nvml.nvmlDeviceGetPciInfo(handles[j]).busId)
    except Exception:
        peer_pci = None
    direct = switched = 0
    switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        try:
            if not nvml.nvmlDeviceGetNvLinkState(handle, link):
                continue
        except Exception:  # no NVLink on this GPU, or past its last link
            break
        try:
            if nvml.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link) == switch_type:
                switched += 1
                continue
        except Exception:
            pass  # older drivers: fall back to the link's far end
        try:
            far_end = nvml_text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link).busId)
            if peer_pci is not None and far_end == peer_pci:
                direct += 1
        except Exception:
            pass
    try:
        nvlink_p2p = nvml.nvmlDeviceGetP2PStatus(handle, handles[j], nvml.NVML_P2P_CAPS_INDEX_NVLINK) == \
            getattr(nvml, "NVML_P2P_STATUS_OK", 0)
    except Exception:
        nvlink_p2p = None
    if direct:
        return f"NVLink x{direct}"
    if switched and nvlink_p2p is not False:
        return f"NVLink through NVSwitch ({switched} links per GPU)"
    if nvlink_p2p:
        return "NVLink"
    names = {0: "same board", 10: "same PCIe switch", 20: "PCIe switches", 30: "PCIe host bridge",
             40: "same NUMA node", 50: "across NUMA nodes (SMP)"}
    try:
        level = nvml.nvmlDeviceGetTopologyCommonAncestor(handle, handles[j])
        return f"PCIe ({names.get(int(level), level)})"
    except Exception:
        return "unknown link"


# ------------------------------------------------------------------ output

STYLE = {PASS: "green", WARN: "yellow", FAIL: "bold red", INFO: "cyan"}


def render(results: list[Result], console) -> None:
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="duoka doctor", show_lines=False, header_style="bold")
    table.add_column("check")
    table.add_column("status")
    table.add_column("finding")
    table.add_column("fix")
    for r in results:
        table.add_row(escape(r.check), f"[{STYLE[r.status]}]{r.status}[/]", escape(r.detail), escape(r.fix))
    console.print(table)
    counts = {s: sum(r.status == s for r in results) for s in (PASS, WARN, FAIL)}
    console.print(f"{counts[PASS]} passed, {counts[WARN]} warnings, {counts[FAIL]} failures")
