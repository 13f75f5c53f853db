"""The parallel layouts a plan chooses from: every layout of N GPUs that the trainer runs and
the model's shape allows (`enumerate_layouts`), their family and how simple each is (the
order near-ties are broken in), and where their process groups sit on the mesh
pp x dp_replicate x dp_shard x tp (tp innermost, as the trainer builds it): the rank
distance of each dimension, and whether its groups span nodes.

A Layout itself (the [parallel] section's names) is duoka.plan.memory's.
"""

from __future__ import annotations

import math
from dataclasses import replace

from duoka.models.qwen2.args import ModelArgs
from duoka.plan.context import context_degrees, context_method
from duoka.plan.memory import Layout
from duoka.plan.moe import expert_degrees, is_moe

TP_SIZES = (1, 2, 4, 8)
# The families, simplest first (the order `simplicity` sorts in): each step to the right adds
# communication on the critical path and ways to fail.
FAMILY_ORDER = ("single", "ddp", "fsdp", "hsdp", "tp", "pp")


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
    """Sort key, simplest first: ddp > fsdp > hsdp > fsdp/hsdp with cp > tp > pp (cp's
    per-layer all-gathers sit on the critical path, but its code is the data-parallel one,
    without tp's or pp's), then a smaller ep (its all-to-alls add to the critical path) or cp,
    then smaller degrees."""
    dp = {"ddp": 0, "fsdp": 1}[layout.dp_mode] + (1 if layout.dp_mode == "fsdp" and layout.dp_replicate > 1 else 0)
    return (layout.pp > 1, layout.tp > 1, layout.cp > 1, dp, layout.ep, layout.cp, layout.tp, layout.pp,
            layout.stages_per_rank)


def enumerate_layouts(args: ModelArgs, gpus: int, gpus_per_node: int, context_seq: int | None = None
                      ) -> list[Layout]:
    """Every layout of `gpus` GPUs the trainer runs and the model's shape allows: tp from
    1/2/4/8 dividing the attention and KV heads, within one node; pp dividing the GPUs
    with at least one layer per stage (1F1B, and interleaved with 2 stages per rank);
    the remaining ranks data-parallel as ddp, fsdp, or hsdp (every replicas x shards
    split). A mixture-of-experts model: data parallelism only (the trainer refuses tp and
    pp for it), each fsdp/hsdp layout with every ep dividing dp_shard and num_experts.
    context_seq (a sequence long enough for cp: duoka.plan.context.searches_context): each
    fsdp/hsdp layout without tp and pp also with every cp of context_degrees (the trainer
    refuses cp with tp, pp and ep), by the method parallel.cp_method=auto would take (with_cp)."""
    out = []
    moe = is_moe(args)
    for tp in TP_SIZES:
        if gpus % tp or args.n_heads % tp or args.n_kv_heads % tp or tp > gpus_per_node or (moe and tp > 1):
            continue
        for pp in _divisors(gpus // tp):
            if pp > args.n_layers or (moe and pp > 1):
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
                    fsdp = [replace(x, ep=ep) for x in fsdp for ep in expert_degrees(args, x.dp_shard)]
                    if context_seq and tp == pp == 1 and not moe:
                        fsdp += [with_cp(args, x, cp) for x in fsdp for cp in context_degrees(x.dp_shard, context_seq)]
                    # Keeping blocks gathered from forward to backward (ZeRO-2-like) saves the
                    # backward's all-gathers for the gathered weights' memory; under pp the
                    # trainer keeps stages gathered anyway.
                    dps += fsdp + ([replace(x, reshard_after_forward=False) for x in fsdp] if pp == 1 else [])
                out += dps
    return out


def with_cp(args: ModelArgs, layout: Layout, cp: int) -> Layout:
    """`layout` at context-parallel degree cp, by the method auto takes for this model
    (duoka.plan.context.context_method: Ulysses where the heads divide by cp)."""
    return replace(layout, cp=cp, cp_method=context_method(args, cp) if cp > 1 else "allgather")


def crosses_nodes(layout: Layout, dim: str, gpus_per_node: int) -> bool:
    """Whether a process group of mesh dimension `dim` spans nodes. The mesh is
    pp x dp_replicate x dp_shard x tp with tp innermost (neighbouring ranks), as the
    trainer builds it."""
    order = ("pp", "dp_replicate", "dp_shard", "tp")
    sizes = {"pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard, "tp": layout.tp}
    stride = math.prod(sizes[d] for d in order[order.index(dim) + 1:])
    return sizes[dim] > 1 and stride * sizes[dim] > gpus_per_node


def mesh_strides(layout: Layout) -> dict[str, int]:
    """Rank distance between neighbours of each mesh dimension: the mesh is pp x
    dp_replicate x dp_shard x tp with tp innermost, as the trainer builds it."""
    return {"tp": 1, "dp_shard": layout.tp, "dp_replicate": layout.tp * layout.dp_shard,
            "pp": layout.tp * layout.dp_shard * layout.dp_replicate}

