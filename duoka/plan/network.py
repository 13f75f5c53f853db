"""What a collective costs on the GPUs of a plan: the links inside a node and across nodes,
and the alpha-beta time of the ring and tree collectives NCCL runs over them.

A collective of n ranks over N nodes, g = n / N of them on each node, moving S bytes (the
full tensor: the gathered output of an all-gather, the input of a reduce-scatter, the
buffer of an all-reduce) takes

    all-gather, reduce-scatter (ring):  (n-1)/n · S / B  +  a0 + (n-N)·a_nv + (N-1)·a_net
    all-reduce (ring):                2·(n-1)/n · S / B  +  a0 + 2·(n-N)·a_nv + 2·(N-1)·a_net
    all-reduce (double binary tree):  2·(n-1)/n · S / B  +  a0 + 2·((g-1)·t_nv + ceil(log2 N)·t_net)
    send to the next pipeline stage:                S / B_link + a0 + a_link
    all-to-all (pairwise exchange):   max((g-1)/n · S / B_intra, (n-g)/n · S / B_inter)
                                      +  a0 + (n-N)·a_nv + (N-1)·a_net

with B the group's bus bandwidth per GPU: the link inside a node when N = 1, else
min(B_intra, g · B_inter). A ring crosses each node boundary once per channel and carries
the same bytes on that hop as on every NVLink hop; NCCL spreads its channels over the
node's NICs, so g members of a group on one node pull through g NICs (one per GPU on
rail-optimised clusters), and the network limits the ring only when g · B_inter < B_intra.
A group with one member per node (HSDP's replica all-reduce, FSDP across nodes under tp 8,
pipeline sends) gets one NIC: B_inter. This is NCCL's own model (src/graph/tuning.cc:
busBw of a multi-node ring = channels x per-channel speed; latency = baseLat + (nsteps -
nInterSteps)·intraLat + nInterSteps·interLat for rings, 2·((ranks/nodes - 1)·intraLat +
log2(nodes)·interLat) for trees; NCCL picks the faster per call, so all-reduce takes the
smaller latency) and the textbook alpha-beta cost of Thakur, Rabenseifner & Gropp 2005,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 19(1)).

An all-to-all (expert parallelism's token dispatch; S: the bytes each rank sends, its own
part included) is NCCL's grouped point-to-point sends, one to every other rank: the
pairwise exchange of Thakur et al. (section 5), whose n-1 steps the ring's latency stands
for. Each rank's parts for its node's other ranks go over the node's link, its parts for
other nodes through its own NIC, both at once; nothing crosses a node boundary twice.

Not modelled: NCCL's PAT all-gather/reduce-scatter (2.23+, one GPU per node) and NVLS /
SHARP in-network reduction (faster than this on clusters that have them), congestion in
an oversubscribed spine, and the SMs NCCL's kernels take from overlapped compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from duoka.errors import DuokaError

GBIT = 1e9 / 8  # bytes/s in one Gb/s

# ---- inside a node: NCCL bus bandwidth per GPU (what nccl-tests' all_reduce_perf reports)
# NVLink 4 (H100/H200 SXM) is 450 GB/s per direction; a 1 GiB all-reduce reaches ~320 GB/s bus
# bandwidth on the lent 2 x H200 (`duoka doctor --bench` read 319, bench/results/doctor/README.md),
# so 350 is a fair planning figure. PCIe 4.0 x16 is
# 32 GB/s raw, ~25 achieved; collectives through the host bridge get no more.
INTRA_BYTES_PER_S = {"nvlink": 350e9, "pcie": 25e9}
INTERCONNECTS = ("nvlink", "pcie", "ib")  # ib: no peer link, GPUs of a node talk through the NIC

# ---- latencies, from NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc, the Simple
# protocol that carries large messages): one collective's launch (baseLat, ring) and one ring
# step over NVLink, PCIe or the network (hwLat, ring); one tree hop (hwLat, tree: a 256 kB
# chunk's latency). The network values stand for RDMA NICs (InfiniBand, RoCE); NCCL's model
# has no separate figure for TCP sockets.
BASE_LATENCY_S = 8.4e-6
RING_STEP_S = {"nvlink": 3.4e-6, "pcie": 5.7e-6, "net": 9.6e-6}
TREE_STEP_S = {"nvlink": 28e-6, "pcie": 28e-6, "net": 50e-6}

# Fraction of a NIC's line rate NCCL's bus bandwidth reaches: ~90% over RDMA (GPUDirect;
# packet headers and NCCL's framing take the rest). Over TCP sockets NCCL copies through host
# memory and threads; 80% of a 100-400 GbE link with tuned NCCL_SOCKET_NTHREADS x
# NCCL_NSOCKS_PERTHREAD is assumed here, not measured.
RDMA_EFFICIENCY = 0.9
SOCKET_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Network:
    """The fabric between nodes: its NICs and how NCCL drives them."""

    name: str
    nic_gbps: float  # line rate of one NIC
    per_gpu: bool  # one NIC per GPU (rail-optimised, as in DGX/HGX systems), else one per node
    rdma: bool  # GPUDirect RDMA (InfiniBand, RoCE); False: NCCL's TCP socket transport
    what: str

    @property
    def efficiency(self) -> float:
        return RDMA_EFFICIENCY if self.rdma else SOCKET_EFFICIENCY

    def gbps_per_gpu(self, gpus_per_node: int) -> float:
        return self.nic_gbps if self.per_gpu else self.nic_gbps / gpus_per_node


NETWORKS = {n.name: n for n in (
    Network("ib-ndr", 400, True, True, "InfiniBand NDR, a 400 Gb/s NIC per GPU as in DGX/HGX H100 and H200"),
    Network("ib-hdr", 200, True, True, "InfiniBand HDR, a 200 Gb/s NIC per GPU as in DGX A100"),
    Network("roce-400", 400, True, True, "RoCE, a 400 Gb/s NIC per GPU as in Meta's Grand Teton or AWS p5"),
    Network("roce-200", 200, True, True, "RoCE, a 200 Gb/s NIC per GPU"),
    Network("eth-400", 400, False, False, "one 400 GbE NIC per node, TCP sockets, no RDMA"),
    Network("eth-200", 200, False, False, "one 200 GbE NIC per node, TCP sockets, no RDMA"),
    Network("eth-100", 100, False, False, "one 100 GbE NIC per node, TCP sockets, no RDMA"),
)}
DEFAULT_NETWORK = "ib-ndr"  # what H100/H200 training clusters are built with


def preset(name: str) -> Network:
    if name not in NETWORKS:
        raise DuokaError(f"--network {name} is unknown",
                         f"use one of {', '.join(NETWORKS)}, or give the NIC speed per GPU with --inter-bw Gb/s")
    return NETWORKS[name]


@lru_cache(maxsize=4096)
def group_shape(size: int, stride: int, gpus_per_node: int) -> tuple[int, int]:
    """(nodes, members per node) of a process group of `size` ranks `stride` apart (a mesh
    dimension: its inner dimensions' sizes multiplied), starting at rank 0 and with the
    ranks of a node consecutive. Every group of that dimension has the same shape."""
    nodes = len({k * stride // gpus_per_node for k in range(size)})
    return nodes, math.ceil(size / nodes)


@dataclass(frozen=True)
class Fabric:
    """The links of a cluster of identical nodes, and what collectives cost over them.
    Bandwidths are bytes/s per GPU (bus bandwidth), latencies seconds."""

    gpus_per_node: int
    intra_bytes_per_s: float  # inside a node
    inter_bytes_per_s: float  # across nodes, per GPU, as NCCL reaches it
    intra_step_s: float  # one ring step inside a node
    inter_step_s: float  # one ring step across nodes
    intra_tree_s: float
    inter_tree_s: float
    base_s: float = BASE_LATENCY_S

    def bus_bandwidth(self, nodes: int, per_node: int) -> float:
        if nodes == 1:
            return self.intra_bytes_per_s
        return min(self.intra_bytes_per_s, per_node * self.inter_bytes_per_s)

    def _shape(self, size: int, stride: int) -> tuple[int, int]:
        return group_shape(size, stride, self.gpus_per_node)

    def ring_latency_s(self, size: int, stride: int, passes: int = 1) -> float:
        nodes, _ = self._shape(size, stride)
        return self.base_s + passes * ((size - nodes) * self.intra_step_s + (nodes - 1) * self.inter_step_s)

    def tree_latency_s(self, size: int, stride: int) -> float:
        nodes, per_node = self._shape(size, stride)
        return self.base_s + 2 * ((per_node - 1) * self.intra_tree_s
                                  + math.ceil(math.log2(nodes)) * self.inter_tree_s)

    def all_gather_s(self, nbytes: float, size: int, stride: int = 1) -> float:
        """Ring all-gather of a tensor of `nbytes` (gathered) over `size` ranks `stride` apart;
        a reduce-scatter of an `nbytes` input costs the same."""
        if size <= 1:
            return 0.0
        nodes, per_node = self._shape(size, stride)
        return (size - 1) / size * nbytes / self.bus_bandwidth(nodes, per_node) + self.ring_latency_s(size, stride)

    reduce_scatter_s = all_gather_s

    def all_reduce_s(self, nbytes: float, size: int, stride: int = 1) -> float:
        """All-reduce of `nbytes`: the ring's bandwidth term, and the smaller of the ring's
        and the tree's latency (NCCL picks per call; the tree wins across many nodes)."""
        if size <= 1:
            return 0.0
        nodes, per_node = self._shape(size, stride)
        latency = min(self.ring_latency_s(size, stride, passes=2), self.tree_latency_s(size, stride))
        return 2 * (size - 1) / size * nbytes / self.bus_bandwidth(nodes, per_node) + latency

    def all_to_all_s(self, nbytes: float, size: int, stride: int = 1) -> float:
        """All-to-all over `size` ranks `stride` apart in which each rank sends `nbytes` in all,
        an equal part to every rank (its own included, which does not move)."""
        if size <= 1:
            return 0.0
        nodes, per_node = self._shape(size, stride)
        inside = (per_node - 1) / size * nbytes / self.intra_bytes_per_s
        across = (size - per_node) / size * nbytes / self.inter_bytes_per_s if nodes > 1 else 0.0
        return max(inside, across) + self.ring_latency_s(size, stride)

    def send_s(self, nbytes: float, crosses_nodes: bool) -> float:
        """One point-to-point send (pipeline stages): one GPU's link, one step."""
        if crosses_nodes:
            return nbytes / self.inter_bytes_per_s + self.base_s + self.inter_step_s
        return nbytes / self.intra_bytes_per_s + self.base_s + self.intra_step_s


def make_fabric(gpus_per_node: int, interconnect: str, net: Network, intra_bytes_per_s: float | None = None,
                inter_gbps: float | None = None, inter_step_s: float | None = None) -> Fabric:
    """The fabric of `--interconnect`, `--network` and their overrides: --intra-bw (bus
    bandwidth in bytes/s, taken as measured), --inter-bw (NIC line rate per GPU in Gb/s; the
    network's efficiency applies), --inter-latency-us (one ring step across nodes)."""
    inter = (inter_gbps if inter_gbps is not None else net.gbps_per_gpu(gpus_per_node)) * GBIT * net.efficiency
    if interconnect == "ib":  # no peer link: GPUs of one node reach each other through the NIC too
        intra, hw = inter, "net"
    else:
        intra, hw = INTRA_BYTES_PER_S[interconnect], interconnect
    if intra_bytes_per_s is not None:
        intra = intra_bytes_per_s
    step = inter_step_s if inter_step_s is not None else RING_STEP_S["net"]
    # Trees pay per hop what a ring step pays, scaled as in NCCL's table (50 us against 9.6).
    tree = TREE_STEP_S["net"] * step / RING_STEP_S["net"]
    return Fabric(gpus_per_node, intra, inter, RING_STEP_S[hw], step, TREE_STEP_S[hw], tree)
