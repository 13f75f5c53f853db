"""`duoka plan`: which parallel layout, micro-batch and activation checkpointing to train a
model with on a given set of GPUs, and why.

Every layout duoka runs is enumerated (ddp, fsdp, hsdp, tp within a node, pp, and their
combinations), with every power-of-two micro-batch that divides the per-rank batch, with
and without activation checkpointing. Each gets a per-GPU memory estimate
(duoka.plan.memory) and a step time from the cost model below; those that do not fit are
dropped, the rest ranked by step time, and among near-ties (within TIE) the simplest
layout wins: ddp > fsdp > hsdp > tp > pp, since each step to the right adds
communication on the critical path and ways to fail.

Cost model of one optimizer step on one GPU (relative times are what it is for; the
absolute figure assumes a well-fed GPU and is no benchmark):
- compute: training FLOPs (PaLM's 6·N + 12·L·H·S per token, design.md) of the work this
  GPU does, x 4/3 for the decoder blocks under full activation checkpointing (the forward
  runs twice), at GEMM_EFFICIENCY of the bf16 peak, lowered for small per-GPU matmuls
  (micro-batch x seq x dim/tp elements per projection; half speed at HALF_SPEED_ELEMENTS);
- tensor parallel: with sequence parallelism, each block does 2 all-gathers and 2
  reduce-scatters of the full activation forward and again backward (Korthikanti et al.
  2022, arXiv:2205.05198, section 4.2.2), 4 more under checkpointing; on the critical
  path, not overlapped; tp stays inside a node. Plus TP_BLOCK_OVERHEAD_S per block and
  micro-batch, measured: eager DTensor is far slower than its traffic;
- every collective costs its alpha-beta time over the links of the group it runs in
  (duoka.plan.network: ring all-gather/reduce-scatter, ring or tree all-reduce, NCCL's
  latencies; bandwidth NVLink/PCIe inside a node, min(NVLink, GPUs of the group per node x
  NIC) across nodes, with the mesh pp x dp_replicate x dp_shard x tp placing tp innermost,
  so HSDP's replica all-reduce and pipeline sends cross nodes on one NIC each);
- data parallel: DDP all-reduces fp32 gradients once per step, in parallel.ddp_bucket_mb
  buckets; FSDP all-gathers bf16 weights per unit per micro-batch (forward, and backward
  again when resharding after forward; once per step under pp) and reduce-scatters fp32
  gradients once per step; HSDP adds an all-reduce of the shards across replicas. The
  all-gathers overlap the forward (or backward) they prefetch for; the gradient reduction
  overlaps only the last micro-batch's backward (the trainer syncs gradients there only);
  the first (or last) unit's share of each waits; what outlasts its window is exposed;
- FSDP's per-unit cost (hooks, copies, stream waits): FSDP_UNIT_S per unit per pass,
  measured (bench/results/train_vs_peer.md: FSDP2 vs DDP on 2 x H200, 0.5B and 1.5B); a
  unit is one block, or several small ones without resharding (auto_blocks_per_unit);
- pipeline: the slowest stage's time x (m + (pp-1)/v) for m micro-batches and v stages
  per rank, i.e. the bubble fraction (pp-1)/(v·m + pp-1) of Narayanan et al. 2021
  (arXiv:2104.04473); plus the stage-to-stage sends (1/tp of the activation per rank under
  sequence parallelism), on the critical path;
- optimizer: its step's traffic through HBM (fused AdamW: 32 bytes per local parameter),
  Muon's Newton-Schulz matmuls, the per-tensor host calls of the for-loop and compiled
  optimizers, and for AdamW offloaded to the host the host's AdamW and the PCIe copies
  (duoka.plan.optimizer_costs: step_seconds, with its constants and their sources).

Optimizers: the plan is for optimizer.name / optimizer.offload as asked (AdamW by default).
When nothing fits with AdamW and no optimizer was asked for, it tries the others in
PROPOSAL_ORDER and plans with the first that fits, listing every one that does.
Ignored: kernel contention between NCCL and compute, CPU launch overhead of tiny models,
data loading, stragglers and failures (which grow with the job: see CHECKED_GPUS).
duoka.plan.scaling tabulates this model from one node to the whole job; duoka.plan.published
sets it beside torchtitan's and Megatron-LM's published runs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from duoka.errors import DuokaError
from duoka.hub import resolve_model_dir
from duoka.models.qwen2.args import FLAVORS, ModelArgs
from duoka.models.qwen2.hf_adapter import read_config
from duoka.monitor.mfu import peak_flops
from duoka.host.devices import read_gpus, visible_indices
from duoka.plan.memory import (
    GIB,
    Layout,
    MemoryBreakdown,
    auto_blocks_per_unit,
    block_params,
    estimate_memory,
    stage_layer_counts,
    state_bytes,
)
from duoka.plan.network import DEFAULT_NETWORK, INTERCONNECTS, Fabric, make_fabric, preset
from duoka.plan.optimizer_costs import ADAMW, OptimizerChoice, rank_footprint, step_seconds

# ---- hardware constants (the links between GPUs: duoka.plan.network)
DEFAULT_PEAK_FLOPS = 989e12  # H100/H200 SXM dense bf16, when the GPU is not known
HBM_BYTES_PER_S = {"H200": 4.8e12, "H100": 3.35e12, "H800": 3.35e12, "A100": 2.0e12, "B200": 8.0e12}
DEFAULT_HBM_BYTES_PER_S = 3.35e12

# ---- cost model constants
GEMM_EFFICIENCY = 0.5  # fraction of the bf16 peak a step reaches on large matmuls (7B FSDP2: 43-50% MFU)
HALF_SPEED_ELEMENTS = 2**20  # micro-batch x seq x dim/tp at which that efficiency halves
FSDP_UNIT_S = 0.5e-3  # per FSDP unit per forward or backward pass (0.5-0.66 ms measured)
# Eager DTensor tensor parallelism costs far more than its collectives: 10.7 ms (7B, micro-
# batch 2) and 14.4 ms (1.5B, micro-batch 4) per block per micro-batch beyond this model's
# compute + communication, measured with tp 2 on 2 x H200 (bench/results/model_parallel.json:
# 2.1x and 3.8x the estimate without it). Per-op dispatch on the host, redistributions.
TP_BLOCK_OVERHEAD_S = 12e-3
# DDP's all-reduce is modelled as overlapped bucket by bucket, in 25 MB buckets, with one
# bucket exposed. duoka's default buckets are 1000 MB: fewer, later all-reduces are faster
# through less contention with the backward's kernels, which this model leaves out;
# modelling the larger buckets' exposure without that contention would penalise DDP for a
# change that made it faster (docs/performance.md).
DDP_BUCKET_BYTES = 25 * 2**20
# The all-reduces DDP launches: one per bucket of parallel.ddp_bucket_mb (default 1000 MB);
# their count sets the latency paid, which matters across many nodes.
DDP_LAUNCH_BUCKET_BYTES = 1000 * 2**20
AC_RECOMPUTE = 4 / 3  # full checkpointing runs each block's forward (1/3 of its FLOPs) again

# ---- ranking
USABLE_FRACTION = 0.9  # a plan's reserved estimate must stay under this share of GPU memory
# An offloaded optimizer's host memory must stay under this share of the host's memory per
# GPU: the rest is the training process itself (torch, CUDA's host allocations, the data
# loader's batches) and the page cache of the token shards.
HOST_USABLE_FRACTION = 0.8
# Optimizers tried, in this order, when AdamW does not fit and none was asked for: the same
# update as AdamW with quantized state first (8-bit state tracks fp32 AdamW closely: Dettmers
# et al. 2022, arXiv:2110.02861; 4-bit loses a little more: Li et al. 2023, arXiv:2309.01507),
# then exact AdamW with its state and step on the host (slow: the host's step), then the
# optimizers that change the update (compare their loss curve before switching).
PROPOSAL_ORDER = (OptimizerChoice("adamw8bit"), OptimizerChoice("adamw4bit"), OptimizerChoice("adamw", "cpu"),
                  OptimizerChoice("adafactor"), OptimizerChoice("muon"), OptimizerChoice("sgd"))
TIE = 0.03  # step times within 3% of the fastest count as a tie: the simplest layout wins
MAX_GPUS_SEARCHED = 4096
# Up to a thousand GPUs the estimate has been set beside published runs (docs/plan.md);
# beyond, it warns; past MAX_PLAN_GPUS it refuses: failures, stragglers and the topology of
# the network's spine, none of which it models, decide runs of that size.
CHECKED_GPUS = 1024
MAX_PLAN_GPUS = 8192
DEFAULT_SEQ = 2048
TP_SIZES = (1, 2, 4, 8)
FAMILY_ORDER = ("single", "ddp", "fsdp", "hsdp", "tp", "pp")


# ---------------------------------------------------------------- inputs


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


@dataclass(frozen=True)
class ModelChoice:
    label: str  # what the output calls it
    args: ModelArgs
    config: dict  # the [model] section of the emitted TOML: {"flavor": ...} or {"path": ...}


def resolve_model(ref: str) -> ModelChoice:
    """A flavor name ("qwen2-7b", or "7b" for short) or a Hugging Face folder / hub id."""
    key = ref.lower()
    if key not in FLAVORS and f"qwen2-{key}" in FLAVORS:
        key = f"qwen2-{key}"
    if key in FLAVORS:
        return ModelChoice(key, FLAVORS[key], {"flavor": key})
    path = Path(ref).expanduser()
    if not path.exists() and "/" not in ref:
        raise DuokaError(f"--model {ref} is neither a flavor nor a model folder",
                         f"use a flavor ({', '.join(FLAVORS)}) or a Hugging Face folder / hub id")
    return ModelChoice(str(ref), read_config(resolve_model_dir(ref)), {"path": str(ref)})


# ---------------------------------------------------------------- layouts


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def family(layout: Layout) -> str:
    if layout.pp > 1:
        return "pp"
    if layout.tp > 1:
        return "tp"
    if layout.dp_mode == "fsdp":
        return "hsdp" if layout.dp_replicate > 1 else "fsdp"
    return "ddp" if layout.dp_replicate > 1 else "single"


def simplicity(layout: Layout) -> tuple:
    """Sort key, simplest first: ddp > fsdp > hsdp > tp > pp, then smaller degrees."""
    dp = {"ddp": 0, "fsdp": 1}[layout.dp_mode] + (1 if layout.dp_mode == "fsdp" and layout.dp_replicate > 1 else 0)
    return (layout.pp > 1, layout.tp > 1, dp, layout.tp, layout.pp, layout.stages_per_rank)


def enumerate_layouts(args: ModelArgs, gpus: int, gpus_per_node: int) -> list[Layout]:
    """Every layout of `gpus` GPUs the trainer runs and the model's shape allows: tp from
    1/2/4/8 dividing the attention and KV heads, within one node; pp dividing the GPUs
    with at least one layer per stage (1F1B, and interleaved with 2 stages per rank);
    the remaining ranks data-parallel as ddp, fsdp, or hsdp (every replicas x shards
    split)."""
    out = []
    for tp in TP_SIZES:
        if gpus % tp or args.n_heads % tp or args.n_kv_heads % tp or tp > gpus_per_node:
            continue
        for pp in _divisors(gpus // tp):
            if pp > args.n_layers:
                continue
            d = gpus // (tp * pp)
            if pp > 1:
                schedules = [("1f1b", 1)] + ([("interleaved_1f1b", 2)] if 2 * pp <= args.n_layers else [])
            else:
                schedules = [("1f1b", 1)]
            for sched, v in schedules:
                dps = [Layout("ddp", d, 1, tp, pp, sched, v)]
                if d > 1:
                    fsdp = [Layout("fsdp", 1, d, tp, pp, sched, v)]
                    fsdp += [Layout("fsdp", r, d // r, tp, pp, sched, v) for r in _divisors(d) if 1 < r < d]
                    # Keeping blocks gathered from forward to backward (ZeRO-2-like) saves the
                    # backward's all-gathers for the gathered weights' memory; under pp the
                    # trainer keeps stages gathered anyway.
                    dps += fsdp + ([replace(x, reshard_after_forward=False) for x in fsdp] if pp == 1 else [])
                out += dps
    return out


def crosses_nodes(layout: Layout, dim: str, gpus_per_node: int) -> bool:
    """Whether a process group of mesh dimension `dim` spans nodes. The mesh is
    pp x dp_replicate x dp_shard x tp with tp innermost (neighbouring ranks), as the
    trainer builds it."""
    order = ("pp", "dp_replicate", "dp_shard", "tp")
    sizes = {"pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "tp": layout.tp}
    stride = math.prod(sizes[d] for d in order[order.index(dim) + 1:])
    return sizes[dim] > 1 and stride * sizes[dim] > gpus_per_node


# ---------------------------------------------------------------- step time


@dataclass(frozen=True)
class StepTime:
    compute_s: float  # the slowest rank's matmuls and attention, bubble included
    tensor_parallel_s: float  # tp collectives and the tp implementation's overhead (on the critical path)
    fsdp_overhead_s: float
    data_parallel_s: float  # all of the dp traffic
    exposed_dp_s: float  # the part of it not hidden under compute
    pipeline_bubble: float  # fraction of the pipelined time spent idle
    pipeline_p2p_s: float
    optimizer_s: float
    total_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    bubble_s: float = 0.0  # the pipeline's idle time, inside compute_s
    dp_latency_s: float = 0.0  # the latency part of data_parallel_s (collective launches, ring steps)
    dp_across_nodes: bool = False  # some dp group spans nodes (its bandwidth is the network's)

    def overheads(self) -> dict[str, float]:
        """Seconds of the step beyond the matmuls, by cause (what limits scaling)."""
        return {"dp comm": self.exposed_dp_s, "tp": self.tensor_parallel_s, "pp bubble": self.bubble_s,
                "pp sends": self.pipeline_p2p_s, "fsdp hooks": self.fsdp_overhead_s, "optimizer": self.optimizer_s}

    def limit(self) -> tuple[str, float]:
        """(the largest overhead, named so a reader knows what to change; its share of the step).
        Exposed dp traffic says whether its latency (more ranks per group) or its bytes
        (bandwidth) make most of it."""
        name, seconds = max(self.overheads().items(), key=lambda kv: kv[1])
        if name == "dp comm":
            latency = self.data_parallel_s and self.dp_latency_s > 0.5 * self.data_parallel_s
            name = "dp latency" if latency else "dp bandwidth"
        return name, seconds / self.total_s

    def to_dict(self) -> dict:
        return {k: (round(v, 5) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def _stage_counts(n_layers: int, n_stages: int, split: str) -> list[int]:
    """Decoder layers per pipeline stage: the trainer's `even` split (the embedding and the
    head counted as a layer each), or `layers` (layers only, as Megatron-LM splits them)."""
    if split == "layers":
        return [n_layers // n_stages + (1 if s < n_layers % n_stages else 0) for s in range(n_stages)]
    return stage_layer_counts(n_layers, n_stages)


def _stage_flops(args: ModelArgs, layout: Layout, seq_len: int, ac: bool, split: str = "even"
                 ) -> tuple[float, float]:
    """(training FLOPs per token of the busiest pipeline rank, of the whole model)."""
    _, _, block_mm = block_params(args)
    layer = 6 * block_mm + 12 * args.n_heads * args.resolved_head_dim * seq_len
    head = 6 * args.vocab_size * args.dim
    layer_ac = layer * (AC_RECOMPUTE if ac else 1.0)
    n_stages = layout.pp * layout.stages_per_rank
    counts = _stage_counts(args.n_layers, n_stages, split)
    busiest = 0.0
    for rank in range(layout.pp):
        stages = range(rank, n_stages, layout.pp)
        flops = sum(counts[s] for s in stages) * layer_ac + (head if n_stages - 1 in stages else 0.0)
        busiest = max(busiest, flops)
    return busiest, args.n_layers * layer + head


def _mesh_strides(layout: Layout) -> dict[str, int]:
    """Rank distance between neighbours of each mesh dimension: the mesh is pp x
    dp_replicate x dp_shard x tp with tp innermost, as the trainer builds it."""
    return {"tp": 1, "dp_shard": layout.tp, "dp_replicate": layout.tp * layout.dp_shard,
            "pp": layout.tp * layout.dp_shard * layout.dp_replicate}


def _exposed(traffic: float, window: float, units: int) -> float:
    """Seconds of `traffic` (split into `units` equal collectives) that compute does not
    hide: the first (or last) unit's share waits with nothing to overlap it; the rest runs
    beside the `window` of compute and shows where it outlasts it."""
    if traffic <= 0:
        return 0.0
    return traffic / units + max(0.0, traffic * (1 - 1 / units) - window)


def estimate_step_time(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, global_batch: int,
                       ac: bool, hw: Hardware, optimizer: OptimizerChoice = ADAMW) -> StepTime:
    """Seconds per optimizer step on one GPU, by the cost model in the module docstring."""
    tp, pp, v = layout.tp, layout.pp, layout.stages_per_rank
    kern, fab = hw.kernels, hw.fabric
    per_rank = global_batch // layout.dp_size
    m = per_rank // micro_batch  # micro-batches per step (the pipeline's under pp)
    tokens_mb = micro_batch * seq_len

    busiest, model_flops = _stage_flops(args, layout, seq_len, ac, kern.pp_split)
    elements = tokens_mb * args.dim / tp
    efficiency = kern.gemm_efficiency * elements / (elements + HALF_SPEED_ELEMENTS)
    compute_mb = tokens_mb * busiest / tp / (hw.peak_flops * efficiency)

    # Layers this rank runs per micro-batch (for per-layer costs).
    counts = _stage_counts(args.n_layers, pp * v, kern.pp_split)
    rank_layers = max(sum(counts[s] for s in range(r, pp * v, pp)) for r in range(pp))
    tp_mb = 0.0
    if tp > 1:  # within a node (enumerate_layouts): an all-gather or reduce-scatter of the bf16 activation
        per_collective = fab.all_gather_s(2 * tokens_mb * args.dim, tp)
        tp_mb = (rank_layers * (12 if ac else 8) + 4) * per_collective
        tp_mb += rank_layers * kern.tp_block_overhead_s * (AC_RECOMPUTE if ac else 1.0)
    # Without resharding only the forward gathers: one pass of per-unit cost fewer (7B on
    # 2 x H200: -22 ms per micro-batch of 4 over 28 blocks, bench/results/speed.md).
    passes = 1 if pp == 1 and not layout.reshard_after_forward else 2
    # Without resharding, small blocks are grouped into larger units (the trainer's
    # parallel.fsdp_blocks_per_unit=-1): fewer units, less per-unit cost.
    per_unit = auto_blocks_per_unit(args, micro_batch, seq_len, tp, layout.reshard_after_forward or pp > 1)
    units = math.ceil(rank_layers / per_unit) + 1  # + the root (embedding, final norm, head)
    fsdp_mb = kern.fsdp_unit_s * passes * units if layout.fsdp else 0.0
    rank_mb = compute_mb + tp_mb + fsdp_mb
    pipelined = rank_mb * (m + (pp - 1) / v)
    bubble = ((pp - 1) / v) / (m + (pp - 1) / v) if pp > 1 else 0.0
    # The windows dp traffic can hide under: one micro-batch's forward (1/3 of the FLOPs, 1/4
    # under checkpointing, whose backward recomputes it) and its backward.
    fwd_mb = rank_mb / 3 / (AC_RECOMPUTE if ac else 1.0)
    bwd_mb = rank_mb - fwd_mb

    # Parameters this rank holds after tp/pp (the largest pipeline rank), before dp sharding.
    p_block, p_block_tp, _ = block_params(args)
    block_local = p_block_tp / tp + (p_block - p_block_tp)
    vocab_rows = args.vocab_size * args.dim / tp
    local = rank_layers * block_local + (2 * vocab_rows if pp == 1 and not args.tie_word_embeddings else vocab_rows)

    # Data-parallel traffic: one forward (or backward) pass's all-gathers, and the gradient
    # reduction, which the trainer runs in the last micro-batch's backward only (no_sync /
    # set_requires_gradient_sync before it): its window is that one backward.
    stride, gpn = _mesh_strides(layout), hw.gpus_per_node
    gather = reduce = gather_lat = reduce_lat = 0.0
    across = False
    if layout.ddp_wrapper:
        d = layout.dp_replicate
        launches = max(1, math.ceil(4 * local / DDP_LAUNCH_BUCKET_BYTES))
        reduce = launches * fab.all_reduce_s(4 * local / launches, d, stride["dp_replicate"])
        reduce_lat = launches * fab.all_reduce_s(0.0, d, stride["dp_replicate"])
        units = max(1, math.ceil(4 * local / DDP_BUCKET_BYTES))
        across = crosses_nodes(layout, "dp_replicate", gpn)
    elif layout.fsdp:
        s, r = layout.dp_shard, layout.dp_replicate
        if s > 1:  # per unit: all-gather its bf16 weights; reduce-scatter its fp32 gradients
            gather = units * fab.all_gather_s(2 * local / units, s, stride["dp_shard"])
            gather_lat = units * fab.all_gather_s(0.0, s, stride["dp_shard"])
            reduce = units * fab.reduce_scatter_s(4 * local / units, s, stride["dp_shard"])
            reduce_lat = gather_lat
        if r > 1:  # HSDP: the shards' all-reduce across replicas (the trainer's mesh keeps shards inner)
            reduce += units * fab.all_reduce_s(4 * local / s / units, r, stride["dp_replicate"])
            reduce_lat += units * fab.all_reduce_s(0.0, r, stride["dp_replicate"])
        across = (s > 1 and crosses_nodes(layout, "dp_shard", gpn)) or \
                 (r > 1 and crosses_nodes(layout, "dp_replicate", gpn))
    if pp > 1:  # the trainer keeps stages gathered across micro-batches: one gather per step
        dp_s, dp_lat = gather + reduce, gather_lat + reduce_lat
        exposed = _exposed(gather, fwd_mb, units) + _exposed(reduce, bwd_mb, units)
    else:
        regather = layout.fsdp and layout.reshard_after_forward  # backward gathers the weights again
        dp_s = m * gather * (2 if regather else 1) + reduce
        dp_lat = m * gather_lat * (2 if regather else 1) + reduce_lat
        back = gather if regather else 0.0
        exposed = (m * _exposed(gather, fwd_mb, units) + (m - 1) * _exposed(back, bwd_mb, units)
                   + _exposed(back + reduce, bwd_mb, units))

    p2p = 0.0
    if pp > 1:  # each micro-batch's activation forward and its gradient back, per stage; under tp
        # each rank sends its 1/tp of the sequence (sequence parallel: blocks output Shard(1))
        p2p = m * v * 2 * fab.send_s(2 * tokens_mb * args.dim / tp, crosses_nodes(layout, "pp", gpn))
    shard = layout.dp_shard if layout.fsdp else 1
    # The same tensors as `local`: the busiest rank's layers, the embedding too without pp.
    opt = rank_footprint(args, rank_layers, pp == 1, True, tp, optimizer, shard)
    optimizer_s = step_seconds(opt, hw.hbm_bytes_per_s, hw.peak_flops * kern.gemm_efficiency, bwd_mb)
    # Muon gathers each sharded matrix's fp32 update whole, over the shards and the tp ranks.
    optimizer_s += sum(count * (fab.all_gather_s(nbytes / tp, shard, stride["dp_shard"])
                                + fab.all_gather_s(nbytes, tp)) for nbytes, count in opt.gathered)
    total = pipelined + exposed + p2p + optimizer_s
    tokens = global_batch * seq_len
    mfu = (model_flops * tokens / total) / (hw.gpus * hw.peak_flops)
    return StepTime(compute_s=compute_mb * (m + (pp - 1) / v), tensor_parallel_s=tp_mb * m,
                    fsdp_overhead_s=fsdp_mb * m, data_parallel_s=dp_s, exposed_dp_s=exposed,
                    pipeline_bubble=bubble, pipeline_p2p_s=p2p, optimizer_s=optimizer_s, total_s=total,
                    tokens_per_s_per_gpu=tokens / total / hw.gpus, mfu=mfu,
                    bubble_s=rank_mb * (pp - 1) / v, dp_latency_s=dp_lat, dp_across_nodes=across)


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    micro_batch: int
    activation_checkpointing: bool
    accumulation: int  # micro-batches per step per rank (pipeline micro-batches under pp)
    memory: MemoryBreakdown
    time: StepTime
    fits: bool
    optimizer: OptimizerChoice = ADAMW

    @property
    def family(self) -> str:
        return family(self.layout)

    def describe(self, optimizer: bool = True) -> str:
        ac = ", checkpointing" if self.activation_checkpointing else ""
        opt = f", {self.optimizer.describe()}" if optimizer and self.optimizer != ADAMW else ""
        return f"{self.layout.describe()}, micro-batch {self.micro_batch}{ac}{opt}"

    def to_dict(self, relative_to: float | None = None) -> dict:
        lay = self.layout
        d = {"layout": lay.describe(), "family": self.family,
             "parallel": {"dp_mode": lay.dp_mode, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard,
                          "tp": lay.tp, "pp": lay.pp, "pp_schedule": lay.pp_schedule,
                          "pp_stages_per_rank": lay.stages_per_rank,
                          "reshard_after_forward": lay.reshard_after_forward},
             "micro_batch": self.micro_batch, "accumulation": self.accumulation,
             "activation_checkpointing": self.activation_checkpointing, "optimizer": self.optimizer.config(),
             "fits": self.fits, "peak_allocated_gib": round(self.memory.allocated / GIB, 2),
             "reserved_gib": round(self.memory.reserved / GIB, 2), "host_gib": round(self.memory.host / GIB, 2),
             "memory": self.memory.to_dict(), "step_time": self.time.to_dict()}
        if relative_to:
            d["relative_step_time"] = round(self.time.total_s / relative_to, 3)
        return d


@dataclass
class Plan:
    model: ModelChoice
    hardware: Hardware
    seq_len: int
    global_batch: int
    ranked: list[Candidate]  # the best variant of each fitting layout; [0] is the recommendation
    rejected: list[Candidate]  # the smallest-memory variant of each layout that does not fit
    why: str
    considered: int  # (layout, micro-batch, checkpointing) combinations estimated
    notes: list[str] = field(default_factory=list)
    optimizer: OptimizerChoice = ADAMW  # the optimizer planned with
    # Set when AdamW did not fit and the planner chose the optimizer: why, and the best
    # candidate of every optimizer that fits (in PROPOSAL_ORDER).
    proposal: str = ""
    alternatives: list[Candidate] = field(default_factory=list)

    @property
    def best(self) -> Candidate:
        return self.ranked[0]

    @property
    def fastest_s(self) -> float:
        return min(c.time.total_s for c in self.ranked)

    def config_toml(self) -> str:
        return plan_toml(self)

    def to_dict(self) -> dict:
        hw = self.hardware
        return {
            "model": self.model.label, "parameters": self.model.args.num_params(),
            "hardware": {"gpus": hw.gpus, "nodes": hw.nodes, "gpus_per_node": hw.gpus_per_node,
                         "gpu_memory_gib": hw.gpu_memory_gib, "interconnect": hw.interconnect,
                         "gpu_name": hw.gpu_name, "peak_tflops": hw.peak_flops / 1e12, "detected": list(hw.detected),
                         "usable_gib": round(hw.usable_bytes / GIB, 2)},
            "seq_len": self.seq_len, "global_batch": self.global_batch, "considered": self.considered,
            "optimizer": self.optimizer.config(), "proposal": self.proposal,
            "alternatives": [c.to_dict(self.fastest_s) for c in self.alternatives],
            "why": self.why, "notes": self.notes,
            "ranked": [c.to_dict(self.fastest_s) for c in self.ranked],
            "rejected": [c.to_dict() for c in self.rejected],
            "config_toml": self.config_toml(),
        }


def _micro_batches(per_rank: int) -> list[int]:
    return [1 << k for k in range(per_rank.bit_length()) if per_rank % (1 << k) == 0]


def evaluate(args: ModelArgs, hw: Hardware, seq_len: int, global_batch: int,
             layouts: list[Layout] | None = None, optimizer: OptimizerChoice = ADAMW,
             micro_batch: int | None = None, activation_checkpointing: bool | None = None) -> list[Candidate]:
    """Every (layout, micro-batch, checkpointing) combination the batch arithmetic allows,
    with its memory and step time; micro_batch / activation_checkpointing keep one value."""
    out = []
    acs = (False, True) if activation_checkpointing is None else (activation_checkpointing,)
    for layout in layouts if layouts is not None else enumerate_layouts(args, hw.gpus, hw.gpus_per_node):
        if global_batch % layout.dp_size:
            continue
        per_rank = global_batch // layout.dp_size
        if micro_batch is None:
            mbs = _micro_batches(per_rank)
        else:
            mbs = [micro_batch] if per_rank % micro_batch == 0 else []
        for mb in mbs:
            m = per_rank // mb
            if layout.pp > 1 and (m < layout.pp or (layout.stages_per_rank > 1 and m % layout.pp)):
                continue  # the schedules want at least pp micro-batches (interleaved: a multiple)
            for ac in acs:
                mem = estimate_memory(args, layout, mb, seq_len, ac, m, optimizer=optimizer)
                time = estimate_step_time(args, layout, mb, seq_len, global_batch, ac, hw, optimizer)
                fits = mem.reserved <= hw.usable_bytes and mem.host <= hw.usable_host_bytes
                out.append(Candidate(layout, mb, ac, m, mem, time, fits, optimizer))
    return out


def _best_per_layout(candidates: list[Candidate], key) -> list[Candidate]:
    best: dict[Layout, Candidate] = {}
    for c in candidates:
        if c.layout not in best or key(c) < key(best[c.layout]):
            best[c.layout] = c
    return list(best.values())


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fitting layouts, best variant each, ordered: the simplest within TIE of the fastest
    first, then the others by step time."""
    fitting = _best_per_layout([c for c in candidates if c.fits],
                               key=lambda c: (c.time.total_s, c.activation_checkpointing, -c.micro_batch))
    if not fitting:
        return []
    fastest = min(c.time.total_s for c in fitting)
    ties = [c for c in fitting if c.time.total_s <= fastest * (1 + TIE)]
    first = min(ties, key=lambda c: (simplicity(c.layout), c.time.total_s))
    rest = sorted((c for c in fitting if c is not first), key=lambda c: (c.time.total_s, simplicity(c.layout)))
    return [first] + rest


def _gib(x: float) -> str:
    return f"{x / GIB:.1f}"


def _slower(ratio: float) -> str:
    return f"{ratio:.1f}x slower" if ratio >= 2 else f"{ratio - 1:.0%} slower"


def explain(ranked: list[Candidate], rejected: list[Candidate], hw: Hardware) -> str:
    """One line: why the first layout is first."""
    first = ranked[0]
    fastest = min(ranked, key=lambda c: c.time.total_s)
    usable = hw.usable_bytes
    tail = (f"est. {_gib(first.memory.allocated)} GiB allocated per GPU ({_gib(first.memory.reserved)} reserved of "
            f"{_gib(usable)} usable).")
    if hw.gpus == 1:
        fast = max((c for c in ranked), key=lambda c: c.time.tokens_per_s_per_gpu)
        ac = " with activation checkpointing (nothing fits without it)" if first.activation_checkpointing else ""
        return (f"one GPU, no parallelism needed: micro-batch {first.micro_batch}{ac} is the fastest that fits; "
                + tail) if fast is first else f"{first.describe()}; " + tail
    reasons = []
    for fam in FAMILY_ORDER[:FAMILY_ORDER.index(first.family)]:
        if fam == "single" and hw.gpus > 1:
            continue
        fits = [c for c in ranked if c.family == fam]
        misses = [c for c in rejected if c.family == fam]
        if fits:
            c = min(fits, key=lambda c: c.time.total_s)
            reasons.append(f"{c.layout.describe()} is {_slower(c.time.total_s / first.time.total_s)}")
        elif misses:
            c = min(misses, key=lambda c: c.memory.reserved)
            reasons.append(f"{c.layout.describe()} does not fit ({_gib(c.memory.reserved)} GiB at micro-batch "
                           f"{c.micro_batch}{' with checkpointing' if c.activation_checkpointing else ''} > "
                           f"{_gib(usable)} usable)")
    if first is fastest:
        lead = f"fastest of the {len(ranked)} layouts that fit"
        if len(ranked) > 1 and not any(r.startswith(ranked[1].layout.describe() + " ") for r in reasons):
            lead += f" (next: {ranked[1].layout.describe()}, {_slower(ranked[1].time.total_s / first.time.total_s)})"
    else:
        lead = (f"within {first.time.total_s / fastest.time.total_s - 1:.0%} of the fastest "
                f"({fastest.describe()}) and simpler")
    detail = []
    if first.activation_checkpointing:
        plain = [c for c in rejected + ranked if c.layout == first.layout and not c.activation_checkpointing]
        detail.append("checkpointing because nothing without it fits" if not any(
            c.fits for c in plain) else "checkpointing for a larger micro-batch")
    text = f"{first.describe()}: {lead}"
    if reasons:
        text += "; " + "; ".join(reasons)
    if detail:
        text += "; " + "; ".join(detail)
    return text + "; " + tail


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


def make_plan(model: ModelChoice, hw: Hardware, seq_len: int | None = None, global_batch: int | None = None,
              optimizer: OptimizerChoice | None = None, micro_batch: int | None = None,
              activation_checkpointing: bool | None = None) -> Plan:
    """The ranked plan; a DuokaError naming the smallest GPU count that works when nothing
    fits (or the batch arithmetic when no layout divides the batch). seq_len defaults to
    2048, or the model's context when shorter. optimizer: the one to plan with; None: AdamW,
    or when AdamW fits nowhere the first of PROPOSAL_ORDER that fits (the plan says why).
    micro_batch / activation_checkpointing: plan only with that value."""
    args = model.args
    notes = []
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ, args.max_seq_len)
        if seq_len != DEFAULT_SEQ:
            notes.append(f"seq {seq_len}, the model's context (set --seq)")
    if seq_len < 1:
        raise DuokaError(f"--seq {seq_len} must be >= 1")
    if seq_len > args.max_seq_len:  # the trainer refuses it too
        raise DuokaError(f"--seq {seq_len} exceeds the model's {args.max_seq_len} positions",
                         f"use --seq {args.max_seq_len} or less")
    asked_batch = global_batch is not None
    if global_batch is None:
        global_batch = 8 * hw.gpus
        notes.append(f"global batch {global_batch} (8 sequences per GPU; set --global-batch)")
    if global_batch < 1:
        raise DuokaError(f"--global-batch {global_batch} must be >= 1")
    if micro_batch is not None and micro_batch < 1:
        raise DuokaError(f"--micro-batch {micro_batch} must be >= 1")
    chosen = optimizer or ADAMW
    if chosen.offloaded and hw.gpus > 1:
        raise DuokaError(f"offload=cpu runs on one GPU: torchao's CPUOffloadOptimizer copies each gradient to the "
                         f"host as backward produces it, before any data-parallel reduction (its docstring: "
                         f"\"for single-GPU training\"), and this plan is for {hw.gpus} GPUs",
                         "on several GPUs shard the state instead (FSDP, which the plan considers; drop --offload) "
                         "or use an optimizer with less state (--optimizer adamw8bit)")
    notes += hardware_notes(hw)
    layouts = enumerate_layouts(args, hw.gpus, hw.gpus_per_node)
    pinned = {"micro_batch": micro_batch, "activation_checkpointing": activation_checkpointing}
    candidates = evaluate(args, hw, seq_len, global_batch, layouts, chosen, **pinned)
    if not candidates:
        sizes = sorted({lay.dp_size for lay in layouts})
        if micro_batch is not None and any(global_batch % d == 0 for d in sizes):
            shares = sorted({global_batch // d for d in sizes if global_batch % d == 0})
            raise DuokaError(f"--micro-batch {micro_batch} divides none of the per-GPU batches "
                             f"({', '.join(map(str, shares))}) that --global-batch {global_batch} gives on {hw.gpus} "
                             "GPUs", "use a divisor of one of them, or a --global-batch that it divides")
        raise DuokaError(f"--global-batch {global_batch} splits over none of the data-parallel sizes the layouts of "
                         f"{hw.gpus} GPUs have ({', '.join(map(str, sizes))})",
                         f"use a multiple of {hw.gpus}, e.g. --global-batch {hw.gpus * max(1, global_batch // hw.gpus)}")
    ranked = rank(candidates)
    proposal, alternatives = "", []
    if not ranked:
        fitting = _fitting_optimizers(args, hw, seq_len, global_batch, layouts, chosen, pinned)
        alternatives = [rank(c)[0] for c in fitting.values()]
        if optimizer is not None or not alternatives:
            raise _does_not_fit(model, hw, seq_len, candidates, max(1, global_batch // hw.gpus) if asked_batch else 1,
                                chosen, alternatives)
        adamw_candidates = candidates
        chosen = alternatives[0].optimizer
        candidates = fitting[chosen]
        ranked = rank(candidates)
        proposal = _proposal(hw, adamw_candidates, alternatives, tried=[o for o in PROPOSAL_ORDER
                                                                        if hw.gpus == 1 or not o.offloaded])
    rejected = _best_per_layout([c for c in candidates if not c.fits], key=lambda c: c.memory.reserved)
    rejected = [c for c in rejected if c.layout not in {r.layout for r in ranked}]
    best = ranked[0]
    if best.layout.fsdp and best.layout.pp == 1 and best.accumulation > 1 and best.layout.dp_shard > 1:
        notes.append(f"gradient accumulation under fsdp: the trainer skips the reduce-scatter between "
                     f"micro-batches, so each GPU holds unsharded fp32 gradients ({_gib(best.memory.gradients)} GiB "
                     "of its peak); --parallel.reduce_every_microbatch=true shards them (more reduce-scatter "
                     "traffic; this estimate does not include that saving), and a step without accumulation "
                     "(micro-batch = per-rank batch) does not hold them")
    if chosen.offloaded:
        limit = ("unchecked: give --host-memory GiB per GPU" if hw.host_memory_gib is None else
                 f"within {_gib(hw.usable_host_bytes)} of {hw.host_memory_gib:g} GiB usable "
                 f"({HOST_USABLE_FRACTION:.0%})")
        notes.append(f"host memory for the offloaded AdamW: {_gib(best.memory.host)} GiB per GPU, half of it pinned "
                     f"(fp32 weights and gradients; {limit}); its step runs on the host, which the step time counts")
    # Switches the ranking does not model: measured on 2 x H200 (docs/performance.md).
    speed = ("training.compile (on by default on GPUs; false turns it off): 1.65x eager for 0.5B under DDP, faster "
             "in every DDP and FSDP2 case measured (not yet measured under tp or pp), and no more memory than "
             "estimated")
    if args.num_params() >= 1e9:
        speed += ("; training.float8=tensorwise on GPUs of compute capability 8.9+: +14% (1.5B) to +30% (7B) "
                  "measured, not bit-equal to bf16 (compare the loss curve)")
    notes.append("speed switches this plan does not model: " + speed)
    return Plan(model, hw, seq_len, global_batch, ranked, sorted(rejected, key=lambda c: simplicity(c.layout)),
                explain(ranked, rejected, hw), len(candidates), notes, chosen, proposal, alternatives)


def _fitting_optimizers(args: ModelArgs, hw: Hardware, seq_len: int, global_batch: int, layouts: list[Layout],
                        tried: OptimizerChoice, pinned: dict) -> dict[OptimizerChoice, list[Candidate]]:
    """The candidates of every optimizer of PROPOSAL_ORDER (but `tried`) with which some
    layout fits, in that order; offload only on one GPU."""
    out = {}
    for opt in PROPOSAL_ORDER:
        if opt == tried or (opt.offloaded and hw.gpus > 1):
            continue
        candidates = evaluate(args, hw, seq_len, global_batch, layouts, opt, **pinned)
        if any(c.fits for c in candidates):
            out[opt] = candidates
    return out


def _proposal(hw: Hardware, adamw: list[Candidate], alternatives: list[Candidate],
              tried: list[OptimizerChoice]) -> str:
    """Why the plan trains with another optimizer than AdamW, and how to select it."""
    smallest = min(adamw, key=lambda c: c.memory.reserved)
    first = alternatives[0]
    return (f"AdamW does not fit (at least {_gib(smallest.memory.reserved)} GiB reserved per GPU, "
            f"{smallest.describe()}; {_gib(hw.usable_bytes)} usable): planned with {first.optimizer.describe()}, "
            f"set {_keys(first.optimizer)}. Tried in the order {', '.join(o.describe() for o in tried)}: AdamW's "
            "update with less state first, then Adafactor, Muon and SGD, which change the update (compare the loss "
            "curve)")


def _keys(opt: OptimizerChoice) -> str:
    return ", ".join(f"optimizer.{k} = {_toml_value(v)}" for k, v in opt.config().items())


def minimum_gpus(args: ModelArgs, hw: Hardware, seq_len: int, per_gpu_batch: int = 1,
                 optimizer: OptimizerChoice = ADAMW) -> tuple[int, int, Hardware, Candidate] | None:
    """(GPUs, global batch, the hardware, the best candidate there) for the fewest GPUs of
    this memory size on which some layout fits, with per_gpu_batch sequences per GPU (1, the
    least memory, unless the user asked for a batch). Searches whole nodes of the same
    size (nodes of 8 for a machine with fewer GPUs); None when even MAX_GPUS_SEARCHED do
    not do. An offloaded optimizer runs on one GPU: the search is without offload."""
    if optimizer.offloaded:
        optimizer = ADAMW
    node = max(hw.gpus_per_node, 8)
    floor = math.ceil(state_bytes(args, optimizer) / hw.usable_bytes)  # the state alone, spread perfectly
    counts = [n for n in (2, 4) if n < node] + list(range(node, MAX_GPUS_SEARCHED + 1, node))
    for n in counts:
        if n <= hw.gpus or n < floor:
            continue
        trial = replace(hw, gpus=n, nodes=max(1, n // node), detected=())
        batch = n * per_gpu_batch
        fitting = [c for c in evaluate(args, trial, seq_len, batch, optimizer=optimizer) if c.fits]
        if fitting:
            return n, batch, trial, rank(fitting)[0]
    return None


def _does_not_fit(model: ModelChoice, hw: Hardware, seq_len: int, candidates: list[Candidate],
                  per_gpu_batch: int, optimizer: OptimizerChoice = ADAMW,
                  alternatives: list[Candidate] | None = None) -> DuokaError:
    args = model.args
    smallest = min(candidates, key=lambda c: c.memory.reserved)
    state = state_bytes(args, optimizer)
    per_param = state / args.num_params()
    per_param_text = f"{per_param:.0f}" if abs(per_param - round(per_param)) < 0.05 else f"{per_param:.1f}"
    which = "AdamW" if optimizer == ADAMW else optimizer.describe()
    host = (f" (and {_gib(smallest.memory.host)} GiB of host memory against {_gib(hw.usable_host_bytes)} usable)"
            if smallest.memory.host > hw.usable_host_bytes else "")
    cause = (f"{model.label} ({args.num_params() / 1e9:.1f}B parameters) does not fit on {hw.gpus} x "
             f"{hw.gpu_memory_gib:g} GiB in any layout: the smallest estimate is {_gib(smallest.memory.reserved)} GiB "
             f"reserved ({_gib(smallest.memory.allocated)} allocated) per GPU ({smallest.describe()}) against "
             f"{_gib(hw.usable_bytes)} GiB usable{host}; weights, gradients "
             f"and {which} state alone are {args.num_params() / 1e9:.1f}B x {per_param_text} bytes = "
             f"{state / 1e12:.2f} TB ({state / GIB:.0f} GiB) over all GPUs")
    fixes = []
    if alternatives:
        c = alternatives[0]
        fixes.append(f"an optimizer with less state fits: {c.optimizer.describe()} ({c.describe(optimizer=False)}: "
                     f"{_gib(c.memory.reserved)} GiB reserved per GPU; set {_keys(c.optimizer)}, or leave --optimizer "
                     "out to let the plan choose)")
    found = minimum_gpus(args, hw, seq_len, per_gpu_batch, optimizer)
    if found is None:
        fixes.append(f"no layout fits even on {MAX_GPUS_SEARCHED} GPUs of {hw.gpu_memory_gib:g} GiB at seq {seq_len} "
                     f"with {per_gpu_batch} sequence(s) per GPU: use a shorter --seq or GPUs with more memory")
    else:
        n, batch, trial, c = found
        nodes = f" ({trial.nodes} nodes of {trial.gpus_per_node})" if trial.nodes > 1 else ""
        opt_flag = "" if c.optimizer == ADAMW else f" --optimizer {c.optimizer.name}"
        fixes.append(f"use at least {n} GPUs of {hw.gpu_memory_gib:g} GiB{nodes}: there {c.describe()} needs "
                     f"{_gib(c.memory.reserved)} GiB per GPU at global batch {batch} (duoka plan --model {model.label} "
                     f"--gpus {n}{f' --nodes {trial.nodes}' if trial.nodes > 1 else ''} --gpu-memory "
                     f"{hw.gpu_memory_gib:g} --seq {seq_len} --global-batch {batch}{opt_flag}); or GPUs with more "
                     "memory")
    return DuokaError(cause, "; or ".join(fixes))


# ---------------------------------------------------------------- output


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def plan_toml(plan: Plan) -> str:
    """The recommendation as a config for `duoka train` (the names of duoka.config)."""
    c, hw = plan.best, plan.hardware
    lay = c.layout
    launch = f"--nproc-per-node {hw.gpus_per_node}"
    if hw.nodes > 1:
        launch += f" --nnodes {hw.nodes} --node-rank R --rdzv-endpoint HOST:PORT"
    lines = [(f"# duoka plan: {plan.model.label} on {hw.describe()}, seq {plan.seq_len}, "
              f"global batch {plan.global_batch}"),
             f"# {c.describe()}; accumulation {c.accumulation}",
             *([f"# optimizer {plan.optimizer.describe()}: AdamW does not fit (duoka plan's proposal)"]
               if plan.proposal else []),
             (f"# estimated peak per GPU: {_gib(c.memory.allocated)} GiB allocated, {_gib(c.memory.reserved)} GiB "
              f"reserved, of {hw.gpu_memory_gib:g} GiB"),
             f"# duoka train THIS.toml {launch}", ""]
    sections: dict[str, dict] = {"model": dict(plan.model.config)}
    if "flavor" in plan.model.config and plan.model.config["flavor"] != "debug":
        lines[-1:-1] = ["# A flavor trains from scratch, here on random tokens: set data.path to your corpus",
                        "# and model.tokenizer to a Qwen2 tokenizer folder, or model.path to a checkpoint."]
        sections["data"] = {"path": "random"}
    sections["training"] = {"seq_len": plan.seq_len, "global_batch_size": plan.global_batch,
                            "micro_batch_size": c.micro_batch,
                            "activation_checkpointing": "full" if c.activation_checkpointing else "none",
                            "dtype": "bf16"}
    par = {"dp_mode": lay.dp_mode, "dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp,
           "pp": lay.pp}
    if lay.fsdp and not lay.reshard_after_forward:
        par["reshard_after_forward"] = False
    if lay.pp > 1:
        par.update(pp_schedule=lay.pp_schedule, pp_stages_per_rank=lay.stages_per_rank, pp_layers="even",
                   pp_microbatches=c.accumulation)
    sections["parallel"] = par
    if plan.optimizer != ADAMW:
        sections["optimizer"] = plan.optimizer.config()
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def _layout_table(plan: Plan, top: int, compact: bool):
    """The ranked layouts, one row each; compact: short headers and names, no vertical rules."""
    from rich import box
    from rich.table import Table

    if compact:
        table = Table(title="layouts that fit, best first", title_justify="left", box=box.SIMPLE_HEAD,
                      show_edge=False, padding=(0, 1, 0, 0))
        headers = ("#", "layout", "micro", "acc", "AC", "GiB", "resv", "rel", "tok/s")
    else:
        table = Table(title="layouts that fit, best first", title_justify="left")
        headers = ("#", "layout", "micro-batch", "accum.", "AC", "peak GiB/GPU", "reserved", "rel. step time",
                   "est. tok/s/GPU")
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i in (1, 4) else "right", no_wrap=i == 1)
    fastest = plan.fastest_s
    for i, c in enumerate(plan.ranked[:top], 1):
        table.add_row(str(i), c.layout.describe(compact), str(c.micro_batch), str(c.accumulation),
                      "full" if c.activation_checkpointing else "-", _gib(c.memory.allocated), _gib(c.memory.reserved),
                      f"{c.time.total_s / fastest:.2f}", f"{c.time.tokens_per_s_per_gpu:,.0f}",
                      style="bold green" if i == 1 else None)
    return table


def _alternatives_table(plan: Plan):
    """The first layout of every optimizer that fits, in the order the plan tried them."""
    from rich import box
    from rich.table import Table

    table = Table(title="optimizers that fit (the first layout of each)", title_justify="left",
                  box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    for i, header in enumerate(("optimizer", "layout", "micro", "AC", "GiB", "resv", "host", "tok/s/GPU")):
        table.add_column(header, justify="left" if i in (0, 1, 3) else "right", no_wrap=i < 2)
    for c in plan.alternatives:
        table.add_row(c.optimizer.describe(), c.layout.describe(compact=True), str(c.micro_batch),
                      "full" if c.activation_checkpointing else "-", _gib(c.memory.allocated),
                      _gib(c.memory.reserved), _gib(c.memory.host) if c.memory.host else "-",
                      f"{c.time.tokens_per_s_per_gpu:,.0f}", style="bold green" if c is plan.alternatives[0] else None)
    return table


def render(plan: Plan, console, top: int = 10) -> None:
    """The plan as rich tables: ranked layouts, the first one's memory, why, the config."""
    from rich.table import Table

    hw, best = plan.hardware, plan.best
    args = plan.model.args
    detected = f" (detected: {', '.join(plan.hardware.detected)})" if hw.detected else ""
    optimizer = f"; optimizer {plan.optimizer.describe()}" if plan.optimizer != ADAMW else ""
    console.print(f"[bold]{plan.model.label}[/] ({args.num_params() / 1e9:.2f}B parameters) on {hw.describe()}"
                  f"{detected}; seq {plan.seq_len}, global batch {plan.global_batch}{optimizer}; {plan.considered} "
                  f"combinations estimated, {len(plan.ranked)} layouts fit in {_gib(hw.usable_bytes)} GiB usable")
    if plan.proposal:
        console.print(f"[bold]optimizer:[/] {plan.proposal}")
        console.print(_alternatives_table(plan))
    wide = _layout_table(plan, top, compact=False)
    # The full table where the terminal holds it; else short headers and names, one line per
    # layout (rich would break the names and headers over several lines to fit).
    natural = console.measure(wide, options=console.options.update(max_width=10_000)).maximum
    table = wide if natural <= console.width else _layout_table(plan, top, compact=True)
    console.print(table)
    if len(plan.ranked) > top:
        console.print(f"  ... and {len(plan.ranked) - top} more (--json lists all)")
    if table is not wide:
        console.print("[dim]micro: micro-batch, acc: accumulation steps, AC: activation checkpointing, GiB: est. "
                      "peak allocated per GPU, resv: reserved, rel: step time relative to the fastest, tok/s: est. "
                      "per GPU (a wider terminal shows the full table)[/]")

    mem = Table(title=f"memory per GPU of #1 (peak at: {best.memory.phase}"
                      f"{f', pipeline rank {best.memory.pp_rank}' if best.layout.pp > 1 else ''})",
                title_justify="left")
    mem.add_column("part")
    mem.add_column("GiB", justify="right")
    labels = {"parameters": "fp32 weights", "gradients": "fp32 gradients", "optimizer": plan.optimizer.state_label(),
              "gathered_parameters": "bf16 weights (gathered / cast)", "activations": "activations",
              "logits": "logits + cross-entropy", "communication": "communication buffers",
              "optimizer_step": "optimizer step's temporaries"}
    for key, value in best.memory.parts().items():
        if key != "optimizer_step" or value:
            mem.add_row(labels[key], _gib(value))
    mem.add_row("[bold]peak allocated[/] (torch max_memory_allocated)", f"[bold]{_gib(best.memory.allocated)}[/]")
    mem.add_row("reserved (+ fragmentation, CUDA context, NCCL)", _gib(best.memory.reserved))
    if best.memory.host:
        mem.add_row("host memory (offloaded state, pinned weights and gradients)", _gib(best.memory.host))
    console.print(mem)
    console.print(f"[bold]why first:[/] {plan.why}")
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/]")
    console.print("[bold]config[/] (write it with --out FILE):")
    console.print(plan.config_toml(), markup=False, highlight=False, soft_wrap=True)
