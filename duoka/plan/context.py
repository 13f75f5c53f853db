"""Context parallelism (parallel.cp) in the planner: what splitting each sequence over cp
ranks adds to a rank's memory (`context_memory`) and step (`context_traffic_s`), and which cp
a plan may propose (`context_degrees`, `searches_context`).

Context parallelism as the trainer runs it (duoka/models/qwen2/context_parallel.py, Llama 3's
context parallelism, arXiv:2407.21783 section 3.3.2): each sequence is cut into 2 x cp
chunks and rank i of a cp group holds chunks i and 2cp-1-i, so every rank has seq/cp tokens
and about 1/cp of causal attention's work. The cp ranks are neighbouring dp_shard ranks that
share one batch: FSDP2 still shards weights, gradients and optimizer state over all of
dp_shard (cp ranks included), while the batches are dp_replicate x dp_shard / cp.

Everything per token (norms, projections, MLP, the head and the loss) runs on the rank's
seq/cp tokens. Attention all-gathers every rank's keys and values (two differentiable
all-gathers per layer: backward reduce-scatters their gradients) and runs SDPA with a dense
boolean mask [b, 1, seq/cp, seq] built once per forward. What that adds, per micro-batch:
- the gathered keys and values, full seq x 2 x kv_heads x head_dim in the compute dtype:
  SDPA saves its key and value inputs for backward, and those are the gathered tensors, so
  each layer keeps the whole sequence's K/V (the all-gather's backward saves nothing). Under
  full checkpointing a block saves only its input, and the recompute of the one block in
  backward gathers and saves them again: one layer's worth;
- the boolean mask, seq/cp x seq bytes per sequence (per sequence: packed documents give
  each sample its own; the trainer's data packs them). It is no tensor autograd saves, so
  without checkpointing it is freed when the forward returns; under checkpointing every
  checkpointed block keeps its inputs for the recompute, the mask among them, until backward;
- SDPA's additive bias: scaled_dot_product_attention converts a boolean mask, in every call,
  to a bias of the query's dtype (aten/src/ATen/native/transformers/attention.cpp,
  convert_boolean_attn_mask[_cudnn]: where(~mask, -inf, 0)), and the fused kernels save it
  for backward. So each layer saves its own copy, 2 bytes per mask element: 28 x 4 GiB for
  Qwen2-7B at 131,072 tokens over cp 8 without checkpointing; one layer's under it;
- in a layer's backward, the gathered keys' and values' gradients before they are
  reduce-scattered (full seq x 2 x kv_heads x head_dim).

The estimate assumes SDPA runs a fused kernel: with a mask and grouped-query heads that is
cuDNN's attention (flash attention takes no mask, the memory-efficient kernel no
grouped-query heads: aten/src/ATen/native/transformers/cuda/sdp_utils.cpp). PyTorch's
sdp_utils.cpp puts cuDNN first on sm90/sm100 (H100, H200, B200) with cuDNN newer than 9.15
(check_prefer_cudnn_attention; read from PyTorch's source, not checked on a GPU here);
otherwise its default order reaches the math kernel first, which materialises the scores
(hundreds of GiB per layer at 128K): the plan says so.

Compute: a rank's share is seq/cp tokens of each sequence, each attending over the whole
sequence (PaLM's 12·L·H·S counts the full, unmasked score matrix, which a kernel driven by a
dense mask computes). Traffic: per layer and micro-batch two all-gathers (K and V) forward,
two reduce-scatters backward, two more all-gathers in a checkpointed recompute, each of the
gathered tensor's bytes, over cp neighbours. SDPA waits for its gathered K/V at once and the
projections for their gradients, and the trainer issues nothing to overlap them with: on the
critical path.

Ulysses (layout.cp_method, the trainer's parallel.cp_method; `context_method` is auto's choice,
proposed wherever the attention heads divide by cp): per layer one all-to-all sends each rank's
q, k and v (KV heads repeated up to a multiple of cp where fewer) to the rank of their heads and
one brings attention's output back; attention runs over the whole sequence with one GPU's
kernels (causal, or varlen for packed documents: training.document_masking_kernel=auto on
CUDA), so there is no mask and no bias. SDPA saves q, k, v and its output at the whole
sequence for 1/cp of the heads: as many elements as the rank's own tokens of every head, which
the per-token terms count, except the repeated KV heads (`kv_layer`). A layer's backward holds
the q/k/v gradients of the exchange twice (in sequence order, then reordered to be sent:
`kv_grad`). Traffic per layer and micro-batch: the two all-to-alls forward, their opposites
backward, both again in a checkpointed recompute; a rank sends its seq/cp tokens' share, so at
a fixed cp it falls as the sequence is split further, where the all-gather receives the whole
sequence's keys and values whatever cp. Compute is counted as for the all-gather (every score),
though the causal kernels skip about half: an over-estimate of Ulysses' attention time.
"""

from __future__ import annotations

from dataclasses import dataclass

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.context_parallel import resolve_context_method, ulysses_fits, ulysses_kv_repeat
from duoka.plan.moe import is_moe
from duoka.plan.network import Fabric

# cp is searched only for sequences longer than this. At and below it data parallelism with
# checkpointing keeps up (Llama 3 pretrained 405B at 8,192 tokens with cp 1 and used cp 16 only
# for its 131,072-token stage, arXiv:2407.21783 Table 4), and plans of short sequences stay
# as they were: cp would only trade the batch's data parallelism for per-layer collectives.
CONTEXT_MIN_SEQ = 8192
# The largest cp proposed: Llama 3's at 131,072 tokens (Table 4). Its groups are cp
# neighbours of dp_shard, so beyond a node they cross the network every layer.
MAX_CONTEXT = 16
# K/V all-gathers per layer and micro-batch: keys and values forward (two calls), their
# gradients reduce-scattered backward (two), and the checkpointed recompute gathers again.
KV_COLLECTIVES = 4
KV_COLLECTIVES_CHECKPOINTED = 6
# Ulysses' passes of its two all-to-alls (q/k/v, the output) per layer and micro-batch: forward,
# backward (the opposite exchanges of the gradients), and the checkpointed recompute's forward.
ULYSSES_PASSES = 2
ULYSSES_PASSES_CHECKPOINTED = 3
MASK_BYTES = 1  # the mask is torch.bool


def searches_context(args: ModelArgs, seq_len: int) -> bool:
    """Whether a plan of this sequence considers cp: a dense model (the trainer refuses cp
    for mixture-of-experts models: their load-balancing loss is over whole sequences) and a
    sequence longer than CONTEXT_MIN_SEQ."""
    return not is_moe(args) and seq_len > CONTEXT_MIN_SEQ


def context_degrees(dp_shard: int, seq_len: int | None = None) -> list[int]:
    """The cp > 1 a layout of dp_shard FSDP ranks may take: powers of two up to MAX_CONTEXT
    dividing dp_shard (the trainer needs cp | dp_shard) and, given seq_len, cutting it into
    2 x cp equal chunks."""
    out, cp = [], 2
    while cp <= min(dp_shard, MAX_CONTEXT):
        if dp_shard % cp == 0 and (seq_len is None or seq_len % (2 * cp) == 0):
            out.append(cp)
        cp *= 2
    return out


def context_method(args: ModelArgs, cp: int) -> str:
    """The method a plan proposes for cp, parallel.cp_method=auto's: ulysses where the model's
    attention heads divide by cp, else allgather."""
    return resolve_context_method("auto", cp, args.n_heads)


def check_context(args: ModelArgs, cp: int, seq_len: int, method: str = "allgather") -> None:
    """Refuse an estimate the trainer would refuse: cp on a MoE model, a sequence that does not
    cut into 2 x cp equal chunks, or Ulysses over heads that do not divide by cp (the layout's
    own checks: duoka.plan.memory.Layout)."""
    if cp == 1:
        return
    if method == "ulysses" and not ulysses_fits(args.n_heads, cp):
        raise DuokaError(f"cp={cp} by Ulysses splits the model's {args.n_heads} attention heads, which {cp} does "
                         "not divide (the trainer refuses it)", "plan it with cp_method=allgather, or another cp")
    if is_moe(args):
        raise DuokaError(f"cp={cp} on a mixture-of-experts model: the trainer refuses it (the router's "
                         "load-balancing loss is a function of whole sequences)", "plan it with cp=1")
    if seq_len % (2 * cp):
        raise DuokaError(f"seq {seq_len} does not cut into 2 x cp = {2 * cp} equal chunks",
                         f"use a sequence length that is a multiple of {2 * cp}, or another cp")


def kv_dim(args: ModelArgs) -> int:
    return args.n_kv_heads * args.resolved_head_dim


@dataclass(frozen=True)
class ContextMemory:
    """Bytes of one micro-batch under cp beyond what its seq/cp tokens save per token
    (duoka.plan.memory.saved_per_token), on one rank."""

    # One layer's keys and values beyond the rank's own, saved for SDPA's backward: the gathered
    # ones (allgather), the repeated KV heads (ulysses).
    kv_layer: float
    mask: float  # the boolean mask: kept by checkpointed blocks for their recompute (allgather)
    bias: float  # one layer's additive bias (SDPA's conversion of the mask), saved for its backward (allgather)
    # In a layer's backward: the gathered keys' and values' gradients (allgather), the q/k/v
    # gradients of the exchange, in sequence order and reordered (ulysses).
    kv_grad: float

    def held(self, layers: int, ac: bool) -> float:
        """Held through the forward until backward: every layer's gathered K/V and bias, or
        under checkpointing only the mask (the blocks save their inputs only)."""
        return self.mask if ac else layers * (self.kv_layer + self.bias)

    def recomputed(self, ac: bool) -> float:
        """What the one block recomputed in backward saves again (checkpointing only)."""
        return self.kv_layer + self.bias if ac else 0.0


NO_CONTEXT = ContextMemory(0.0, 0.0, 0.0, 0.0)


def context_memory(args: ModelArgs, micro_batch: int, seq_len: int, cp: int, e: int,
                   method: str = "allgather") -> ContextMemory:
    """The terms of ContextMemory for `micro_batch` sequences of seq_len over cp ranks by
    `method`, e the compute dtype's bytes (the exchanged tensors, their gradients and SDPA's
    bias are in it)."""
    if cp == 1:
        return NO_CONTEXT
    local = seq_len // cp
    if method == "ulysses":
        per_head = e * args.resolved_head_dim * micro_batch * local  # one head of the rank's tokens
        repeat = ulysses_kv_repeat(args.n_kv_heads, cp)
        exchanged = args.n_heads + 2 * args.n_kv_heads * repeat  # the heads of q, k and v the all-to-all carries
        return ContextMemory(kv_layer=2 * args.n_kv_heads * (repeat - 1) * per_head, mask=0.0, bias=0.0,
                             kv_grad=2 * exchanged * per_head)
    elements = micro_batch * local * seq_len  # mask elements: the rank's queries x every key
    kv = 2 * e * kv_dim(args) * micro_batch  # keys and values, per position
    return ContextMemory(kv_layer=kv * (seq_len - local), mask=MASK_BYTES * elements, bias=e * elements,
                         kv_grad=kv * seq_len)


def kv_gathered_bytes(args: ModelArgs, micro_batch: int, seq_len: int) -> float:
    """One all-gather's gathered tensor: the keys (or the values) of the whole sequences, bf16."""
    return 2 * micro_batch * seq_len * kv_dim(args)


def ulysses_exchange_bytes(args: ModelArgs, cp: int, micro_batch: int, seq_len: int) -> tuple[float, float]:
    """What one rank sends in each of a layer's two Ulysses all-to-alls, bf16: its seq/cp tokens'
    q, k and v (KV heads repeated where fewer than cp), then attention's output."""
    per_head = 2 * args.resolved_head_dim * micro_batch * seq_len // cp
    qkv = args.n_heads + 2 * args.n_kv_heads * ulysses_kv_repeat(args.n_kv_heads, cp)
    return qkv * per_head, args.n_heads * per_head


def context_traffic_s(args: ModelArgs, cp: int, micro_batch: int, seq_len: int, ac: bool, fabric: Fabric,
                      stride: int, method: str = "allgather") -> float:
    """Seconds of one micro-batch's cp exchanges on a rank, every layer, over cp ranks `stride`
    apart (neighbouring dp_shard ranks): the K/V all-gathers and reduce-scatters, or Ulysses'
    all-to-alls; 0 without cp."""
    if cp == 1:
        return 0.0
    if method == "ulysses":
        passes = ULYSSES_PASSES_CHECKPOINTED if ac else ULYSSES_PASSES
        qkv, out = ulysses_exchange_bytes(args, cp, micro_batch, seq_len)
        return args.n_layers * passes * (fabric.all_to_all_s(qkv, cp, stride) + fabric.all_to_all_s(out, cp, stride))
    per_layer = KV_COLLECTIVES_CHECKPOINTED if ac else KV_COLLECTIVES
    return args.n_layers * per_layer * fabric.all_gather_s(kv_gathered_bytes(args, micro_batch, seq_len), cp, stride)
