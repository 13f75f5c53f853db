"""Per-GPU memory of a training step: what each part of the model, optimizer and batch
takes, for any parallel layout duoka runs.

The number estimated is the peak of `torch.cuda.max_memory_allocated()` during a steady
training step: tensors PyTorch's caching allocator hands out. Not in it, and reported
separately as `reserved` (what nvidia-smi would show): the allocator's cached but unused
blocks (fragmentation), the CUDA context with its kernels, and NCCL's own buffers.

Mixed precision as the trainer runs it: fp32 master weights, fp32 gradients and the
optimizer's state (AdamW, the default: two fp32 moments, i.e. 16 bytes per parameter in all;
the other optimizers' state: duoka.plan.optimizer_costs), with bf16 compute. Two regimes:
- "bf16": FSDP2 casts the gathered parameters to bf16, so the whole forward (residual
  stream included) is bf16. Used for dp_mode=fsdp and for every tp/pp layout, which the
  trainer always runs through FSDP2.
- "autocast": DDP or a single process keeps fp32 weights and runs under torch.autocast.
  Matmuls see bf16 copies of the weights (kept until backward uses them), but the residual
  stream, the norms and the rotary step stay fp32.
- "fp32": everything in fp32 (CPU runs, the equivalence tests).

The peak is the largest of three moments of the step, each summed from its parts:
- "loss backward": the end of forward, when every activation saved for backward is alive
  and the cross-entropy backward runs on the logits (the peak of most configurations);
- "block backward": the first decoder block's backward, with the loss's buffers freed but
  (under activation checkpointing) one block recomputed;
- "end of backward": all gradients exist, activations are gone, the last gradient
  reduction is in flight (the peak of large models under activation checkpointing);
- "optimizer step": all gradients and what the optimizer's step allocates beyond its state
  (nothing for fused AdamW; torchao's low-bit AdamW, Adafactor and Muon work tensor by tensor
  with fp32 temporaries of the tensor being updated).

Activations are counted from the tensors each op of duoka's Qwen2 block saves for
backward (flash attention, so no seq x seq scores), the method of Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models" (arXiv:2205.05198,
section 4.1). Their GPT count, 34·s·b·h + 5·a·s²·b bytes per layer, does not apply as is:
no dropout masks, flash attention drops the 5·a·s²·b term, the MLP is SwiGLU (three
matrices of width I instead of two of 4h), and the RMSNorm keeps an fp32 copy. Their
sequence-parallel result carries over: under tp every saved tensor is divided by tp except
the all-gathered inputs of the column-parallel projections.

A mixture-of-experts model (duoka.plan.moe): its routed experts' fp32 weights, gradients and
optimizer state are divided by ep and then by the dp_shard / ep ranks FSDP2 shards them
over (experts / dp_shard per rank, as without ep), the rest by dp_shard; what FSDP2 holds
unsharded (gathered bf16 blocks, gradients while accumulating, reduce-scatter buffers) has
num_experts / ep experts per layer. A MoE layer saves its k routed copies of each token, their
SwiGLU intermediates, the shared expert's and the router's probabilities; under ep one
layer's dispatch buffers are in flight in its backward. Not yet measured on a GPU.

Context parallelism (layout.cp, duoka.plan.context): a rank holds seq_len / cp tokens of each
sequence, which every per-token term counts; FSDP2 still shards over all of dp_shard. Beyond
them (the `context` part): by all-gather, the gathered keys and values each layer saves for
SDPA's backward, the dense attention mask and SDPA's per-layer bias copy of it; by Ulysses, the
repeated KV heads and the exchange's buffers. Not yet measured on a GPU.

Checked against 23 peaks measured on H200 (0.5B to 7B, one and two GPUs, DDP, FSDP2, tp
and pp, with and without checkpointing and accumulation): all within 2%
(bench/results/plan_memory.md; tests/unit/test_planner.py keeps them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.context_parallel import CONTEXT_METHODS, resolve_context_method
from duoka.models.qwen2.stages import stage_layer_counts
from duoka.plan.context import NO_CONTEXT, ContextMemory, check_context, context_memory
from duoka.plan.moe import (
    all_to_all_buffers,
    check_moe_layout,
    expert_split,
    is_moe,
    moe_backward_transient,
    moe_saved_per_token,
)
from duoka.plan.optimizer_costs import ADAMW, OptimizerChoice, rank_footprint

GIB = 2**30

# The caching allocator reserves more than it hands out: blocks are split and cached by
# size, so varying shapes leave holes. A few percent in steady training; the planner adds
# it to the allocated peak (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lowers it).
FRAGMENTATION = 0.05
# The CUDA context (kernel images of torch, cuBLAS, flash attention) lives outside the
# caching allocator: about 0.5-0.6 GiB on an H100/H200 with torch 2.x.
CUDA_CONTEXT_BYTES = 0.6 * GIB
# NCCL allocates its channel buffers with cudaMalloc, outside the allocator: a few hundred
# MiB per process for the collectives of a training step (more with many communicators).
NCCL_BYTES = 0.5 * GIB
# Bytes per parameter of training state: fp32 weights (4) and fp32 gradients (4); the
# optimizer's state by duoka.plan.optimizer_costs (AdamW: exp_avg and exp_avg_sq, 4 + 4).
WEIGHT_BYTES, GRAD_BYTES = 4, 4
# Cross-entropy on the logits, per vocabulary entry per token, at its peak (the start of
# its backward): the fp32 log-probabilities log_softmax saved (4), their gradient from the
# NLL backward (4, dense) and the gradient of the logits it produces (4). The bf16 logits
# and their fp32 copy are already freed then (the trainer drops them before backward).
LOSS_BYTES_PER_LOGIT = 12
# Under tp the loss runs on vocabulary-sharded DTensor logits (loss_parallel), whose
# log-softmax backward materialises exp(log-probabilities) as well: 4 more.
LOSS_PARALLEL_EXTRA_BYTES = 4
# A pipeline schedule keeps each micro-batch's stage output, here the bf16 logits, until
# that micro-batch's backward.
PIPELINE_LOGITS_BYTES = 2
# training.fused_loss (duoka.models.loss): the head and the loss run over chunks of this many
# tokens (its CHUNK_TOKENS, compiled), each chunk's bf16 logits and their bf16 gradient alive
# together; forward keeps the hidden states' gradient (compute dtype) and the head's fp32
# gradient until backward. Measured: Qwen2-7B at 8K to 64K tokens on one H100, 0.3-3.2% above
# the estimate (bench/results/long_context.md).
FUSED_LOSS_CHUNK_TOKENS = 4096
FUSED_LOSS_BYTES_PER_LOGIT = 2 + 2

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")


@dataclass(frozen=True)
class Layout:
    """A parallel layout, with the same names and meaning as the [parallel] config section:
    world = dp_replicate x dp_shard x tp x pp; ep (expert parallelism, mixture-of-experts
    models) splits dp_shard into dp_shard / ep groups of ep neighbours (duoka.plan.moe); cp
    (context parallelism) splits each sequence over cp neighbouring dp_shard ranks that share
    one batch (duoka.plan.context), its attention by cp_method: allgather or ulysses (resolved,
    never auto; allgather where cp is 1)."""

    dp_mode: str = "ddp"
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_stages_per_rank: int = 1
    reshard_after_forward: bool = True
    ep: int = 1
    cp: int = 1
    cp_method: str = "allgather"

    def __post_init__(self):
        if self.dp_mode not in ("ddp", "fsdp"):
            raise DuokaError(f"dp_mode={self.dp_mode!r} is not a data-parallel mode", "use ddp or fsdp")
        if self.dp_mode == "ddp" and self.dp_shard != 1:
            raise DuokaError(f"dp_shard={self.dp_shard} needs dp_mode=fsdp (ddp does not shard)")
        if self.pp_schedule not in PP_SCHEDULES:
            raise DuokaError(f"pp_schedule={self.pp_schedule!r} is unknown", f"choose one of {', '.join(PP_SCHEDULES)}")
        for name in ("dp_replicate", "dp_shard", "tp", "pp", "pp_stages_per_rank", "ep", "cp"):
            if getattr(self, name) < 1:
                raise DuokaError(f"{name}={getattr(self, name)} must be >= 1")
        if self.ep > 1 and (self.dp_mode != "fsdp" or self.dp_shard % self.ep):
            raise DuokaError(f"ep={self.ep} splits the experts over dp_shard ranks, but dp_mode={self.dp_mode} with "
                             f"dp_shard={self.dp_shard}", "use dp_mode=fsdp and an ep dividing dp_shard")
        if self.cp > 1:
            self._check_context()

    def _check_context(self) -> None:
        """cp as duoka.parallel.dims admits it: FSDP2 ranks of dp_shard, not with tp, pp or ep."""
        if self.dp_mode != "fsdp" or self.dp_shard % self.cp:
            raise DuokaError(f"cp={self.cp} splits each sequence over dp_shard ranks, but dp_mode={self.dp_mode} with "
                             f"dp_shard={self.dp_shard}", "use dp_mode=fsdp and a cp dividing dp_shard")
        others = [f"{name}={getattr(self, name)}" for name in ("tp", "pp", "ep") if getattr(self, name) > 1]
        if others:
            raise DuokaError(f"cp={self.cp} does not combine with {', '.join(others)} (the trainer refuses it)",
                             "plan cp with fsdp or hsdp only, or cp=1")
        if self.cp_method not in CONTEXT_METHODS:
            raise DuokaError(f"cp_method={self.cp_method!r} is not a context-parallel method",
                             f"use one of {', '.join(CONTEXT_METHODS)}")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: ranks with batches of their own (a cp group shares one)."""
        return self.dp_replicate * self.dp_shard // self.cp

    @property
    def fsdp_size(self) -> int:
        """Ranks FSDP2 shards the parameters over and averages the gradients over, cp ranks included."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> bool:
        """FSDP2 manages the parameters: dp_mode=fsdp, and every tp/pp layout (DDP does not
        take DTensor parameters or pipeline stages, so the trainer replicates through an
        FSDP2 mesh whose shard dimension is 1)."""
        return self.dp_mode == "fsdp" or self.tp > 1 or self.pp > 1

    @property
    def ddp_wrapper(self) -> bool:
        """torch's DistributedDataParallel is used (only without tp/pp, with > 1 replica)."""
        return not self.fsdp and self.dp_replicate > 1

    @property
    def stages_per_rank(self) -> int:
        return self.pp_stages_per_rank if self.pp > 1 else 1

    @property
    def expert_shard(self) -> int:
        """Ranks FSDP2 shards the routed experts over: the dp_shard / ep holding the same experts."""
        return self.dp_shard // self.ep if self.fsdp else 1

    def describe(self, compact: bool = False) -> str:
        """The layout in words: `fsdp 4 + pp 2 interleaved x2`. compact (for narrow tables): each
        part glued to its size and the parts joined by "+", in the style of `duoka bench --layout`:
        `fsdp4+pp2 interleaved×2`; expert and context parallelism follow the data-parallel part:
        `fsdp 8 + ep 4`, `fsdp 8 + cp 8`, `fsdp 8 + cp 4 ulysses` (compact: `cp4-ulysses`)."""
        sp = "" if compact else " "
        parts = []
        if self.dp_mode == "fsdp" and self.dp_replicate > 1:
            parts.append(f"hsdp{sp}{self.dp_replicate}x{self.dp_shard}")
        elif self.dp_mode == "fsdp" and (self.dp_shard > 1 or self.tp == self.pp == 1):
            parts.append(f"fsdp{sp}{self.dp_shard}")
        elif self.dp_replicate > 1:
            parts.append(f"ddp{sp}{self.dp_replicate}")
        if self.ep > 1:
            parts.append(f"ep{sp}{self.ep}")
        if self.cp > 1:
            parts.append(f"cp{sp}{self.cp}" + (("-" if compact else " ") + "ulysses" if self.cp_method == "ulysses"
                                                else ""))
        if self.tp > 1:
            parts.append(f"tp{sp}{self.tp}")
        if self.pp > 1:
            if self.pp_schedule == "interleaved_1f1b":
                sched = f"interleaved×{self.pp_stages_per_rank}" if compact else \
                    f"interleaved x{self.pp_stages_per_rank}"
            else:
                sched = self.pp_schedule.replace("_", "-" if compact else " ")
            parts.append(f"pp{sp}{self.pp} {sched}")
        if self.dp_mode == "fsdp" and self.pp == 1 and not self.reshard_after_forward:
            parts.append("noreshard" if compact else "no reshard")
        return ("+" if compact else " + ").join(parts) or "single GPU"


def layout_from_config(parallel, world_size: int, n_heads: int | None = None) -> Layout:
    """The Layout of a [parallel] config section (duoka.config.ParallelConfig) on
    world_size processes, resolving the -1 (auto) sizes as the trainer does; cp_method=auto
    needs the model's n_heads to resolve."""
    tp, pp = parallel.tp, parallel.pp
    if world_size % (tp * pp):
        raise DuokaError(f"tp x pp = {tp * pp} does not divide the {world_size} processes")
    dp_world = world_size // (tp * pp)
    rep, shard = parallel.dp_replicate, parallel.dp_shard
    if parallel.dp_mode == "ddp":
        shard, rep = 1, dp_world if rep == -1 else rep
    else:
        rep = 1 if rep == -1 else rep
        shard = dp_world // rep if shard == -1 else shard
    method = "allgather"
    if parallel.cp > 1:
        if parallel.cp_method == "auto" and n_heads is None:
            raise DuokaError("parallel.cp_method=auto depends on the model's attention heads",
                             "pass n_heads, or a config whose cp_method is allgather or ulysses")
        method = resolve_context_method(parallel.cp_method, parallel.cp, n_heads or 0)
    layout = Layout(parallel.dp_mode, rep, shard, tp, pp, parallel.pp_schedule,
                    parallel.pp_stages_per_rank if pp > 1 else 1, parallel.reshard_after_forward, parallel.ep,
                    parallel.cp, method)
    if layout.world_size != world_size:
        raise DuokaError(f"dp_replicate x dp_shard x tp x pp = {layout.world_size}, but {world_size} processes run")
    return layout


# ---------------------------------------------------------------- shapes


def block_params(args: ModelArgs) -> tuple[int, int, int]:
    """(all parameters, tensor-parallel-sharded parameters, matmul weights) of one dense
    decoder block. The two RMSNorm gains (2·dim) are the only part tp replicates. A MoE
    model's layers: duoka.plan.moe.expert_split."""
    hd, h = args.resolved_head_dim, args.dim
    qkv = h * hd * (args.n_heads + 2 * args.n_kv_heads)
    matmul = qkv + args.n_heads * hd * h + 3 * h * args.intermediate_size
    sharded = matmul + hd * (args.n_heads + 2 * args.n_kv_heads)  # + the q/k/v biases, split with their heads
    return sharded + 2 * h, sharded, matmul


# FSDP2's host work per unit in forward (hooks, all-gather set-up, copy-out, stream waits)
# is ~1.4 ms: a unit whose compiled forward is shorter leaves the GPU waiting for the host and
# its all-gathers exposed. A unit of at least this many parameter-tokens per micro-batch
# (~3 ms of compiled forward on an H200) keeps the GPU ahead (docs/performance.md).
UNIT_PARAM_TOKENS = 5e11


def auto_blocks_per_unit(args: ModelArgs, micro_batch: int, seq_len: int, tp: int, reshard_after_forward: bool) -> int:
    """parallel.fsdp_blocks_per_unit=-1: the fewest consecutive blocks per FSDP2 unit whose
    forward carries UNIT_PARAM_TOKENS, when the weights stay gathered from forward to
    backward anyway (no extra memory); 1 with resharding."""
    if reshard_after_forward:
        return 1
    if is_moe(args):
        # The forward's work is the weights a token passes through: a MoE layer's active ones
        # (top-k experts), averaged over the layers (tp does not run with MoE).
        block_local = (args.matmul_params() - args.vocab_size * args.dim) / args.n_layers
    else:
        p_block, p_block_tp, _ = block_params(args)
        block_local = p_block_tp / tp + (p_block - p_block_tp)
    return max(1, min(args.n_layers, math.ceil(UNIT_PARAM_TOKENS / (block_local * micro_batch * seq_len))))


def regime_of(layout: Layout, bf16: bool = True) -> str:
    if not bf16:
        return "fp32"
    return "bf16" if layout.fsdp else "autocast"


@dataclass(frozen=True)
class SavedPerToken:
    """Bytes saved for backward per token, by one decoder block (and the pieces around it)."""

    block: float  # a whole block, no checkpointing
    block_input: float  # what full activation checkpointing keeps per block: its input
    final_norm: float  # the final RMSNorm and the head's input, on the rank holding the head
    backward_transient: float  # gradients of a block's intermediates while its backward runs
    moe_block: float = 0.0  # a MoE layer, no checkpointing (0 for a dense model)
    moe_transient: float = 0.0  # a MoE layer's backward in flight


def saved_per_token(args: ModelArgs, regime: str, tp: int = 1, ep: int = 1) -> SavedPerToken:
    """Count of the tensors each op of duoka's TransformerBlock saves for backward
    (duoka/models/qwen2/model.py), per token, in bytes.

    RMSNorm `w * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)`: pow and mul save the fp32 x
    (a copy in bf16, x itself in fp32), the weight multiply saves the normalised x in the
    compute dtype; the rsqrt per token is negligible. The projections save their input:
    one tensor shared by q/k/v (and one by gate/up) in bf16; under autocast each linear
    saves its own bf16 cast of the fp32 norm output (autocast caches casts of weights only).
    Rotary embedding multiplies by tables that need no gradient: nothing saved. Flash
    attention saves q, k, v, its output (also the o projection's input) and a fp32
    logsumexp per head. SwiGLU saves gate (for silu), silu(gate), up and their product.
    The residual adds save nothing.

    Under tp with sequence parallelism the norms and the block input are sequence-sharded,
    the projections and attention head-sharded (all / tp), but the projections' inputs are
    the all-gathered full sequence: torch's ColwiseParallel saves the gathered tensor
    (Korthikanti et al. re-gather it in backward instead; torch does not).

    A MoE layer (tp 1 only) saves its sparse MLP's tensors instead of the SwiGLU's
    (duoka.plan.moe.moe_saved_per_token; ep: its dispatch's indices), and one input: the
    norm output every part reads, under autocast cast once per linear (router, the shared
    expert's gate, gate and up projections; the experts cast their gathered rows, counted
    there)."""
    h, i = args.dim, args.intermediate_size
    q = args.n_heads * args.resolved_head_dim
    kv = args.n_kv_heads * args.resolved_head_dim
    if regime == "bf16":
        norm = 4 * h + 2 * h  # fp32 copy + bf16 normalised
        attn_input, mlp_input, head_input = 2 * h, 2 * h, 2 * h
        block_input, moe_input = 2 * h, 2 * h
        e = 2
    elif regime == "autocast":
        norm = 4 * h + 4 * h  # the fp32 input itself + fp32 normalised
        attn_input, mlp_input, head_input = 3 * 2 * h, 2 * 2 * h, 2 * h  # one bf16 cast per linear
        block_input, moe_input = 4 * h, 4 * 2 * h  # the residual stream is fp32
        e = 2
    elif regime == "fp32":
        norm = 4 * h + 4 * h
        attn_input, mlp_input, head_input = 4 * h, 4 * h, 4 * h
        block_input, moe_input = 4 * h, 4 * h
        e = 4
    else:
        raise ValueError(f"unknown precision regime {regime!r}")
    attention = e * (2 * q + 2 * kv) + 4 * args.n_heads  # q, k, v, out + logsumexp (fp32)
    mlp = 4 * e * i
    block = (2 * norm + attention + mlp) / tp + attn_input + mlp_input
    # Backward of the MLP holds the gradients of the product, of silu(gate) and of up, and
    # then of gate: about three I-wide tensors at once, plus the incoming gradient.
    transient = (3 * e * i) / tp + 2 * e * h
    moe_block = moe_transient = 0.0
    if is_moe(args):
        moe_block = (2 * norm + attention) / tp + attn_input + moe_input + moe_saved_per_token(args, e, ep)
        moe_transient = moe_backward_transient(args, e)
    return SavedPerToken(block=block, block_input=block_input / tp, final_norm=norm / tp + head_input,
                         backward_transient=transient, moe_block=moe_block, moe_transient=moe_transient)


def in_flight(layout: Layout, pp_rank: int, microbatches: int) -> int:
    """Forward passes (of one pipeline stage each) whose activations a pipeline rank holds
    at its peak. GPipe runs every micro-batch forward first; 1F1B holds at most pp - rank
    (Narayanan et al. 2021, arXiv:2104.04473, section 2.2); the interleaved schedules hold
    (v-1)·pp + 2·(pp-1-rank) + 1 stage-forwards, torch's warm-up count plus the one
    running (section 2.2 of the same paper: about (1 + (pp-1)/(pp·v)) times 1F1B)."""
    pp, v, m = layout.pp, layout.stages_per_rank, microbatches
    if pp == 1:
        return 1
    if layout.pp_schedule == "gpipe":
        return m * v
    if layout.pp_schedule == "1f1b":
        return min(m, pp - pp_rank)
    return min(m * v, (v - 1) * pp + 2 * (pp - 1 - pp_rank) + 1)


# ---------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class MemoryBreakdown:
    """Per-GPU bytes at the peak moment of a training step, on the pipeline rank with the
    largest peak. `allocated` is the sum of the parts and is comparable to
    torch.cuda.max_memory_allocated(); `reserved` adds what the allocator does not count."""

    parameters: float  # fp32 master weights held by this rank (sharded or replicated)
    gradients: float  # fp32 gradients present at the peak (sharded, or unsharded while accumulating)
    optimizer: float  # the optimizer's state on the GPU (AdamW: two fp32 moments)
    gathered_parameters: float  # bf16 weights: FSDP all-gather buffers and unsharded root, or autocast's casts
    activations: float  # tensors saved for backward (and a recomputed block under checkpointing)
    logits: float  # cross-entropy buffers on the rank that holds the output head
    communication: float  # DDP gradient buckets, FSDP reduce-scatter buffers, pipeline receive buffers
    optimizer_step: float  # what the optimizer's step allocates beyond its state (at that moment only)
    phase: str  # the moment of the step the peak falls on
    pp_rank: int  # the pipeline rank this breakdown is for (0 without pp)
    phases: dict[str, float] = field(default_factory=dict)  # total at each moment, for this rank
    world_size: int = 1
    host: float = 0.0  # host memory of this rank: an offloaded optimizer's state and pinned copies (not in allocated)
    context: float = 0.0  # cp: what its attention's exchange adds (plan.context: gathered K/V, mask, biases; ulysses' buffers)

    @property
    def allocated(self) -> float:
        return (self.parameters + self.gradients + self.optimizer + self.gathered_parameters + self.activations
                + self.logits + self.communication + self.optimizer_step + self.context)

    @property
    def reserved(self) -> float:
        """What the process holds on the GPU: the allocated peak plus fragmentation, the CUDA
        context and (with more than one process) NCCL's buffers."""
        nccl = NCCL_BYTES if self.world_size > 1 else 0.0
        return self.allocated * (1 + FRAGMENTATION) + CUDA_CONTEXT_BYTES + nccl

    def parts(self) -> dict[str, float]:
        """The GPU parts that sum to `allocated`."""
        return {k: v for k, v in asdict(self).items() if isinstance(v, float) and k != "host"}

    def to_dict(self) -> dict:
        return {**{k: round(v / GIB, 3) for k, v in self.parts().items()}, "allocated": round(self.allocated / GIB, 3),
                "reserved": round(self.reserved / GIB, 3), "host": round(self.host / GIB, 3), "phase": self.phase,
                "pp_rank": self.pp_rank, "phases": {k: round(v / GIB, 3) for k, v in self.phases.items()},
                "unit": "GiB"}


def estimate_memory(args: ModelArgs, layout: Layout, micro_batch: int, seq_len: int, activation_checkpointing: bool,
                    accumulation: int = 1, bf16: bool = True, pp_rank: int | None = None,
                    optimizer: OptimizerChoice = ADAMW, fused_loss: bool = False) -> MemoryBreakdown:
    """Peak memory per GPU of one training step.

    accumulation: micro-batches per optimizer step on each rank (under pp, the pipeline's
    micro-batches). It matters: while gradients accumulate, DDP holds them all, and FSDP2
    with gradient sync off (the trainer's no-sync accumulation, and the pipeline schedules')
    keeps them unsharded in fp32. pp_rank: the pipeline rank to estimate; None: the one
    with the largest peak. optimizer: optimizer.name / optimizer.offload (AdamW by default).
    fused_loss: training.fused_loss (head and loss chunk by chunk; not under tp or pp).
    A mixture-of-experts model: its routed experts shard as duoka.plan.moe describes (layout.ep).
    Under cp each rank holds seq_len / cp tokens of each sequence (duoka.plan.context)."""
    if micro_batch < 1 or seq_len < 1 or accumulation < 1:
        raise DuokaError("micro_batch, seq_len and accumulation must be >= 1")
    check_moe_layout(args, layout.dp_shard, layout.tp, layout.pp, layout.ep)
    check_context(args, layout.cp, seq_len, layout.cp_method)
    if fused_loss and (layout.tp > 1 or layout.pp > 1):
        raise DuokaError("training.fused_loss runs neither under tp nor under pp (the trainer turns it off there)")
    regime = regime_of(layout, bf16)
    if pp_rank is not None:
        if not 0 <= pp_rank < layout.pp:
            raise DuokaError(f"pp_rank={pp_rank} is not a pipeline rank of pp={layout.pp}")
        return _rank_memory(args, layout, pp_rank, micro_batch, seq_len, activation_checkpointing, accumulation,
                            regime, optimizer, fused_loss)
    best = None
    for r in range(layout.pp):
        b = _rank_memory(args, layout, r, micro_batch, seq_len, activation_checkpointing, accumulation, regime,
                         optimizer, fused_loss)
        if best is None or b.allocated > best.allocated:
            best = b
    return best


@dataclass(frozen=True)
class _RankShare:
    """Parameters one pipeline rank holds, after tp (before data-parallel sharding)."""

    layers: int  # decoder layers over all the stages of this rank
    has_embedding: bool
    has_head: bool
    block_local: float  # one decoder block's (the largest; a MoE layer's with its routed experts / ep)
    block_matmul: int  # one decoder block's matmul weights, before tp (a MoE layer's with every expert)
    vocab_rows: float  # one vocabulary matrix (the embedding or the head)
    root: float  # FSDP's root unit: embedding, final norm, output head
    local: float  # all of them: the layers and the root
    matmul_local: float  # the matmul weights among them (the head's included)
    experts: float = 0.0  # of `local`, the routed experts this rank's ep group position holds: all / ep

    def sharded(self, layout: Layout) -> float:
        """Parameters left on the rank after FSDP2: the routed experts over the dp_shard / ep
        ranks holding the same ones, the rest over dp_shard (1 without FSDP)."""
        shard = layout.dp_shard if layout.fsdp else 1
        return (self.local - self.experts) / shard + self.experts / layout.expert_shard


def _moe_share(args: ModelArgs, layout: Layout) -> _RankShare:
    """A MoE model's one rank (no tp or pp: duoka.plan.moe.check_moe_layout): every layer, the
    embedding and the head; of the routed experts num_experts / ep of each layer."""
    split = expert_split(args)
    vocab_rows = args.vocab_size * args.dim
    root = vocab_rows + args.dim + (0 if args.tie_word_embeddings else vocab_rows)
    experts = split.experts / layout.ep
    moe_block = split.moe_layer + split.layer_experts / layout.ep
    block_local = max(moe_block, split.dense_layer if split.dense_layers else 0)
    dense_matmul = split.attention_matmul + 3 * args.dim * args.intermediate_size
    block_matmul = max(split.moe_matmul + split.layer_experts, dense_matmul if split.dense_layers else 0)
    # autocast (one GPU, DDP: ep 1) casts every matmul weight, each expert's included
    matmul_local = (split.dense_layers * dense_matmul + split.moe_layers * (split.moe_matmul + split.layer_experts)
                    + vocab_rows)
    local = split.dense_layers * split.dense_layer + split.moe_layers * split.moe_layer + experts + root
    return _RankShare(args.n_layers, True, True, block_local, block_matmul, vocab_rows, root, local, matmul_local,
                      experts)


def _rank_share(args: ModelArgs, layout: Layout, pp_rank: int) -> _RankShare:
    """The stages of pipeline rank `pp_rank` (v per rank, interleaved) and what they hold."""
    if is_moe(args):
        return _moe_share(args, layout)
    tp, pp, v = layout.tp, layout.pp, layout.stages_per_rank
    n_stages = pp * v
    stages = [pp_rank + k * pp for k in range(v)]
    counts = stage_layer_counts(args.n_layers, n_stages)
    layers = sum(counts[s] for s in stages)
    has_embedding, has_head = 0 in stages, (n_stages - 1) in stages
    p_block, p_block_tp, p_block_mm = block_params(args)
    block_local = p_block_tp / tp + (p_block - p_block_tp)
    vocab_rows = args.vocab_size * args.dim / tp
    root = 0.0
    if has_embedding:
        root += vocab_rows
    if has_head:
        # A tied head shares the embedding on the same rank; a later pipeline stage keeps its
        # own copy of the tied weight.
        root += args.dim + (0 if (args.tie_word_embeddings and has_embedding) else vocab_rows)
    local = layers * block_local + root
    matmul_local = layers * p_block_mm / tp + (vocab_rows if has_head else 0)
    return _RankShare(layers, has_embedding, has_head, block_local, p_block_mm, vocab_rows, root, local, matmul_local)


@dataclass(frozen=True)
class _GradientsAndWeights:
    """Bytes of gradients, bf16 weights and gradient buffers at the moments of the step."""

    grads_live: float  # gradients alive through forward and backward (accumulated ones)
    grads_end: float  # every gradient, at the end of backward and in the optimizer step
    head_grads: float  # gradients that exist during the blocks' backward without accumulation
    gathered: float  # bf16 weights held through forward and backward
    recompute_casts: float  # autocast's casts of a block recomputed under checkpointing
    gathered_end: float  # bf16 weights still held at the end of backward
    buckets: float  # DDP's flat gradient buckets
    comm_block: float  # a block's gradient reduction buffers during its backward
    comm_end: float  # the last (root) reduction's buffers at the end of backward


def _fsdp_gradients(share: _RankShare, layout: Layout, accumulating: bool, low: int) -> _GradientsAndWeights:
    """Under FSDP2 (dp_mode=fsdp and every tp/pp layout)."""
    shard = layout.dp_shard
    local, root, block_local = share.local, share.root, share.block_local
    # Accumulation without sync (and every pipeline schedule) keeps unsharded fp32 grads.
    grads_live = GRAD_BYTES * local if accumulating else 0.0
    if layout.pp > 1 or not layout.reshard_after_forward:
        # The trainer keeps a stage's weights gathered between forward and backward
        # under pp (torchtitan's choice); reshard_after_forward=false does it anyway.
        gathered = low * local
    else:
        # The root stays gathered from forward to backward (reshard_after_forward=False
        # on it); one block gathered for compute and the next prefetched.
        gathered = low * root + 2 * low * block_local
    # Routed experts reduce-scatter over the dp_shard / ep ranks holding them (duoka.plan.moe).
    grads_end = GRAD_BYTES * ((local - root - share.experts) / shard + share.experts / layout.expert_shard)
    # The root's reduce-scatter comes last: the fp32 input buffer, and either the bf16
    # gradients being copied in (fp32 accumulated ones while accumulating) or the output.
    root_grads = (GRAD_BYTES if accumulating else low) * root
    comm_end = GRAD_BYTES * root + max(root_grads, GRAD_BYTES * root / shard)
    # A block's backward: its bf16 gradients and their fp32 reduce-scatter buffer.
    comm_block = (low + GRAD_BYTES) * block_local
    # Gradients that exist during the blocks' backward without accumulation: the
    # output head's, in bf16 (reduced with the root's at the very end).
    head_grads = low * share.vocab_rows if share.has_head and not accumulating else 0.0
    return _GradientsAndWeights(grads_live, grads_end, head_grads, gathered, recompute_casts=0.0,
                                gathered_end=0.0,  # resharded before reducing
                                buckets=0.0, comm_block=comm_block, comm_end=comm_end)


def _replicated_gradients(share: _RankShare, layout: Layout, ac: bool, accumulating: bool,
                          regime: str) -> _GradientsAndWeights:
    """Under DDP or on a single GPU: whole fp32 weights and gradients on every rank."""
    grads_live = GRAD_BYTES * share.local if accumulating else 0.0
    grads_end = GRAD_BYTES * share.local
    # DDP's reducer keeps flat fp32 buckets the size of all gradients.
    buckets = GRAD_BYTES * share.local if layout.ddp_wrapper else 0.0
    # Autocast's bf16 copy of each matmul weight is saved for backward (autocast only
    # runs without tp/pp: one stage, one forward in flight). Checkpointed blocks save
    # nothing, so only the head's copy stays; each block casts again when recomputed.
    head_mm = share.vocab_rows if share.has_head else 0.0
    cast = 2 if regime == "autocast" else 0
    gathered = cast * (head_mm if ac else share.matmul_local)
    recompute_casts = cast * share.block_matmul / layout.tp if ac else 0.0
    head_grads = GRAD_BYTES * share.vocab_rows if share.has_head and not accumulating else 0.0
    return _GradientsAndWeights(grads_live, grads_end, head_grads, gathered, recompute_casts, gathered_end=0.0,
                                buckets=buckets, comm_block=0.0, comm_end=0.0)


@dataclass(frozen=True)
class _Activations:
    """Bytes of activations and loss buffers on one rank, and how many forwards it holds."""

    held: float  # tensors saved for backward by the stage-forwards in flight
    final_norm: float  # the final norm's and the head's saved inputs, on the rank with the head
    logits: float  # the cross-entropy's buffers, on the rank with the head
    recompute: float  # one block recomputed under checkpointing
    transient: float  # gradients of a block's intermediates while its backward runs
    p2p: float  # pipeline receive buffers
    in_flight: int  # stage-forwards held at the peak
    all_to_all: float = 0.0  # a MoE layer's dispatch buffers in its backward, under ep > 1
    context_held: float = 0.0  # cp: what every layer keeps until backward (ContextMemory.held)
    context_backward: float = 0.0  # cp: that, the recomputed block's, and the gathered K/V's gradients


def _activations(args: ModelArgs, layout: Layout, share: _RankShare, pp_rank: int, tokens: int, ac: bool,
                 accumulation: int, regime: str, context: ContextMemory = NO_CONTEXT,
                 fused_loss: bool = False) -> _Activations:
    """Activations of `tokens` per micro-batch on this rank (saved_per_token's counts), and
    under cp what the gathered attention adds (`context`)."""
    tp, pp, v = layout.tp, layout.pp, layout.stages_per_rank
    saved = saved_per_token(args, regime, tp, layout.ep)
    flight = in_flight(layout, pp_rank, accumulation)  # stage-forwards held
    layers_per_forward = share.layers / v
    per_layer = saved.block_input if ac else saved.block
    if is_moe(args):  # one rank holds every layer (no pp): each kind of layer its own count
        n_moe = len(args.moe_layers)
        per_moe_layer = saved.block_input if ac else saved.moe_block
        held = flight * ((share.layers - n_moe) * per_layer + n_moe * per_moe_layer) * tokens
    else:
        held = flight * layers_per_forward * per_layer * tokens
    final_norm = saved.final_norm * tokens if share.has_head else 0.0
    loss_bytes = (LOSS_BYTES_PER_LOGIT + (LOSS_PARALLEL_EXTRA_BYTES if tp > 1 else 0)
                  + (PIPELINE_LOGITS_BYTES if pp > 1 else 0))
    if not share.has_head:
        logits = 0.0
    elif fused_loss:
        low = 4 if regime == "fp32" else 2
        logits = (FUSED_LOSS_BYTES_PER_LOGIT * args.vocab_size * min(tokens, FUSED_LOSS_CHUNK_TOKENS)
                  + low * args.dim * tokens + GRAD_BYTES * args.vocab_size * args.dim)
    else:
        logits = loss_bytes * args.vocab_size / tp * tokens
    recompute = (max(saved.block, saved.moe_block) if ac else 0.0) * tokens
    transient = max(saved.backward_transient, saved.moe_transient) * tokens
    # Pipeline receive buffers: one bf16 activation from the previous stage and one
    # gradient from the next, per stage the rank holds.
    p2p = 2 * 2 * args.dim * tokens * v if pp > 1 else 0.0
    all_to_all = all_to_all_buffers(args, tokens, layout.ep) if is_moe(args) else 0.0
    # A layer's backward holds its MLP's gradients, then its attention's: the larger counts.
    context_held = context.held(share.layers, ac)
    context_backward = context_held + context.recomputed(ac) + max(0.0, context.kv_grad - transient)
    return _Activations(held, final_norm, logits, recompute, transient, p2p, flight, all_to_all, context_held,
                        context_backward)


def _moments(g: _GradientsAndWeights, a: _Activations, step_transient: float,
             accumulation: int) -> dict[str, dict[str, float]]:
    """The parts of each moment of the step beyond the weights and the optimizer's state, in
    the order ties between moments go to the first."""
    moments = {}
    if accumulation > 1 and a.in_flight >= accumulation:
        # A pipeline rank that runs every micro-batch's forward before its first backward
        # (GPipe; 1F1B with m <= pp - rank) peaks before any gradient exists; its next
        # backward has gradients and one forward's activations fewer.
        grads_first = 0.0
        moments["later backward"] = {"gradients": g.grads_live + g.head_grads, "gathered_parameters": g.gathered,
                                     "activations": a.held * (a.in_flight - 1) / a.in_flight + a.final_norm,
                                     "logits": a.logits, "communication": g.buckets + a.p2p}
    else:
        grads_first = g.grads_live
    moments["loss backward"] = {"gradients": grads_first, "gathered_parameters": g.gathered,
                                "activations": a.held + a.final_norm, "logits": a.logits,
                                "communication": g.buckets + a.p2p, "context": a.context_held}
    moments["block backward"] = {"gradients": grads_first + g.head_grads,
                                 "gathered_parameters": g.gathered + g.recompute_casts,
                                 "activations": a.held + a.recompute + a.transient, "logits": 0.0,
                                 "communication": g.buckets + a.p2p + g.comm_block + a.all_to_all,
                                 "context": a.context_backward}
    moments["end of backward"] = {"gradients": g.grads_end, "gathered_parameters": g.gathered_end,
                                  "activations": 0.0, "logits": 0.0, "communication": g.buckets + g.comm_end}
    # The step runs after the last reduction: every gradient, sharded, and DDP's buckets (kept
    # between steps). Ties with the end of backward go to it (inserted first): fused AdamW
    # allocates nothing more.
    moments["optimizer step"] = {"gradients": g.grads_end, "gathered_parameters": 0.0, "activations": 0.0,
                                 "logits": 0.0, "communication": g.buckets, "optimizer_step": step_transient}
    return moments


def _rank_memory(args: ModelArgs, layout: Layout, pp_rank: int, micro_batch: int, seq_len: int, ac: bool,
                 accumulation: int, regime: str, optimizer: OptimizerChoice, fused_loss: bool) -> MemoryBreakdown:
    share = _rank_share(args, layout, pp_rank)
    shard = layout.dp_shard if layout.fsdp else 1
    accumulating = accumulation > 1
    low = 4 if regime == "fp32" else 2  # bytes of a compute-dtype weight or gradient
    parameters = WEIGHT_BYTES * share.sharded(layout)
    opt = rank_footprint(args, share.layers, share.has_embedding, share.has_head, layout.tp, optimizer, shard)
    if layout.fsdp:
        grads = _fsdp_gradients(share, layout, accumulating, low)
    else:
        grads = _replicated_gradients(share, layout, ac, accumulating, regime)
    # Under cp the rank holds seq_len / cp tokens of each sequence, and the gathered attention's extras.
    context = context_memory(args, micro_batch, seq_len, layout.cp, low, layout.cp_method)
    acts = _activations(args, layout, share, pp_rank, micro_batch * seq_len // layout.cp, ac, accumulation, regime,
                        context, fused_loss)
    moments = _moments(grads, acts, opt.step_transient, accumulation)
    persistent = parameters + opt.gpu_state
    totals = {name: persistent + sum(parts.values()) for name, parts in moments.items()}
    phase = max(totals, key=totals.get)
    parts = {"optimizer_step": 0.0, **moments[phase]}
    return MemoryBreakdown(parameters=float(parameters), optimizer=float(opt.gpu_state),
                           **{k: float(x) for k, x in parts.items()}, phase=phase, pp_rank=pp_rank,
                           phases=totals, world_size=layout.world_size, host=float(opt.host))


# ---------------------------------------------------------------- used by the trainer


def training_bytes(args: ModelArgs, micro_batch: int, seq_len: int, dp_shard: int, activation_checkpointing: bool,
                   bf16: bool = True, *, tp: int = 1, pp: int = 1, dp_mode: str | None = None, dp_replicate: int = 1,
                   accumulation: int = 1, pp_schedule: str = "1f1b", pp_stages_per_rank: int | None = None,
                   optimizer: OptimizerChoice = ADAMW, ep: int = 1, cp: int = 1, cp_method: str = "allgather",
                   fused_loss: bool = False) -> int:
    """Estimated peak allocated bytes per GPU (see estimate_memory). dp_mode defaults to
    fsdp when dp_shard > 1 and to ddp otherwise; pp_stages_per_rank to 2 for the
    interleaved schedules; optimizer to AdamW (optimizer_from_config(cfg.optimizer) gives
    a run's); ep: parallel.ep of a mixture-of-experts model; cp: parallel.cp (each rank
    then holds seq_len / cp tokens of each of its micro_batch sequences) and cp_method its
    method, resolved (ParallelDims.context_method); fused_loss: training.fused_loss where the
    trainer runs it (neither tp nor pp)."""
    mode = dp_mode or ("fsdp" if dp_shard > 1 else "ddp")
    if pp_stages_per_rank is None:
        pp_stages_per_rank = 2 if pp_schedule in ("interleaved_1f1b", "zero_bubble") else 1
    layout = Layout(mode, dp_replicate, dp_shard if mode == "fsdp" else 1, tp, pp, pp_schedule,
                    pp_stages_per_rank if pp > 1 else 1, ep=ep, cp=cp, cp_method=cp_method if cp > 1 else "allgather")
    return int(estimate_memory(args, layout, micro_batch, seq_len, activation_checkpointing, accumulation,
                               bf16, optimizer=optimizer, fused_loss=fused_loss).allocated)


def largest_fitting_micro_batch(args: ModelArgs, per_rank: int, seq_len: int, dp_shard: int,
                                activation_checkpointing: bool, free_bytes: int, headroom: float = 0.85,
                                **layout) -> int:
    """The largest divisor of the per-rank batch whose estimate fits in headroom x free memory.
    layout: the keyword arguments of training_bytes (tp, pp, dp_mode, dp_replicate, ...,
    optimizer).
    Accumulation follows from the divisor (per_rank / micro-batch)."""
    best = 1
    for mb in range(1, per_rank + 1):
        if per_rank % mb:
            continue
        need = training_bytes(args, mb, seq_len, dp_shard, activation_checkpointing, accumulation=per_rank // mb,
                              **layout)
        if need <= headroom * free_bytes:
            best = mb
    return best


def state_bytes(args: ModelArgs, optimizer: OptimizerChoice = ADAMW) -> float:
    """fp32 weights, gradients and the optimizer's GPU state of the whole model: a floor on the
    memory of all GPUs together, whatever the layout."""
    opt = rank_footprint(args, args.n_layers, True, True, 1, optimizer, 1)
    return (WEIGHT_BYTES + GRAD_BYTES) * args.num_params() + opt.gpu_state


