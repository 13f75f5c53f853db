"""The step-time model of `duoka plan`: seconds per optimizer step on one GPU for a layout,
micro-batch and activation checkpointing (`estimate_step_time`), by cause (`StepTime`).

Cost model of one optimizer step on one GPU (relative times are what it is for; the
absolute figure assumes a well-fed GPU and is no benchmark):
- compute: training FLOPs (PaLM's 6·N + 12·L·H·S per token, its appendix B) of the work this
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
  (duoka.plan.optimizer_costs: step_seconds, with its constants and their sources);
- mixture of experts (duoka.plan.moe): compute from the active weights (6 x the matmul
  weights a token passes through: its top-k experts, not all of them); under ep, per MoE
  layer and micro-batch 4 all-to-alls (6 under checkpointing) of each token's k copies
  (k x dim bf16), on the critical path like tp's collectives, plus the size exchange before
  each dispatch (latency only); each layer's experts are an FSDP2 unit of their own whose
  all-gather and reduce-scatter carry num_experts / ep experts over the dp_shard / ep ranks
  holding them. The experts' grouped GEMMs are costed at the dense matmuls' efficiency, and
  routing is taken as balanced (the slowest expert rank waits for no one): neither is
  measured yet;
- context parallelism (duoka.plan.context): a rank computes seq / cp tokens of each sequence,
  each attending over the whole sequence (the chunk layout balances causal attention), so
  its compute is 1 / cp of a sequence's; per layer and micro-batch, 4 all-gathers or
  reduce-scatters of the whole sequence's keys or values over the cp neighbours (6 under
  checkpointing), or by Ulysses 2 all-to-alls of the rank's tokens' q/k/v and output forward,
  2 backward (3 and 3 under checkpointing), on the critical path. FSDP2 shards over all of
  dp_shard as without cp.
Ignored: kernel contention between NCCL and compute, CPU launch overhead of tiny models,
data loading, stragglers and failures (which grow with the job: see
duoka.plan.hardware.CHECKED_GPUS). GEMM_EFFICIENCY, TP_BLOCK_OVERHEAD_S and FSDP_UNIT_S are
duoka's kernels, duoka.plan.hardware.Kernels' defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from duoka.models.qwen2.args import ModelArgs
from duoka.plan.context import check_context, context_traffic_s
from duoka.plan.hardware import Hardware
from duoka.plan.layouts import crosses_nodes, mesh_strides
from duoka.plan.memory import Layout, auto_blocks_per_unit, block_params, stage_layer_counts
from duoka.plan.moe import ALL_TO_ALLS, ALL_TO_ALLS_CHECKPOINTED, check_moe_layout, dispatch_bytes, expert_split, is_moe
from duoka.plan.optimizer_costs import ADAMW, OptimizerChoice, rank_footprint, step_seconds

HALF_SPEED_ELEMENTS = 2**20  # micro-batch x seq x dim/tp at which the matmul efficiency halves
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
    expert_parallel_s: float = 0.0  # a MoE model's token all-to-alls under ep (on the critical path)
    context_parallel_s: float = 0.0  # cp's exchanges: K/V all-gathers and reduce-scatters, or all-to-alls (critical path)

    def overheads(self) -> dict[str, float]:
        """Seconds of the step beyond the matmuls, by cause (what limits scaling)."""
        return {"dp comm": self.exposed_dp_s, "tp": self.tensor_parallel_s, "pp bubble": self.bubble_s,
                "pp sends": self.pipeline_p2p_s, "fsdp hooks": self.fsdp_overhead_s, "optimizer": self.optimizer_s,
                "ep all-to-all": self.expert_parallel_s, "cp exchange": self.context_parallel_s}

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
    """(training FLOPs per token of the busiest pipeline rank, of the whole model). A MoE
    model's layers count their active matmul weights (top-k experts), averaged over layers."""
    if is_moe(args):
        block_mm = (args.matmul_params() - args.vocab_size * args.dim) / args.n_layers
    else:
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


def _exposed(traffic: float, window: float, units: int) -> float:
    """Seconds of `traffic` (split into `units` equal collectives) that compute does not
    hide: the first (or last) unit's share waits with nothing to overlap it; the rest runs
    beside the `window` of compute and shows where it outlasts it."""
    if traffic <= 0:
        return 0.0
    return traffic / units + max(0.0, traffic * (1 - 1 / units) - window)


@dataclass(frozen=True)
class _MicroBatch:
    """One micro-batch on the busiest pipeline rank: seconds of each part, and the layers
    and FSDP units it runs through."""

    compute_s: float  # matmuls and attention
    tp_s: float  # tp collectives and the tp implementation's overhead
    fsdp_s: float  # FSDP's per-unit cost (hooks, copies, stream waits)
    rank_layers: int  # decoder layers this rank runs per micro-batch (for per-layer costs)
    units: int  # FSDP units of those layers, the root (embedding, final norm, head) included
    ep_s: float = 0.0  # a MoE model's token all-to-alls
    cp_s: float = 0.0  # cp's exchanges (key/value all-gathers and reduce-scatters, or Ulysses' all-to-alls)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.tp_s + self.fsdp_s + self.ep_s + self.cp_s


def _micro_batch(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, ac: bool, busiest: float,
                 hw: Hardware) -> _MicroBatch:
    """The busiest rank's time for one micro-batch, `busiest` its training FLOPs per token
    (under cp, of its seq_len / cp tokens of each sequence)."""
    tp, pp, v = layout.tp, layout.pp, layout.stages_per_rank
    kern, fab = hw.kernels, hw.fabric
    tokens_mb = micro_batch * seq_len // layout.cp
    elements = tokens_mb * args.dim / tp
    efficiency = kern.gemm_efficiency * elements / (elements + HALF_SPEED_ELEMENTS)
    compute_mb = tokens_mb * busiest / tp / (hw.peak_flops * efficiency)

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
    if layout.ep > 1:  # each MoE layer's experts are an FSDP2 unit of their own (on the expert mesh)
        units += len(args.moe_layers)
    fsdp_mb = kern.fsdp_unit_s * passes * units if layout.fsdp else 0.0
    # cp groups are neighbouring dp_shard ranks (duoka.parallel.dims.context_mesh)
    cp_mb = context_traffic_s(args, layout.cp, micro_batch, seq_len, ac, fab, mesh_strides(layout)["dp_shard"],
                              layout.cp_method)
    return _MicroBatch(compute_mb, tp_mb, fsdp_mb, rank_layers, units, _all_to_all_mb(args, layout, tokens_mb, ac, hw),
                       cp_mb)


def _all_to_all_mb(args: ModelArgs, layout: Layout, tokens_mb: int, ac: bool, hw: Hardware) -> float:
    """A micro-batch's token all-to-alls under ep: per MoE layer, ALL_TO_ALLS of its tokens'
    k copies over the ep neighbours (ALL_TO_ALLS_CHECKPOINTED when the forward is recomputed),
    and the split sizes' exchange before each forward dispatch (latency only)."""
    if layout.ep == 1 or not is_moe(args):
        return 0.0
    fab, stride = hw.fabric, mesh_strides(layout)["dp_shard"]  # ep groups: neighbouring dp_shard ranks
    rows = fab.all_to_all_s(dispatch_bytes(args, tokens_mb), layout.ep, stride)
    sizes = fab.all_to_all_s(0.0, layout.ep, stride)
    per_layer = (ALL_TO_ALLS_CHECKPOINTED if ac else ALL_TO_ALLS) * rows + (2 if ac else 1) * sizes
    return len(args.moe_layers) * per_layer


def _local_params(args: ModelArgs, layout: Layout, rank_layers: int) -> tuple[float, float]:
    """(parameters this rank holds after tp/pp (the largest pipeline rank), before dp
    sharding, that FSDP2 shards over dp_shard; a MoE model's routed experts under ep > 1,
    num_experts / ep of each layer, which it shards over the dp_shard / ep ranks holding them)."""
    if is_moe(args):  # no tp or pp (check_moe_layout): every layer, the embedding and the head
        split = expert_split(args)
        root = args.vocab_size * args.dim * (1 if args.tie_word_embeddings else 2) + args.dim
        rest = split.blocks - split.experts + root
        return (rest + split.experts, 0.0) if layout.ep == 1 else (rest, split.experts / layout.ep)
    tp = layout.tp
    p_block, p_block_tp, _ = block_params(args)
    block_local = p_block_tp / tp + (p_block - p_block_tp)
    vocab_rows = args.vocab_size * args.dim / tp
    return rank_layers * block_local + (2 * vocab_rows if layout.pp == 1 and not args.tie_word_embeddings
                                        else vocab_rows), 0.0


@dataclass(frozen=True)
class _Collectives:
    """A rank's data-parallel collectives, in seconds: one forward (or backward) pass's
    all-gathers of the weights, and the gradients' reduction, each with its latency part."""

    gather_s: float
    reduce_s: float
    gather_latency_s: float
    reduce_latency_s: float
    units: int  # equal collectives each is split into: FSDP units, or DDP's buckets
    across_nodes: bool  # some dp group spans nodes


def _dp_collectives(layout: Layout, local: float, fsdp_units: int, hw: Hardware, experts: float = 0.0,
                    expert_units: int = 0) -> _Collectives:
    """DDP: fp32 gradients all-reduced in DDP_LAUNCH_BUCKET_BYTES launches. FSDP: per unit,
    an all-gather of its bf16 weights and a reduce-scatter of its fp32 gradients; HSDP adds
    the shards' all-reduce across replicas. `experts` (a MoE model under ep > 1): the routed
    experts' `expert_units` units (of fsdp_units) do the same over the dp_shard / ep ranks."""
    fab, stride, gpn = hw.fabric, mesh_strides(layout), hw.gpus_per_node
    units = fsdp_units
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
        n = units - expert_units  # the units sharded over dp_shard
        if s > 1:  # per unit: all-gather its bf16 weights; reduce-scatter its fp32 gradients
            gather = n * fab.all_gather_s(2 * local / n, s, stride["dp_shard"])
            gather_lat = n * fab.all_gather_s(0.0, s, stride["dp_shard"])
            reduce = n * fab.reduce_scatter_s(4 * local / n, s, stride["dp_shard"])
            reduce_lat = gather_lat
        if r > 1:  # HSDP: the shards' all-reduce across replicas (the trainer's mesh keeps shards inner)
            reduce += n * fab.all_reduce_s(4 * local / s / n, r, stride["dp_replicate"])
            reduce_lat += n * fab.all_reduce_s(0.0, r, stride["dp_replicate"])
        if experts:
            g = _expert_collectives(layout, experts, expert_units, hw)
            gather, gather_lat, reduce, reduce_lat = (gather + g[0], gather_lat + g[1], reduce + g[2],
                                                      reduce_lat + g[3])
        across = (s > 1 and crosses_nodes(layout, "dp_shard", gpn)) or \
                 (r > 1 and crosses_nodes(layout, "dp_replicate", gpn))
    return _Collectives(gather, reduce, gather_lat, reduce_lat, units, across)


def _expert_collectives(layout: Layout, experts: float, units: int, hw: Hardware
                        ) -> tuple[float, float, float, float]:
    """(gather, its latency, reduce, its latency) of the routed experts' FSDP2 units under
    ep: dp_shard / ep ranks holding the same experts, ep x tp apart (the expert mesh splits
    dp_shard into dp_shard / ep outer x ep inner); HSDP's replicas all-reduce their shards."""
    fab, stride = hw.fabric, mesh_strides(layout)
    se, r, apart = layout.expert_shard, layout.dp_replicate, stride["dp_shard"] * layout.ep
    gather = units * fab.all_gather_s(2 * experts / units, se, apart)
    gather_lat = units * fab.all_gather_s(0.0, se, apart)
    reduce = units * fab.reduce_scatter_s(4 * experts / units, se, apart)
    reduce_lat = gather_lat
    if r > 1:
        reduce += units * fab.all_reduce_s(4 * experts / se / units, r, stride["dp_replicate"])
        reduce_lat += units * fab.all_reduce_s(0.0, r, stride["dp_replicate"])
    return gather, gather_lat, reduce, reduce_lat


def _dp_per_step(c: _Collectives, layout: Layout, m: int, fwd_mb: float, bwd_mb: float
                 ) -> tuple[float, float, float]:
    """(all dp seconds of the step, their latency part, the part compute does not hide) for
    `m` micro-batches. The gradient reduction runs in the last micro-batch's backward only
    (no_sync / set_requires_gradient_sync before it): its window is that one backward."""
    if layout.pp > 1:  # the trainer keeps stages gathered across micro-batches: one gather per step
        dp_s, dp_lat = c.gather_s + c.reduce_s, c.gather_latency_s + c.reduce_latency_s
        exposed = _exposed(c.gather_s, fwd_mb, c.units) + _exposed(c.reduce_s, bwd_mb, c.units)
        return dp_s, dp_lat, exposed
    regather = layout.fsdp and layout.reshard_after_forward  # backward gathers the weights again
    dp_s = m * c.gather_s * (2 if regather else 1) + c.reduce_s
    dp_lat = m * c.gather_latency_s * (2 if regather else 1) + c.reduce_latency_s
    back = c.gather_s if regather else 0.0
    exposed = (m * _exposed(c.gather_s, fwd_mb, c.units) + (m - 1) * _exposed(back, bwd_mb, c.units)
               + _exposed(back + c.reduce_s, bwd_mb, c.units))
    return dp_s, dp_lat, exposed


def _pipeline_sends(args: ModelArgs, layout: Layout, tokens_mb: int, m: int, hw: Hardware) -> float:
    """Each micro-batch's activation forward and its gradient back, per stage; under tp each
    rank sends its 1/tp of the sequence (sequence parallel: blocks output Shard(1))."""
    if layout.pp == 1:
        return 0.0
    cross = crosses_nodes(layout, "pp", hw.gpus_per_node)
    return m * layout.stages_per_rank * 2 * hw.fabric.send_s(2 * tokens_mb * args.dim / layout.tp, cross)


def _optimizer_seconds(args: ModelArgs, layout: Layout, rank_layers: int, optimizer: OptimizerChoice,
                       hw: Hardware, bwd_mb: float) -> float:
    """The optimizer's step on this rank (duoka.plan.optimizer_costs), and Muon's gathers."""
    tp, fab = layout.tp, hw.fabric
    shard = layout.dp_shard if layout.fsdp else 1
    # The same tensors as `_local_params`: the busiest rank's layers, the embedding too without pp.
    opt = rank_footprint(args, rank_layers, layout.pp == 1, True, tp, optimizer, shard)
    optimizer_s = step_seconds(opt, hw.hbm_bytes_per_s, hw.peak_flops * hw.kernels.gemm_efficiency, bwd_mb)
    # Muon gathers each sharded matrix's fp32 update whole, over the shards and the tp ranks.
    stride = mesh_strides(layout)
    optimizer_s += sum(count * (fab.all_gather_s(nbytes / tp, shard, stride["dp_shard"])
                                + fab.all_gather_s(nbytes, tp)) for nbytes, count in opt.gathered)
    return optimizer_s


def estimate_step_time(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, global_batch: int,
                       ac: bool, hw: Hardware, optimizer: OptimizerChoice = ADAMW) -> StepTime:
    """Seconds per optimizer step on one GPU, by the cost model in the module docstring."""
    check_moe_layout(args, layout.dp_shard, layout.tp, layout.pp, layout.ep)
    check_context(args, layout.cp, seq_len, layout.cp_method)
    pp, v = layout.pp, layout.stages_per_rank
    per_rank = global_batch // layout.dp_size
    m = per_rank // micro_batch  # micro-batches per step (the pipeline's under pp)

    busiest, model_flops = _stage_flops(args, layout, seq_len, ac, hw.kernels.pp_split)
    mb = _micro_batch(args, layout, micro_batch, seq_len, ac, busiest, hw)
    rank_mb = mb.total_s
    pipelined = rank_mb * (m + (pp - 1) / v)
    bubble = ((pp - 1) / v) / (m + (pp - 1) / v) if pp > 1 else 0.0
    # The windows dp traffic can hide under: one micro-batch's forward (1/3 of the FLOPs, 1/4
    # under checkpointing, whose backward recomputes it) and its backward.
    fwd_mb = rank_mb / 3 / (AC_RECOMPUTE if ac else 1.0)
    bwd_mb = rank_mb - fwd_mb

    local, experts = _local_params(args, layout, mb.rank_layers)
    collectives = _dp_collectives(layout, local, mb.units, hw, experts, len(args.moe_layers) if experts else 0)
    dp_s, dp_lat, exposed = _dp_per_step(collectives, layout, m, fwd_mb, bwd_mb)
    p2p = _pipeline_sends(args, layout, micro_batch * seq_len, m, hw)
    optimizer_s = _optimizer_seconds(args, layout, mb.rank_layers, optimizer, hw, bwd_mb)
    total = pipelined + exposed + p2p + optimizer_s
    tokens = global_batch * seq_len
    mfu = (model_flops * tokens / total) / (hw.gpus * hw.peak_flops)
    return StepTime(compute_s=mb.compute_s * (m + (pp - 1) / v), tensor_parallel_s=mb.tp_s * m,
                    expert_parallel_s=mb.ep_s * m, context_parallel_s=mb.cp_s * m,
                    fsdp_overhead_s=mb.fsdp_s * m, data_parallel_s=dp_s, exposed_dp_s=exposed,
                    pipeline_bubble=bubble, pipeline_p2p_s=p2p, optimizer_s=optimizer_s, total_s=total,
                    tokens_per_s_per_gpu=tokens / total / hw.gpus, mfu=mfu,
                    bubble_s=rank_mb * (pp - 1) / v, dp_latency_s=dp_lat, dp_across_nodes=collectives.across_nodes)
