"""The machine a plan is for: its GPUs, their memory and links, and how fast duoka's kernels
run on them (`Hardware`, `Kernels`), from the flags or read from this machine's GPUs
(`detect_hardware`), and what the plan assumed about them (`hardware_notes`).

The links' cost formulas are duoka.plan.network's; the step-time model that uses all of
this is duoka.plan.step_time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cached_property

from duoka.errors import DuokaError
from duoka.host.devices import read_gpus, visible_indices
from duoka.monitor.mfu import peak_flops
from duoka.plan.memory import GIB
from duoka.plan.network import DEFAULT_NETWORK, INTERCONNECTS, Fabric, make_fabric, preset

# ---- hardware constants (the links between GPUs: duoka.plan.network)
DEFAULT_PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16, when the GPU is not known
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "H800": 3.35e12, "A100": 2.0e12, "B200": 8.0e12}
DEFAULT_HBM_BYTES_PER_S = 3.35e12

# ---- duoka's kernels (Kernels' defaults; the rest of the cost model: duoka.plan.step_time)
GEMM_EFFICIENCY = 0.5  # fraction of the bf16 peak a step reaches on large matmuls (7B FSDP2: 43-50% MFU)
FSDP_UNIT_S = 0.5e-3  # per FSDP unit per forward or backward pass (0.5-0.66 ms measured)
# Eager DTensor tensor parallelism costs far more than its collectives: 10.7 ms (7B, micro-
# batch 2) and 14.4 ms (1.5B, micro-batch 4) per block per micro-batch beyond this model's
# compute + communication, measured with tp 2 on 2 x H200 (bench/results/model_parallel.json:
# 2.1x and 3.8x the estimate without it). Per-op dispatch on the host, redistributions.
TP_BLOCK_OVERHEAD_S = 12e-3

# ---- what a plan may use of the machine
USABLE_FRACTION = 0.9  # a plan's reserved estimate must stay under this share of GPU memory
# An offloaded optimizer's host memory must stay under this share of the host's memory per
# GPU: the rest is the training process itself (torch, CUDA's host allocations, the data
# loader's batches) and the page cache of the token shards.
HOST_USABLE_FRACTION = 0.8
# Up to a thousand GPUs the estimate has been set beside published runs (docs/plan.md);
# beyond, it warns; past MAX_PLAN_GPUS it refuses: failures, stragglers and the topology of
# the network's spine, none of which it models, decide runs of that size.
CHECKED_GPUS = 1024
MAX_PLAN_GPUS = 8192


@dataclass(frozen=True)
class Kernels:
    """How fast the training code runs on the GPUs, beside what the hardware allows: duoka's
    measured constants by default. duoka.plan.published puts in a peer's (a faster tensor
    parallel, another matmul efficiency) to set the model beside its published runs."""

    gemm_efficiency: float = GEMM_EFFICIENCY
    tp_block_overhead_s: float = TP_BLOCK_OVERHEAD_S
    fsdp_unit_s: float = FSDP_UNIT_S
    pp_split: str = "even"  # layers per pipeline stage: the trainer's `even`, or Megatron's `layers`


@dataclass(frozen=True)
class Hardware:
    gpus: int  # all GPUs of the job, over every node
    nodes: int
    gpu_memory_gib: float
    interconnect: str  # the link between GPUs of one node: nvlink, pcie, or ib (none but the NIC)
    gpu_name: str = ""
    peak_flops: float = DEFAULT_PEAK_FLOPS
    hbm_bytes_per_s: float = DEFAULT_HBM_BYTES_PER_S
    detected: tuple[str, ...] = ()  # which fields came from this machine's GPUs
    network: str = DEFAULT_NETWORK  # between nodes: a preset of duoka.plan.network.NETWORKS
    intra_bytes_per_s: float | None = None  # --intra-bw: bus bandwidth per GPU inside a node, as measured
    inter_gbps: float | None = None  # --inter-bw: NIC line rate per GPU across nodes (the preset's otherwise)
    inter_step_s: float | None = None  # --inter-latency-us: one ring step across nodes
    kernels: Kernels = Kernels()
    host_memory_gib: float | None = None  # --host-memory: RAM per GPU (an offloaded optimizer's limit); None: unchecked

    def __post_init__(self):
        if self.gpus < 1 or self.nodes < 1:
            raise DuokaError(f"--gpus {self.gpus} and --nodes {self.nodes} must be >= 1")
        if self.gpus % self.nodes:
            raise DuokaError(f"--gpus {self.gpus} (all GPUs of the job) do not split evenly over --nodes {self.nodes}",
                             f"give the total, a multiple of {self.nodes} (e.g. --gpus {self.nodes * 8} for "
                             f"{self.nodes} nodes of 8)")
        if self.gpus > MAX_PLAN_GPUS:
            raise DuokaError(f"--gpus {self.gpus} is beyond what this cost model means: at that size failures, "
                             "stragglers and the network's spine decide the speed, and it models none of them",
                             f"plan at most {MAX_PLAN_GPUS:,} GPUs, e.g. one pipeline or replica group of the job")
        if self.gpu_memory_gib <= 0:
            raise DuokaError(f"--gpu-memory {self.gpu_memory_gib} must be positive (GiB per GPU)")
        if self.host_memory_gib is not None and self.host_memory_gib <= 0:
            raise DuokaError(f"--host-memory {self.host_memory_gib} must be positive (GiB of RAM per GPU)")
        if self.interconnect not in INTERCONNECTS:
            raise DuokaError(f"--interconnect {self.interconnect} is unknown", "use nvlink, pcie or ib")
        preset(self.network)  # names the presets when unknown
        for flag, value in (("--intra-bw", self.intra_bytes_per_s), ("--inter-bw", self.inter_gbps),
                            ("--inter-latency-us", self.inter_step_s)):
            if value is not None and value <= 0:
                raise DuokaError(f"{flag} {value:g} must be positive", f"leave {flag} out to use the preset's figure")

    @property
    def gpus_per_node(self) -> int:
        return self.gpus // self.nodes

    @property
    def usable_bytes(self) -> float:
        return USABLE_FRACTION * self.gpu_memory_gib * GIB

    @property
    def usable_host_bytes(self) -> float:
        return math.inf if self.host_memory_gib is None else HOST_USABLE_FRACTION * self.host_memory_gib * GIB

    @cached_property
    def fabric(self) -> Fabric:
        return make_fabric(self.gpus_per_node, self.interconnect, preset(self.network), self.intra_bytes_per_s,
                           self.inter_gbps, self.inter_step_s)

    def describe_network(self) -> str:
        """The links as the cost model sees them: `nvlink 350 GB/s; across nodes ib-ndr: ...`."""
        fab = self.fabric
        inside = f"{self.interconnect} {fab.intra_bytes_per_s / 1e9:.0f} GB/s"
        if self.nodes == 1:
            return inside
        what = f"--inter-bw {self.inter_gbps:g} Gb/s per GPU" if self.inter_gbps is not None else \
            preset(self.network).what
        return (f"{inside}; across nodes {self.network}: {what}; NCCL reaches {fab.inter_bytes_per_s / 1e9:.1f} "
                f"GB/s per GPU, {fab.inter_step_s * 1e6:.1f} us per ring step")

    def describe(self) -> str:
        nodes = f" ({self.nodes} nodes of {self.gpus_per_node})" if self.nodes > 1 else ""
        name = f" {self.gpu_name}" if self.gpu_name else ""
        net = f", {self.network}" if self.nodes > 1 else ""
        return f"{self.gpus} x{name} {self.gpu_memory_gib:g} GiB{nodes}, {self.interconnect}{net}"


def _local_gpus():
    gpus = read_gpus()
    visible = set(visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus))
    return [g for g in gpus if g.index in visible]


def _nvlink_active() -> bool:
    """Whether GPU 0 has an active NVLink (NVML); False where it cannot be read."""
    try:
        import pynvml
    except ImportError:
        return False
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for link in range(18):  # NVML_NVLINK_MAX_LINKS on Hopper
            try:
                if pynvml.nvmlDeviceGetNvLinkState(handle, link) == pynvml.NVML_FEATURE_ENABLED:
                    return True
            except pynvml.NVMLError:
                break
        return False
    finally:
        pynvml.nvmlShutdown()


def _hbm_bandwidth(name: str) -> float:
    upper = name.upper()
    return next((bw for key, bw in HBM_BYTES_PER_S.items() if key in upper), DEFAULT_HBM_BYTES_PER_S)


def _host_memory_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB


def detect_hardware(gpus: int | None = None, gpu_memory_gib: float | None = None, nodes: int = 1,
                    interconnect: str | None = None, local_gpus=None, network: str | None = None,
                    intra_bytes_per_s: float | None = None, inter_gbps: float | None = None,
                    inter_step_s: float | None = None, host_memory_gib: float | None = None) -> Hardware:
    """The machine to plan for: what the flags say, the rest read from this machine's GPUs
    (NVML, honouring CUDA_VISIBLE_DEVICES). `local_gpus` (a list of GpuReading) replaces
    the NVML reading, for tests. --gpus counts every GPU of the job; without it, this
    node's GPUs times --nodes. The network between nodes is never detected: DEFAULT_NETWORK
    unless given (the plan says which it assumed). Host memory per GPU: --host-memory, else
    this machine's RAM over its GPUs when the GPUs are this machine's, else unchecked."""
    need_local = gpus is None or gpu_memory_gib is None
    local = local_gpus if local_gpus is not None else (_local_gpus() if need_local else [])
    detected = []
    if gpus is None:
        if not local:
            raise DuokaError("--gpus was not given and this machine has no GPU NVML can see, so there is nothing "
                             "to detect",
                             "describe the machines you will train on: --gpus N --gpu-memory GiB (e.g. --gpus 8 "
                             "--gpu-memory 80 for one node of H100 80GB)")
        gpus = len(local) * nodes
        detected.append("gpus")
    if gpu_memory_gib is None:
        if not local:
            raise DuokaError("--gpu-memory was not given and this machine has no GPU NVML can see, so there is "
                             "nothing to detect",
                             "pass the memory of one GPU in GiB: --gpu-memory 80 (H100 80GB), 141 (H200), 24 "
                             "(RTX 4090)")
        gpu_memory_gib = round(min(g.memory_total_mib for g in local) / 1024, 1)
        detected.append("gpu_memory")
    name = local[0].name if local else ""
    if host_memory_gib is None and "gpus" in detected and local_gpus is None:
        host_memory_gib = round(_host_memory_gib() / len(local), 1)
        detected.append("host_memory")
    if interconnect is None:
        if local_gpus is None and local:
            interconnect = "nvlink" if _nvlink_active() else "pcie"
            detected.append("interconnect")
        else:
            interconnect = "nvlink"  # assumed: the usual data-centre node (stated in the output)
    return Hardware(gpus, nodes, float(gpu_memory_gib), interconnect, name,
                    peak_flops(name) or DEFAULT_PEAK_FLOPS, _hbm_bandwidth(name), tuple(detected),
                    network or DEFAULT_NETWORK, intra_bytes_per_s, inter_gbps, inter_step_s,
                    host_memory_gib=host_memory_gib)


def hardware_notes(hw: Hardware) -> list[str]:
    """What the plan assumed about the GPUs' links, and where its estimate stops holding."""
    notes = []
    if "interconnect" not in hw.detected and hw.interconnect == "nvlink":
        notes.append("interconnect assumed nvlink (set --interconnect pcie for GPUs without NVLink)")
    if hw.nodes > 1:
        given = hw.inter_gbps is not None or hw.network != DEFAULT_NETWORK
        notes.append(f"links: {hw.describe_network()}" + ("" if given else " (assumed; set --network or --inter-bw)"))
    if hw.gpus_per_node > 8 and hw.interconnect != "ib":
        notes.append(f"{hw.gpus_per_node} GPUs per node share one {hw.interconnect} domain (as in a GB200 NVL72); "
                     f"for servers of 8 give --nodes {max(1, hw.gpus // 8)}")
    if hw.gpus > CHECKED_GPUS:
        notes.append(f"beyond {CHECKED_GPUS:,} GPUs this estimate is set beside Megatron-LM's published runs only "
                     "(docs/plan.md); failures, stragglers and network congestion, which it leaves out, grow with "
                     "the job")
    return notes

