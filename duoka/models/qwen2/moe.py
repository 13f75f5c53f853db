"""Qwen2-MoE's sparse MLP (transformers' Qwen2MoeSparseMoeBlock): a router, routed experts
stacked along a leading expert dimension, and a shared expert behind a sigmoid gate.

Routing (`route`): the router's logits in the compute dtype, a softmax over the experts in
fp32, each token's top-k probabilities (renormalised to sum to 1 when norm_topk_prob), cast
back to the logits' dtype: transformers' Qwen2MoeTopKRouter step for step.

The experts run dropless (`routed_experts`): every (token, expert) pair of the top-k is
computed, none is dropped for capacity. The pairs are sorted by expert, so that each
expert's tokens form one contiguous group, and each of the three projections is one grouped
GEMM over the groups (torch.nn.functional.grouped_mm, given the groups' end offsets) where
the device and dtype have a kernel (`grouped_mm_supported`), else a loop of one plain
matmul per expert over its group (`expert_swiglu`). The outputs return to token order and
are summed over each token's k experts, weighted by their routing probabilities.

Routing statistics (`RoutingStats`: per expert, the top-k assignments and the summed router
probabilities) leave each MoE layer beside its output; the model collects them during its
own forward (`RoutingRecorder`) for the router's load-balancing loss
(`load_balancing_loss`, transformers' definition) and the per-expert load.

The expert weights are [experts, out, in] (each expert's slice an nn.Linear weight), the
expert dimension first so that FSDP2 or expert parallelism can shard it. The routing and
expert functions take flattened tokens [tokens, dim], so a serving step can call them too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from duoka.models import moe_gemv
from duoka.models.qwen2.args import MOE_GEMMS


class Routing(NamedTuple):
    """One MoE layer's routing of T tokens over E experts, top-k."""
    logits: torch.Tensor  # [T, E] in the compute dtype
    probs: torch.Tensor  # [T, E] fp32 softmax of the logits
    weights: torch.Tensor  # [T, k] the chosen experts' probabilities (renormalised if asked), logits' dtype
    experts: torch.Tensor  # [T, k] int64 the chosen experts, most probable first


class RoutingStats(NamedTuple):
    """What the load-balancing loss and the load monitor need from one MoE layer's forward."""
    expert_counts: torch.Tensor  # [E] fp32: the top-k assignments each expert received (no gradient)
    prob_sums: torch.Tensor  # [E] fp32: router probabilities summed over the tokens (the loss's path to the router)
    tokens: int  # tokens routed


def route(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, norm_topk_prob: bool) -> Routing:
    """x: [T, dim] (a batch's tokens, flattened); router_weight: [E, dim]."""
    logits = F.linear(x, router_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(logits, probs, weights.to(logits.dtype), experts)


def expert_counts(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[E] int32: how many of the [T, k] chosen experts name each expert. No host synchronisation."""
    flat = experts.flatten()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, counts) for the [T, k] chosen experts: `order` [T * k] lists the flattened
    (token, slot) pairs grouped by expert, in token order within a group (a stable sort);
    `counts` [E] int32 the size of each group (expert_counts)."""
    return torch.argsort(experts.flatten(), stable=True), expert_counts(experts, num_experts)


def _cuda_grouped_mm_capable(index: int) -> bool:
    # A bool, compared here: torch 2.11's dynamo failed to guard `tuple >= tuple` on this
    # function's result when compiling a serving step (InternalTorchDynamoError, H100).
    return torch.cuda.get_device_capability(index) >= (8, 0)


# torch.compiler.assume_constant_result(_cuda_grouped_mm_capable), without that function's import
# of torch._dynamo (over a second of every process's start-up): the one attribute it sets, torch
# 2.11-2.13 (tests/unit/test_startup_imports.py holds both halves of this).
_cuda_grouped_mm_capable._dynamo_marked_constant = True


def grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether torch.nn.functional.grouped_mm has a kernel for these operands (torch 2.11-2.13):
    on CUDA bf16 only, on compute capability 8.0 or later, with 16-byte aligned rows (every
    width a multiple of 8); on the CPU bf16 or fp32, though fp32 only eagerly (the function
    that torch.compile traces accepts bf16 alone). Anything else takes the loop of matmuls."""
    if not hasattr(F, "grouped_mm") or x.dtype != weight.dtype:
        return False
    if x.device.type == "cuda":
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        aligned = all(n % 8 == 0 for n in weight.shape[1:])
        return x.dtype == torch.bfloat16 and aligned and _cuda_grouped_mm_capable(index)
    if x.device.type == "cpu":  # bf16 rows 16-byte aligned too (a tp shard of width 12 is not)
        aligned = all(n % 8 == 0 for n in weight.shape[1:])
        eager_fp32 = x.dtype == torch.float32 and not torch.compiler.is_compiling()
        return (x.dtype == torch.bfloat16 and aligned) or eager_fp32
    return False


def expert_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, counts: torch.Tensor,
                  grouped: bool) -> torch.Tensor:
    """Each expert's SwiGLU, w2 (silu(w1 x) * w3 x), on its group of rows.

    x: [N, dim], the rows grouped by expert (counts[e] rows for expert e, in expert order);
    w1, w3: [E, hidden, dim]; w2: [E, dim, hidden]. grouped: one grouped GEMM per
    projection (no host synchronisation, no padding). Otherwise one F.linear per expert
    over exactly its rows: the same products as a dense layer per expert, with no FLOP spent
    on padding however unbalanced the routing, at the cost of one host synchronisation (the
    group sizes) and a launch per expert; a batched matmul over groups padded to the largest
    would need the same synchronisation and multiply the work when the routing is skewed."""
    if grouped:
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        gate = F.grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
        up = F.grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
        return F.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offsets)
    outs = [F.linear(F.silu(F.linear(rows, w1[e])) * F.linear(rows, w3[e]), w2[e])
            for e, rows in enumerate(x.split(counts.tolist())) if rows.shape[0]]
    return torch.cat(outs) if outs else x.new_zeros(0, w2.shape[1])


class GroupedExperts(nn.Module):
    """The routed experts of one MoE layer, stacked: w1 (gate_proj) and w3 (up_proj) are
    [E, hidden, dim], w2 (down_proj) [E, dim, hidden]. forward takes the rows already grouped
    by expert with the group sizes, the interface an expert-parallel dispatch wraps."""

    def __init__(self, num_experts: int, dim: int, hidden: int, gemm: str = "auto"):
        super().__init__()
        if gemm not in MOE_GEMMS:
            raise ValueError(f"moe_gemm={gemm!r} is not one of {MOE_GEMMS}")
        self.gemm = gemm
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x: rows grouped by expert, counts[e] rows for expert e. Under expert parallelism
        (duoka.parallel.expert_parallel) the weights are DTensors of this rank's experts and
        x and counts arrive already dispatched to them."""
        w1, w3, w2 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w3, self.w2))
        if torch.is_autocast_enabled(x.device.type):
            # grouped_mm is not autocast-aware: run it in the autocast dtype, as F.linear would.
            dtype = torch.get_autocast_dtype(x.device.type)
            x, w1, w3, w2 = (t.to(dtype) for t in (x, w1, w3, w2))
        grouped = self.gemm == "grouped" or (self.gemm == "auto" and grouped_mm_supported(x, w1))
        return expert_swiglu(x, w1, w3, w2, counts, grouped)


@torch.library.custom_op("duoka::expert_gemv", mutates_args=())
def _expert_gemv_op(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                    w3: torch.Tensor, w2: torch.Tensor, s1: torch.Tensor | None = None, s3: torch.Tensor | None = None,
                    s2: torch.Tensor | None = None, gate_logit: torch.Tensor | None = None) -> torch.Tensor:
    shared = None if s1 is None else moe_gemv.SharedExpert(s1, s3, s2, gate_logit)
    return moe_gemv.expert_gemv(x, experts, weights, w1, w3, w2, shared=shared)


@_expert_gemv_op.register_fake
def _(x, experts, weights, w1, w3, w2, s1=None, s3=None, s2=None, gate_logit=None):
    return x.new_empty(experts.shape[0], experts.shape[1] + (s1 is not None), x.shape[-1], dtype=torch.float32)


def _gemv_experts(x: torch.Tensor, routing_experts: torch.Tensor, weights: torch.Tensor, experts: GroupedExperts,
                  shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] = ()) -> torch.Tensor:
    """moe_gemv's experts for x [T, dim] -> [T, dim] in x's dtype; `shared` (gate, up, down, gate
    logit) adds the shared expert's gated output. The sum over each token's weighted rows stays
    outside the custom op, where the compiler fuses it into the next kernel."""
    rows = _expert_gemv_op(x, routing_experts, weights, experts.w1, experts.w3, experts.w2, *shared)
    return rows.sum(dim=1).to(x.dtype)


@torch.library.custom_op("duoka::route_one_token", mutates_args=())
def _route_one_token_op(x: torch.Tensor, router_weight: torch.Tensor, gate_weight: torch.Tensor, top_k: int,
                        norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return moe_gemv.route_one_token(x, router_weight, gate_weight, top_k, norm_topk_prob)


@_route_one_token_op.register_fake
def _(x, router_weight, gate_weight, top_k, norm_topk_prob):
    return x.new_empty(1, top_k), x.new_empty(1, top_k, dtype=torch.int64), x.new_empty(1, 1)


def one_token_gemv(x: torch.Tensor, experts: GroupedExperts) -> bool:
    """Whether x's experts run as moe_gemv's Triton GEMVs: one token (batch-1 decode, where the
    grouped GEMM leaves most SMs idle), no autograd or autocast, plain weights, the default gemm;
    on CUDA, or on CPU tensors under Triton's interpreter (the tests). A compiled block's
    one-token variant is specialised already, so the test adds no variant."""
    return (x.shape[0] == 1 and experts.gemm == "auto" and moe_gemv.available()
            and (x.is_cuda or moe_gemv.INTERPRETED) and not torch.is_grad_enabled()
            and not torch.is_autocast_enabled(x.device.type) and not isinstance(experts.w1, DTensor))


def routed_experts(x: torch.Tensor, routing: Routing, experts: GroupedExperts,
                   with_counts: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The routed experts' output for x [T, dim], dropless: [T, dim] and the per-expert
    assignment counts [E] int32 (None where not asked for and not needed by the path)."""
    n_tokens, k = routing.experts.shape
    if one_token_gemv(x, experts):
        out = _gemv_experts(x, routing.experts, routing.weights, experts)
        return out, expert_counts(routing.experts, experts.w1.shape[0]) if with_counts else None
    order, counts = sort_by_expert(routing.experts, experts.w1.shape[0])
    y = experts(x[order // k], counts)  # [T * k, dim], grouped by expert
    # Back to (token, slot) order: a permutation, so every row is written once.
    y = y.new_empty(y.shape).index_copy_(0, order, y)
    out = (y.view(n_tokens, k, -1) * routing.weights.unsqueeze(-1)).sum(dim=1)
    return out, counts


class MoE(nn.Module):
    """A sparse MLP layer: routed experts plus a shared expert scaled by sigmoid(shared_expert_gate x).
    forward returns (output, RoutingStats). The shared expert is built by the caller (the
    model's SwiGLU module, so its weights are named and loaded as a dense MLP's)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, hidden: int, norm_topk_prob: bool,
                 shared_expert: nn.Module, gemm: str = "auto"):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.experts = GroupedExperts(num_experts, dim, hidden, gemm)
        self.shared_expert = shared_expert
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor, with_stats: bool = True) -> tuple[torch.Tensor, RoutingStats | None]:
        """with_stats=False (serving: no loss and no monitor reads them) returns None for the
        statistics and skips their reductions and casts, ~3% of a batch-1 step (bench/NOTES.md 43)."""
        flat = x.reshape(-1, x.shape[-1])
        if not with_stats and one_token_gemv(flat, self.experts) and flat.dtype == self.router.weight.dtype:
            return self._one_token(flat).view(x.shape), None
        routing = route(flat, self.router.weight, self.top_k, self.norm_topk_prob)
        routed, counts = routed_experts(flat, routing, self.experts, with_counts=with_stats)
        shared = torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        out = (routed + shared).view(x.shape)
        if not with_stats:
            return out, None
        return out, RoutingStats(counts.float(), routing.probs.sum(dim=0), flat.shape[0])

    def _one_token(self, flat: torch.Tensor) -> torch.Tensor:
        """forward's output for one token without statistics, routed by moe_gemv's kernels: two for
        the routing, two for the experts, the shared expert among them where its weights are plain
        (shared_expert.plain_weights: FeedForward's), where torch took ~16 (bench/NOTES.md 44-45)."""
        weights, experts, gate_logit = _route_one_token_op(flat, self.router.weight, self.shared_expert_gate.weight,
                                                           self.top_k, self.norm_topk_prob)
        shared = self.shared_expert.plain_weights()
        if shared is not None and shared[0].dtype == flat.dtype and shared[0].shape[0]:
            return _gemv_experts(flat, experts, weights, self.experts, (*shared, gate_logit))
        routed = _gemv_experts(flat, experts, weights, self.experts)
        return routed + torch.sigmoid(gate_logit) * self.shared_expert(flat)


def load_balancing_loss(stats: Sequence[RoutingStats], num_experts: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func (the Switch Transformer loss, arXiv:2101.03961,
    eq. 4-6) over the MoE layers of one forward: E x sum over experts of (the share of tokens
    routed to it) x (its mean router probability), both taken over every layer's tokens
    together. Each token counts (no padding mask: duoka's batches are packed windows).
    The probabilities are the router's fp32 softmax (transformers recomputes it in the
    logits' dtype: the same in fp32, a rounding apart in bf16)."""
    rows = sum(s.tokens for s in stats)
    counts = torch.stack([s.expert_counts for s in stats]).sum(dim=0)
    probs = torch.stack([s.prob_sums for s in stats]).sum(dim=0)
    return num_experts * torch.sum((counts / rows) * (probs / rows))


class RoutingRecorder:
    """One forward's RoutingStats from a model's MoE layers, keyed by layer. The model opens it
    around its own forward and takes the statistics at the end; a layer run while it is
    closed (an activation-checkpoint recompute during backward, a block run on its own)
    records nothing, so no graph outlives the forward that made it. Shared by the model and
    its blocks from construction. Between forwards it keeps only the last one's per-expert
    counts (`load`, detached), for the load monitor, and their sum over the forwards since
    `take_totals` (a training step's micro-batches or pipeline chunks): E floats per layer."""

    def __init__(self):
        self.open = False
        self.stats: dict[int, RoutingStats] = {}
        self.load: dict[int, RoutingStats] = {}
        self.totals: dict[int, torch.Tensor] = {}

    def start(self) -> None:
        self.stats.clear()
        self.open = True

    def record(self, layer_id: int, stats: RoutingStats) -> None:
        if self.open:
            self.stats[layer_id] = stats

    def finish(self) -> dict[int, RoutingStats]:
        stats = dict(self.stats)
        self.stats.clear()
        self.open = False
        self.load = {layer: RoutingStats(s.expert_counts.detach(), s.prob_sums.detach(), s.tokens)
                     for layer, s in stats.items()}
        for layer, s in self.load.items():  # device additions: the host never waits for them
            self.totals[layer] = self.totals[layer] + s.expert_counts if layer in self.totals else s.expert_counts
        return stats

    def take_totals(self) -> dict[int, torch.Tensor]:
        """The per-expert counts summed since the last call, per layer; the sum starts again."""
        totals, self.totals = self.totals, {}
        return totals
