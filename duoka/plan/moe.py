"""Mixture-of-experts models (Qwen2-MoE) in the planner: how their parameters split between
the routed experts and the rest (`expert_split`), what a MoE layer saves for backward
(`moe_saved_per_token`), which expert-parallel degrees a layout may take (`expert_degrees`,
`check_moe_layout`) and what the token dispatch moves (`dispatch_bytes`).

Expert parallelism as the trainer applies it (duoka/parallel/expert_parallel.py and
parallelize.py): each group of ep neighbouring dp_shard ranks splits every MoE layer's
routed experts, num_experts / ep per rank; FSDP2 shards those over the dp_shard / ep ranks
holding the same experts, as a unit of their own per layer; everything else (attention,
norms, router, shared expert and its gate, embedding, head) is sharded over all dp_shard
ranks as in a dense model. So a rank keeps experts / ep / (dp_shard / ep) = experts /
dp_shard of the routed experts' fp32 weights, gradients and optimizer state, the same as
without ep: what ep divides is what FSDP2 holds unsharded (a block's gathered bf16 weights,
the fp32 gradients kept while accumulating, the reduce-scatter buffers) and the expert
weights' FSDP traffic, which runs over dp_shard / ep ranks instead of dp_shard.

In exchange each MoE layer moves its tokens: one all-to-all sends each token's k routed
copies (k x dim bf16) to the ranks owning their experts, another brings the outputs back;
backward runs both again for the gradients, and a checkpointed block's recompute once more.
A fraction (ep-1)/ep of those bytes leaves the rank (balanced routing assumed).

The trainer refuses tensor and pipeline parallelism, float8 and LoRA for a MoE model
(duoka/train/spec.py: check_moe_layout); the planner proposes none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs

# All-to-alls per MoE layer and micro-batch: dispatch and combine in forward, their
# gradients in backward (the same bytes back the way they came); under full activation
# checkpointing the recomputed forward dispatches and combines again.
ALL_TO_ALLS = 4
ALL_TO_ALLS_CHECKPOINTED = 6
# Bytes of one dispatched row element: the rows travel in the compute dtype, bf16.
DISPATCH_BYTES = 2
# int64 indices a MoE layer saves per routed copy of a token: topk's chosen experts, the
# gather's source rows (order // k) and index_copy's destinations (order); under ep the
# dispatch's regrouping (rows[order]) and its inverse (index_copy) add two more.
INDEX_BYTES = 3 * 8
EP_INDEX_BYTES = 2 * 8


@dataclass(frozen=True)
class ExpertSplit:
    """A model's decoder parameters by how they are sharded (all zero experts when dense)."""

    attention: int  # one layer's attention (q/k/v with biases, o) and its two norm gains
    dense_layer: int  # a dense layer: attention, norms and the SwiGLU MLP
    moe_layer: int  # a MoE layer but its routed experts: attention, norms, router, shared expert and its gate
    layer_experts: int  # one MoE layer's routed experts (num_experts x 3 x dim x moe_intermediate)
    dense_layers: int
    moe_layers: int
    attention_matmul: int  # one layer's attention matmul weights (no biases, no norms)
    moe_matmul: int  # a MoE layer's matmul weights but the routed experts: attention, router, shared expert, gate

    @property
    def experts(self) -> int:
        """Routed expert weights of the whole model."""
        return self.moe_layers * self.layer_experts

    @property
    def blocks(self) -> int:
        """All decoder-layer parameters, routed experts included."""
        return self.dense_layers * self.dense_layer + self.moe_layers * (self.moe_layer + self.layer_experts)


def expert_split(args: ModelArgs) -> ExpertSplit:
    """The counts of ModelArgs.num_params, split by layer kind (they sum to it with the
    embedding, the head and the final norm: tests/unit/test_plan_moe.py)."""
    h, hd = args.dim, args.resolved_head_dim
    heads = args.n_heads + 2 * args.n_kv_heads
    attention_matmul = h * hd * heads + args.n_heads * hd * h
    attention = attention_matmul + hd * heads + 2 * h  # + the q/k/v biases and the two norm gains
    dense_mlp = 3 * h * args.intermediate_size
    n_moe = len(args.moe_layers)
    # router [E, dim], shared expert's SwiGLU, its sigmoid gate [1, dim]
    moe_mlp = h * args.num_experts + 3 * h * args.shared_expert_intermediate_size + h if n_moe else 0
    layer_experts = args.num_experts * 3 * h * args.moe_intermediate_size if n_moe else 0
    return ExpertSplit(attention, attention + dense_mlp, attention + moe_mlp, layer_experts, args.n_layers - n_moe,
                       n_moe, attention_matmul, attention_matmul + moe_mlp)


def is_moe(args: ModelArgs) -> bool:
    return bool(args.moe_layers)


def active_params(args: ModelArgs) -> float:
    """Parameters a token uses: all but the routed experts it is not sent to (the "A14B" of
    Qwen2-57B-A14B)."""
    experts = expert_split(args).experts
    return args.num_params() - experts * (1 - args.num_experts_per_tok / args.num_experts) if experts else \
        args.num_params()


def expert_degrees(args: ModelArgs, dp_shard: int) -> list[int]:
    """The parallel.ep a layout of dp_shard FSDP ranks may take: the divisors of dp_shard
    that divide num_experts (duoka.parallel.dims checks the same); [1] for a dense model."""
    if not is_moe(args):
        return [1]
    return [d for d in range(1, dp_shard + 1) if dp_shard % d == 0 and args.num_experts % d == 0]


def check_moe_layout(args: ModelArgs, dp_shard: int, tp: int, pp: int, ep: int) -> None:
    """Refuse an estimate for a layout the trainer does not run: ep > 1 on a dense model or
    not dividing the experts, tp or pp with a MoE model (duoka/train/spec.py refuses them)."""
    if not is_moe(args):
        if ep > 1:
            raise DuokaError(f"ep={ep} splits routed experts, and this model has none",
                             "use ep=1 (expert parallelism is for mixture-of-experts models)")
        return
    if tp > 1 or pp > 1:
        raise DuokaError(f"tp={tp}, pp={pp}: a mixture-of-experts model trains with data parallelism only "
                         "(the trainer refuses tensor and pipeline parallelism for it)",
                         "plan it with tp=1 and pp=1 (fsdp, with ep to split the experts)")
    if args.num_experts % ep or dp_shard % ep:
        raise DuokaError(f"ep={ep} does not divide both the {args.num_experts} routed experts and dp_shard={dp_shard}",
                         f"use ep in {expert_degrees(args, dp_shard)}")


def moe_saved_per_token(args: ModelArgs, e: int, ep: int) -> float:
    """Bytes a MoE layer's sparse MLP saves for backward per token, beyond its input (the
    norm output, counted with the block), from duoka/models/qwen2/moe.py op by op, e the
    compute dtype's bytes, k = num_experts_per_tok:
    - the router's fp32 softmax output, E floats (softmax's backward needs its output);
    - the k dispatched rows, k x dim, the input of the experts' gate and up grouped GEMMs
      (under ep the rows received from the other ranks: as many, with balanced routing);
    - the experts' SwiGLU intermediates, gate, silu(gate), up and their product: 4 x k x
      moe_intermediate (the dense MLP's count, duoka.plan.memory.saved_per_token, per copy);
    - the k expert outputs back in token order, k x dim, and the k routing weights, which
      their weighted sum saves;
    - the shared expert's SwiGLU (4 x shared_intermediate), its output and its sigmoid gate,
      which their product saves (dim + 1);
    - int64 indices: INDEX_BYTES per copy, EP_INDEX_BYTES more under ep."""
    k = args.num_experts_per_tok
    routed = e * k * args.dim + 4 * e * k * args.moe_intermediate_size + e * k * args.dim + e * k
    shared = 4 * e * args.shared_expert_intermediate_size + e * args.dim + e
    indices = (INDEX_BYTES + (EP_INDEX_BYTES if ep > 1 else 0)) * k
    return 4 * args.num_experts + routed + shared + indices


def moe_backward_transient(args: ModelArgs, e: int) -> float:
    """Bytes per token of a MoE layer's backward in flight: the gradients of three SwiGLU
    intermediates of the routed copies or of the shared expert (they run one after the
    other: the larger), of the k dispatched and combined rows, and the incoming one."""
    k = args.num_experts_per_tok
    swiglu = 3 * e * max(k * args.moe_intermediate_size, args.shared_expert_intermediate_size)
    return swiglu + 2 * e * k * args.dim + 2 * e * args.dim


def dispatch_bytes(args: ModelArgs, tokens: int) -> float:
    """Bytes one all-to-all of a MoE layer moves from a rank (its part for itself included):
    the k routed copies of each of its `tokens`, dim wide, in bf16."""
    return tokens * args.num_experts_per_tok * args.dim * DISPATCH_BYTES


def all_to_all_buffers(args: ModelArgs, tokens: int, ep: int) -> float:
    """The send and the receive buffer of one all-to-all in flight (a layer's backward under
    ep > 1; balanced routing: a receive buffer as large as the send buffer)."""
    return 2 * dispatch_bytes(args, tokens) if ep > 1 else 0.0
