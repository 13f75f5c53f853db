"""`duoka plan`: which parallel layout, micro-batch and activation checkpointing to train a
model with on a given set of GPUs, and why: the candidates made, ranked and explained
(`make_plan`), and what to do when nothing fits.

Every layout duoka runs is enumerated (ddp, fsdp, hsdp, tp within a node, pp, and their
combinations: duoka.plan.layouts), with every power-of-two micro-batch that divides the
per-rank batch, with and without activation checkpointing. Each gets a per-GPU memory
estimate (duoka.plan.memory) and a step time (duoka.plan.step_time); those that do not fit
are dropped, the rest ranked by step time, and among near-ties (within TIE) the simplest
layout wins: ddp > fsdp > hsdp > tp > pp, since each step to the right adds
communication on the critical path and ways to fail.

Optimizers: the plan is for optimizer.name / optimizer.offload as asked (AdamW by default).
When nothing fits with AdamW and no optimizer was asked for, it tries the others in
PROPOSAL_ORDER and plans with the first that fits, listing every one that does.
When nothing fits at all, the error names the fewest GPUs of this size that would do (and
fewer with quantized AdamW state), and whether one sequence per GPU would fit these.

A mixture-of-experts model is planned with data parallelism and expert parallelism only
(duoka.plan.moe: the trainer refuses tp and pp for it); the plan says what it counted.
Sequences longer than duoka.plan.context.CONTEXT_MIN_SEQ are also planned with context
parallelism (cp with fsdp/hsdp only, dense models only), which the ranking takes where the
sequence does not fit without it or where it is faster; the plan says what the sequence
needed without cp.

duoka.plan.scaling tabulates the plan from one node to the whole job; duoka.plan.published
sets it beside torchtitan's and Megatron-LM's published runs.
"""

from __future__ import annotations

import math
from dataclasses import replace

from duoka.errors import DuokaError
from duoka.models.qwen2.args import ModelArgs
from duoka.models.qwen2.context_parallel import ulysses_kv_repeat
from duoka.plan.context import (
    context_degrees,
    context_memory,
    kv_gathered_bytes,
    searches_context,
    ulysses_exchange_bytes,
)
from duoka.plan.hardware import HOST_USABLE_FRACTION, Hardware, hardware_notes
from duoka.plan.layouts import FAMILY_ORDER, enumerate_layouts, simplicity, with_cp
from duoka.plan.memory import (
    FUSED_LOSS_CHUNK_TOKENS,
    GIB,
    GRAD_BYTES,
    WEIGHT_BYTES,
    Layout,
    MemoryBreakdown,
    estimate_memory,
    state_bytes,
)
from duoka.plan.model_choice import ModelChoice
from duoka.plan.moe import active_params, expert_split, is_moe
from duoka.plan.optimizer_costs import ADAMW, OptimizerChoice
from duoka.plan.result import Candidate, Plan, gib_text, optimizer_keys
from duoka.plan.step_time import estimate_step_time

# Optimizers tried, in this order, when AdamW does not fit and none was asked for: the same
# update as AdamW with quantized state first (8-bit state tracks fp32 AdamW closely: Dettmers
# et al. 2022, arXiv:2110.02861; 4-bit loses a little more: Li et al. 2023, arXiv:2309.01507),
# then exact AdamW with its state and step on the host (slow: the host's step), then the
# optimizers that change the update (compare their loss curve before switching).
PROPOSAL_ORDER = (OptimizerChoice("adamw8bit"), OptimizerChoice("adamw4bit"), OptimizerChoice("adamw", "cpu"),
                  OptimizerChoice("adafactor"), OptimizerChoice("muon"), OptimizerChoice("sgd"))
TIE = 0.03  # step times within 3% of the fastest count as a tie: the simplest layout wins
MAX_GPUS_SEARCHED = 4096  # the largest job the "use at least N GPUs" search tries
DEFAULT_SEQ = 2048
DEFAULT_PER_GPU = 8  # sequences per GPU per step when --global-batch is not given
# Sequences long enough for cp keep the default's tokens per GPU instead (8 x 2,048): 8
# sequences of 131,072 per GPU would be 64 times the work of a step, and accumulating them
# holds every gradient unsharded under FSDP2.
DEFAULT_TOKENS_PER_GPU = DEFAULT_PER_GPU * DEFAULT_SEQ


def _micro_batches(per_rank: int) -> list[int]:
    return [1 << k for k in range(per_rank.bit_length()) if per_rank % (1 << k) == 0]


def plan_layouts(args: ModelArgs, hw: Hardware, seq_len: int) -> list[Layout]:
    """The layouts a plan of this sequence chooses from: with cp when the sequence is long
    enough (duoka.plan.context.searches_context)."""
    context_seq = seq_len if searches_context(args, seq_len) else None
    return enumerate_layouts(args, hw.gpus, hw.gpus_per_node, context_seq)


def lean_loss(layout: Layout, ac: bool) -> bool:
    """Whether a plan runs training.fused_loss: with checkpointing, the choice made to save
    memory, wherever the trainer runs it (neither tp nor pp). It costs no FLOPs (the unfused
    path's matmuls, chunk by chunk), and at long sequences the whole logits are most of a step's
    memory (Qwen2's 152k vocabulary: ~1.5 MB a token)."""
    return ac and layout.tp == 1 and layout.pp == 1


def evaluate(args: ModelArgs, hw: Hardware, seq_len: int, global_batch: int,
             layouts: list[Layout] | None = None, optimizer: OptimizerChoice = ADAMW,
             micro_batch: int | None = None, activation_checkpointing: bool | None = None) -> list[Candidate]:
    """Every (layout, micro-batch, checkpointing) combination the batch arithmetic allows,
    with its memory and step time; micro_batch / activation_checkpointing keep one value."""
    out = []
    acs = (False, True) if activation_checkpointing is None else (activation_checkpointing,)
    for layout in layouts if layouts is not None else plan_layouts(args, hw, seq_len):
        if global_batch % layout.dp_size or (layout.cp > 1 and seq_len % (2 * layout.cp)):
            continue  # cp cuts each sequence into 2 x cp equal chunks
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
                fused = lean_loss(layout, ac)
                mem = estimate_memory(args, layout, mb, seq_len, ac, m, optimizer=optimizer, fused_loss=fused)
                time = estimate_step_time(args, layout, mb, seq_len, global_batch, ac, hw, optimizer)
                fits = mem.reserved <= hw.usable_bytes and mem.host <= hw.usable_host_bytes
                out.append(Candidate(layout, mb, ac, m, mem, time, fits, optimizer, fused))
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


def _slower(ratio: float) -> str:
    return f"{ratio:.1f}x slower" if ratio >= 2 else f"{ratio - 1:.0%} slower"


def _without_ep(first: Candidate, ranked: list[Candidate], rejected: list[Candidate], usable: float) -> str | None:
    """Why the first layout splits the experts: the same layout at ep 1, slower or too large."""
    if first.layout.ep == 1:
        return None
    plain = replace(first.layout, ep=1)
    for c in ranked:
        if c.layout == plain:
            return f"{plain.describe()} (ep 1) is {_slower(c.time.total_s / first.time.total_s)}"
    for c in rejected:
        if c.layout == plain:
            return (f"{plain.describe()} (ep 1) does not fit ({gib_text(c.memory.reserved)} GiB at micro-batch "
                    f"{c.micro_batch}{' with checkpointing' if c.activation_checkpointing else ''} > "
                    f"{gib_text(usable)} usable)")
    return None


# The parts of a breakdown that grow with the batch and the sequence, as the plan names them.
_SEQUENCE_PARTS = {"logits": "logits + cross-entropy", "activations": "activations",
                   "context": "cp's gathered keys/values, mask and bias", "gradients": "fp32 gradients"}


def _sequence_text(mem: MemoryBreakdown, micro_batch: int, ac: bool, accumulation: int) -> str:
    """`micro-batch 1, checkpointing; logits + cross-entropy 222.8, activations 28.0`: the point
    estimated and its two largest parts that the batch and the sequence make, in GiB."""
    parts = sorted(((getattr(mem, k), name) for k, name in _SEQUENCE_PARTS.items()), reverse=True)[:2]
    point = f"micro-batch {micro_batch}" + (f" x {accumulation} accumulated" if accumulation > 1 else "")
    return (f"{point}{', checkpointing' if ac else ''}; "
            + ", ".join(f"{name} {gib_text(v)}" for v, name in parts if v))


def _context_reasons(args: ModelArgs, seq_len: int, ranked: list[Candidate], rejected: list[Candidate],
                     hw: Hardware) -> list[str]:
    """Why the first layout splits its sequences: the same layout without cp and with half its
    cp, slower or too large; and why by its method (_method_reason). One the batch gave no
    candidate (fewer sequences than its data-parallel ranks) is estimated at one sequence per
    data-parallel rank."""
    first, usable = ranked[0], hw.usable_bytes
    cp = first.layout.cp
    if cp == 1:
        return []
    out = []
    for smaller in (1, cp // 2) if cp > 2 else (1,):
        lay = with_cp(args, first.layout, smaller)
        name = f"at seq {seq_len} without cp, {lay.describe()}" if smaller == 1 else lay.describe()
        fit = next((c for c in ranked if c.layout == lay), None)
        if fit is not None:
            out.append(f"{name} is {_slower(fit.time.total_s / first.time.total_s)}")
            continue
        miss = next((c for c in rejected if c.layout == lay), None)
        if miss is not None:
            mem, point = miss.memory, (miss.micro_batch, miss.activation_checkpointing, miss.accumulation)
        else:
            mem, ac = min(((estimate_memory(args, lay, 1, seq_len, ac, optimizer=first.optimizer,
                                            fused_loss=lean_loss(lay, ac)), ac)
                           for ac in (True, False)), key=lambda m: m[0].reserved)
            point = (1, ac, 1)
            if mem.reserved <= usable:  # it fits, but the batch has fewer sequences than its dp ranks
                batch = first.micro_batch * first.accumulation * first.layout.dp_size
                out.append(f"{name} fits ({gib_text(mem.reserved)} GiB per GPU at one sequence per data-parallel "
                           f"rank) but needs a global batch of {lay.dp_size} sequences, not {batch}")
                continue
        out.append(f"{name} needs {gib_text(mem.reserved)} GiB per GPU ({_sequence_text(mem, *point)}) > "
                   f"{gib_text(usable)} usable")
    return out + [_method_reason(args, first, seq_len, hw)]


def _method_reason(args: ModelArgs, first: Candidate, seq_len: int, hw: Hardware) -> str:
    """Why the first layout's cp runs by its method (parallel.cp_method=auto's choice), and
    where Ulysses runs, what the all-gather would need at the same point."""
    lay, heads = first.layout, args.n_heads
    if lay.cp_method == "allgather":
        return (f"cp {lay.cp} by all-gather: the model's {heads} attention heads do not divide by {lay.cp}, which "
                "Ulysses' all-to-all over heads needs")
    other = replace(lay, cp_method="allgather")
    point = (first.micro_batch, seq_len)
    mem = estimate_memory(args, other, *point, first.activation_checkpointing, first.accumulation,
                          optimizer=first.optimizer, fused_loss=first.fused_loss)
    time = estimate_step_time(args, other, *point, first.micro_batch * first.accumulation * lay.dp_size,
                              first.activation_checkpointing, hw, first.optimizer)
    fits = "" if mem.reserved <= hw.usable_bytes else f" (> {gib_text(hw.usable_bytes)} usable)"
    return (f"cp {lay.cp} by Ulysses: the {heads} attention heads divide by {lay.cp}, so attention runs over whole "
            f"sequences with one GPU's kernels and no dense mask: {gib_text(first.memory.reserved)} GiB per GPU and "
            f"{first.time.context_parallel_s:.2f} s of all-to-alls per step, where the all-gather needs "
            f"{gib_text(mem.reserved)} GiB{fits} and {time.context_parallel_s:.2f} s of all-gathers")


def explain(ranked: list[Candidate], rejected: list[Candidate], hw: Hardware, context: list[str] | None = None
            ) -> str:
    """One line: why the first layout is first; `context`: why it splits its sequences
    (_context_reasons)."""
    first = ranked[0]
    fastest = min(ranked, key=lambda c: c.time.total_s)
    usable = hw.usable_bytes
    tail = (f"est. {gib_text(first.memory.allocated)} GiB allocated per GPU ({gib_text(first.memory.reserved)} "
            f"reserved of {gib_text(usable)} usable).")
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
            reasons.append(f"{c.layout.describe()} does not fit ({gib_text(c.memory.reserved)} GiB at micro-batch "
                           f"{c.micro_batch}{' with checkpointing' if c.activation_checkpointing else ''} > "
                           f"{gib_text(usable)} usable)")
    reasons += [r for r in (_without_ep(first, ranked, rejected, usable),) if r] + (context or [])
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


def _sequence_and_batch(args: ModelArgs, hw: Hardware, seq_len: int | None, global_batch: int | None,
                        micro_batch: int | None) -> tuple[int, int, list[str]]:
    """(seq_len, global batch, notes on the defaults taken): the flags checked, the defaults
    filled in (2048 or the model's context; default_global_batch)."""
    notes = []
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ, args.context_len)
        if seq_len != DEFAULT_SEQ:
            notes.append(f"seq {seq_len}, the model's context (set --seq)")
    if seq_len < 1:
        raise DuokaError(f"--seq {seq_len} must be >= 1")
    if seq_len > args.context_len:  # the trainer refuses it too
        raise DuokaError(f"--seq {seq_len} exceeds the model's {args.context_len} positions",
                         f"use --seq {args.context_len} or less, or --model FOLDER whose config.json scales the "
                         "positions (rope_scaling yarn: Qwen's factor 4 over 32,768 reaches 131,072)")
    if global_batch is None:
        global_batch, why = default_global_batch(args, hw, seq_len)
        notes.append(f"global batch {global_batch} ({why}; set --global-batch)")
    if global_batch < 1:
        raise DuokaError(f"--global-batch {global_batch} must be >= 1")
    if micro_batch is not None and micro_batch < 1:
        raise DuokaError(f"--micro-batch {micro_batch} must be >= 1")
    return seq_len, global_batch, notes


def default_global_batch(args: ModelArgs, hw: Hardware, seq_len: int) -> tuple[int, str]:
    """(the global batch when --global-batch is not given, why): DEFAULT_PER_GPU sequences per
    GPU; for a sequence long enough for cp, DEFAULT_TOKENS_PER_GPU tokens per GPU, rounded up
    to whole sequences for each data-parallel rank of the layouts with the largest cp (of
    every GPU without cp)."""
    if not searches_context(args, seq_len):
        return DEFAULT_PER_GPU * hw.gpus, f"{DEFAULT_PER_GPU} sequences per GPU"
    unit = hw.gpus // max(context_degrees(hw.gpus, seq_len), default=1)
    batch = unit * math.ceil(max(1, hw.gpus * DEFAULT_TOKENS_PER_GPU // seq_len) / unit)
    return batch, (f"{batch * seq_len // hw.gpus:,} tokens per GPU: at sequences this long the default keeps about "
                   f"the {DEFAULT_TOKENS_PER_GPU:,} tokens per GPU of {DEFAULT_PER_GPU} sequences of {DEFAULT_SEQ}")


def _check_offload(optimizer: OptimizerChoice, hw: Hardware) -> None:
    if optimizer.offloaded and hw.gpus > 1:
        raise DuokaError(f"offload=cpu runs on one GPU: torchao's CPUOffloadOptimizer copies each gradient to the "
                         f"host as backward produces it, before any data-parallel reduction (its docstring: "
                         f"\"for single-GPU training\"), and this plan is for {hw.gpus} GPUs",
                         "on several GPUs shard the state instead (FSDP, which the plan considers; drop --offload) "
                         "or use an optimizer with less state (--optimizer adamw8bit)")


def _batch_does_not_split(layouts: list[Layout], hw: Hardware, global_batch: int,
                          micro_batch: int | None) -> DuokaError:
    """Why no candidate was made: the global batch (or the pinned micro-batch) divides none
    of the layouts' data-parallel shares."""
    sizes = sorted({lay.dp_size for lay in layouts})
    if micro_batch is not None and any(global_batch % d == 0 for d in sizes):
        shares = sorted({global_batch // d for d in sizes if global_batch % d == 0})
        return DuokaError(f"--micro-batch {micro_batch} divides none of the per-GPU batches "
                          f"({', '.join(map(str, shares))}) that --global-batch {global_batch} gives on {hw.gpus} "
                          "GPUs", "use a divisor of one of them, or a --global-batch that it divides")
    return DuokaError(f"--global-batch {global_batch} splits over none of the data-parallel sizes the layouts of "
                      f"{hw.gpus} GPUs have ({', '.join(map(str, sizes))})",
                      f"use a multiple of {hw.gpus}, e.g. --global-batch {hw.gpus * max(1, global_batch // hw.gpus)}")


def make_plan(model: ModelChoice, hw: Hardware, seq_len: int | None = None, global_batch: int | None = None,
              optimizer: OptimizerChoice | None = None, micro_batch: int | None = None,
              activation_checkpointing: bool | None = None) -> Plan:
    """The ranked plan; a DuokaError naming the smallest GPU count that works when nothing
    fits (or the batch arithmetic when no layout divides the batch). seq_len defaults to
    2048, or the model's context when shorter. optimizer: the one to plan with; None: AdamW,
    or when AdamW fits nowhere the first of PROPOSAL_ORDER that fits (the plan says why).
    micro_batch / activation_checkpointing: plan only with that value."""
    args = model.args
    asked_batch = global_batch is not None
    seq_len, global_batch, notes = _sequence_and_batch(args, hw, seq_len, global_batch, micro_batch)
    chosen = optimizer or ADAMW
    _check_offload(chosen, hw)
    notes += hardware_notes(hw)
    layouts = plan_layouts(args, hw, seq_len)
    pinned = {"micro_batch": micro_batch, "activation_checkpointing": activation_checkpointing}
    candidates = evaluate(args, hw, seq_len, global_batch, layouts, chosen, **pinned)
    if not candidates:
        raise _batch_does_not_split(layouts, hw, global_batch, micro_batch)
    ranked = rank(candidates)
    proposal, alternatives = "", []
    if not ranked:
        fitting = _fitting_optimizers(args, hw, seq_len, global_batch, layouts, chosen, pinned)
        alternatives = [rank(c)[0] for c in fitting.values()]
        if optimizer is not None or not alternatives:
            raise _does_not_fit(model, hw, seq_len, candidates, max(1, global_batch // hw.gpus) if asked_batch else 1,
                                chosen, alternatives, global_batch=global_batch, free_optimizer=optimizer is None)
        adamw_candidates = candidates
        chosen = alternatives[0].optimizer
        candidates = fitting[chosen]
        ranked = rank(candidates)
        proposal = _proposal(hw, adamw_candidates, alternatives, tried=[o for o in PROPOSAL_ORDER
                                                                        if hw.gpus == 1 or not o.offloaded])
    rejected = _best_per_layout([c for c in candidates if not c.fits], key=lambda c: c.memory.reserved)
    rejected = [c for c in rejected if c.layout not in {r.layout for r in ranked}]
    notes += _plan_notes(args, hw, ranked[0], chosen, seq_len)
    why = explain(ranked, rejected, hw, _context_reasons(args, seq_len, ranked, rejected, hw))
    return Plan(model, hw, seq_len, global_batch, ranked, sorted(rejected, key=lambda c: simplicity(c.layout)),
                why, len(candidates), notes, chosen, proposal, alternatives)


def _plan_notes(args: ModelArgs, hw: Hardware, best: Candidate, optimizer: OptimizerChoice, seq_len: int
                ) -> list[str]:
    """What the plan's first choice holds that a reader may not expect, and the speed
    switches the ranking does not model."""
    notes = []
    if best.layout.fsdp and best.layout.pp == 1 and best.accumulation > 1 and best.layout.dp_shard > 1:
        notes.append(f"gradient accumulation under fsdp: the trainer skips the reduce-scatter between "
                     f"micro-batches, so each GPU holds unsharded fp32 gradients ({gib_text(best.memory.gradients)} "
                     "GiB of its peak); --parallel.reduce_every_microbatch=true shards them (more reduce-scatter "
                     "traffic; this estimate does not include that saving), and a step without accumulation "
                     "(micro-batch = per-rank batch) does not hold them")
    if optimizer.offloaded:
        limit = ("unchecked: give --host-memory GiB per GPU" if hw.host_memory_gib is None else
                 f"within {gib_text(hw.usable_host_bytes)} of {hw.host_memory_gib:g} GiB usable "
                 f"({HOST_USABLE_FRACTION:.0%})")
        notes.append(f"host memory for the offloaded AdamW: {gib_text(best.memory.host)} GiB per GPU, half of it "
                     f"pinned (fp32 weights and gradients; {limit}); its step runs on the host, which the step time "
                     "counts")
    if is_moe(args):
        notes.append(_moe_note(args, best))
    if best.layout.cp > 1:
        notes.append(_context_note(args, best, seq_len))
    # Switches the ranking does not model: measured on 2 x H200 (docs/performance.md).
    speed = ("training.compile (on by default on GPUs; false turns it off): 1.65x eager for 0.5B under DDP, faster "
             "in every DDP and FSDP2 case measured (not yet measured under tp or pp), and no more memory than "
             "estimated")
    if best.layout.ep > 1:
        speed = ("training.compile, which the trainer leaves off under expert parallelism (auto; its token dispatch "
                 "reads the all-to-all's sizes on the host): this layout runs eager, as estimated")
    if best.layout.cp > 1:
        speed = ("training.compile, which the trainer leaves off under context parallelism (auto; its "
                 "attention's exchanges are checked eager only so far): this layout runs eager, as estimated")
    if args.num_params() >= 1e9 and not is_moe(args):  # the trainer refuses float8 for MoE models
        speed += ("; training.float8=tensorwise on GPUs of compute capability 8.9+: +14% (1.5B) to +30% (7B) "
                  "measured, not bit-equal to bf16 (compare the loss curve)")
    notes.append("speed switches this plan does not model: " + speed)
    return notes


def _context_note(args: ModelArgs, best: Candidate, seq_len: int) -> str:
    """What a plan with context parallelism counts and assumes (duoka.plan.context)."""
    lay, t, ac = best.layout, best.time, best.activation_checkpointing
    cp = lay.cp
    fused = (f"; training.fused_loss=true runs the head and the loss {FUSED_LOSS_CHUNK_TOKENS:,} tokens at a time "
             "(no whole logits)" if best.fused_loss else "")
    head = (f"context parallelism: cp {cp} cuts each sequence of {seq_len:,} tokens into {2 * cp} chunks, each GPU "
            f"holding two ({seq_len // cp:,} tokens, chunks i and {2 * cp - 1}-i, which balances causal attention); ")
    tail = (f"; fp32 weights, gradients and optimizer state shard over all {lay.fsdp_size} FSDP ranks, cp ranks "
            f"included{fused}; ")
    if lay.cp_method == "ulysses":
        qkv, out = ulysses_exchange_bytes(args, cp, 1, seq_len)
        repeat = ulysses_kv_repeat(args.n_kv_heads, cp)
        kv = (f", its {args.n_kv_heads} KV heads repeated x{repeat} to divide by {cp}" if repeat > 1 else "")
        return (head + f"by Ulysses every layer sends each GPU's q, k and v to the GPU of their heads "
                f"({args.n_heads // cp} query heads each{kv}; {qkv / 2**20:,.0f} MiB per sequence from each GPU) and "
                f"attention's output back ({out / 2**20:,.0f} MiB), backward the opposite: {t.context_parallel_s:.2f} s "
                f"of the {t.total_s:.2f} s step, on the critical path; attention runs over the whole sequence with "
                "one GPU's kernels, causal or varlen for packed documents (training.document_masking_kernel=auto on "
                "CUDA; sdpa would build a dense mask of the whole sequence), so no mask or bias is held" + tail
                + "the attention compute counts every score, as the all-gather's, though the causal kernels skip "
                "about half; the cp estimates are not yet checked against a GPU")
    ctx = context_memory(args, 1, seq_len, cp, 2)  # per sequence, bf16
    kv = 2 * kv_gathered_bytes(args, 1, seq_len)
    kept = "only the recomputed layer's, with checkpointing" if ac else f"all {args.n_layers} layers'"
    return (head + f"every layer all-gathers the whole sequence's keys and values ({kv / 2**20:,.0f} MiB per sequence) "
            f"and reduce-scatters their gradients: {t.context_parallel_s:.2f} s of the {t.total_s:.2f} s step, on the "
            f"critical path; the attention mask is dense, {gib_text(ctx.mask)} GiB of booleans per sequence"
            f"{' (kept by the checkpointed blocks until backward)' if ac else ''}, and SDPA turns it into a bf16 bias "
            f"in every layer ({gib_text(ctx.bias)} GiB, saved for that layer's backward: {kept})" + tail +
            "assumes SDPA runs cuDNN's fused attention, the one kernel that takes a mask with grouped-query heads "
            "(PyTorch's first choice on H100/H200 with cuDNN > 9.15): its math fallback would hold the scores, "
            "hundreds of GiB per layer; the cp estimates are not yet checked against a GPU")


def _moe_note(args: ModelArgs, best: Candidate) -> str:
    """What a mixture-of-experts plan counts and assumes (duoka.plan.moe)."""
    split, ep = expert_split(args), best.layout.ep
    active = active_params(args)
    text = (f"mixture of experts: {split.experts / 1e9:.1f}B of the {args.num_params() / 1e9:.1f}B parameters are "
            f"routed experts ({args.num_experts} in each of {split.moe_layers} layers, {args.num_experts_per_tok} per "
            f"token: {active / 1e9:.1f}B parameters active, which the compute counts); ")
    if ep > 1:
        a2a = best.time.expert_parallel_s
        se = best.layout.expert_shard
        fsdp = (f"their FSDP2 traffic runs over {se} ranks instead of {best.layout.dp_shard}" if se > 1 else
                "they are not sharded further (no FSDP2 traffic for them)")
        text += (f"ep {ep}: each GPU holds {args.num_experts // ep} experts of each layer for its group of {ep} and "
                 f"gets their tokens by all-to-all ({a2a:.2f} s of the {best.time.total_s:.2f} s step), {fsdp}; "
                 "routing is taken as balanced (a skewed router slows the busiest GPU and fills its receive buffers "
                 "beyond this estimate); ")
    return text + ("tp, pp, float8 and LoRA are not proposed: the trainer refuses them for MoE models; the MoE "
                   "estimates are not yet checked against a GPU")


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
    return (f"AdamW does not fit (at least {gib_text(smallest.memory.reserved)} GiB reserved per GPU, "
            f"{smallest.describe()}; {gib_text(hw.usable_bytes)} usable): planned with {first.optimizer.describe()}, "
            f"set {optimizer_keys(first.optimizer)}. Tried in the order {', '.join(o.describe() for o in tried)}: "
            "AdamW's update with less state first, then Adafactor, Muon and SGD, which change the update (compare the "
            "loss curve)")


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
        for batch in _smallest_batches(args, n, seq_len, per_gpu_batch):
            fitting = [c for c in evaluate(args, trial, seq_len, batch, optimizer=optimizer) if c.fits]
            if fitting:
                return n, batch, trial, rank(fitting)[0]
    return None


def _smallest_batches(args: ModelArgs, gpus: int, seq_len: int, per_gpu_batch: int = 1) -> list[int]:
    """The global batches that hold the least per GPU: per_gpu_batch sequences per GPU, and for
    a sequence long enough for cp per_gpu_batch per cp group (a group shares its sequences),
    from the smallest cp up."""
    batches = [gpus * per_gpu_batch]
    if searches_context(args, seq_len):
        batches += [gpus * per_gpu_batch // cp for cp in context_degrees(gpus, seq_len)]
    return batches


def _one_per_gpu(args: ModelArgs, hw: Hardware, seq_len: int, optimizers: list[OptimizerChoice], below: int
                 ) -> tuple[Candidate, int] | None:
    """(the first layout, its global batch) that fits these GPUs at one sequence per GPU (no
    accumulation, which under FSDP2 holds every gradient unsharded), or at one per cp group
    (_smallest_batches), with the first of `optimizers` that fits; batches under `below` only."""
    for batch in (b for b in _smallest_batches(args, hw.gpus, seq_len) if b < below):
        for opt in optimizers:
            if opt.offloaded and hw.gpus > 1:
                continue
            ranked = rank(evaluate(args, hw, seq_len, batch, optimizer=opt))
            if ranked:
                return ranked[0], batch
    return None


def _fewer_gpus_with_less_state(args: ModelArgs, hw: Hardware, seq_len: int, per_gpu_batch: int,
                                fewest: int | None) -> tuple[int, Candidate] | None:
    """(GPUs, candidate) of the fewest GPUs on which AdamW's update with quantized state
    (the first two of PROPOSAL_ORDER) fits, when fewer than `fewest` (AdamW's)."""
    for opt in PROPOSAL_ORDER[:2]:
        found = minimum_gpus(args, hw, seq_len, per_gpu_batch, opt)
        if found is not None and (fewest is None or found[0] < fewest):
            return found[0], found[3]
    return None


def _does_not_fit(model: ModelChoice, hw: Hardware, seq_len: int, candidates: list[Candidate],
                  per_gpu_batch: int, optimizer: OptimizerChoice = ADAMW,
                  alternatives: list[Candidate] | None = None, global_batch: int | None = None,
                  free_optimizer: bool = False) -> DuokaError:
    """The error of a plan where nothing fits, with what would: an optimizer with less state,
    one sequence per GPU (free_optimizer: with any optimizer of PROPOSAL_ORDER), more GPUs
    (and fewer with quantized AdamW state)."""
    args = model.args
    smallest = min(candidates, key=lambda c: c.memory.reserved)
    state = state_bytes(args, optimizer)
    per_param = state / args.num_params()
    per_param_text = f"{per_param:.0f}" if abs(per_param - round(per_param)) < 0.05 else f"{per_param:.1f}"
    which = "AdamW" if optimizer == ADAMW else optimizer.describe()
    host = (f" (and {gib_text(smallest.memory.host)} GiB of host memory against "
            f"{gib_text(hw.usable_host_bytes)} usable)" if smallest.memory.host > hw.usable_host_bytes else "")
    cause = (f"{model.label} ({args.num_params() / 1e9:.1f}B parameters) does not fit on {hw.gpus} x "
             f"{hw.gpu_memory_gib:g} GiB in any layout: the smallest estimate is "
             f"{gib_text(smallest.memory.reserved)} GiB reserved ({gib_text(smallest.memory.allocated)} allocated) "
             f"per GPU ({smallest.describe()}) against {gib_text(hw.usable_bytes)} GiB usable{host}; weights, "
             f"gradients and {which} state alone are {args.num_params() / 1e9:.1f}B x {per_param_text} bytes = "
             f"{state / 1e12:.2f} TB ({state / GIB:.0f} GiB) over all GPUs")
    if free_optimizer and not alternatives:
        bare = (WEIGHT_BYTES + GRAD_BYTES) * args.num_params()
        cause += "; no other optimizer fits either"
        if bare / hw.gpus > hw.usable_bytes:  # then the state of no optimizer is what fails
            cause += (f": fp32 weights and gradients alone are {args.num_params() / 1e9:.1f}B x "
                      f"{WEIGHT_BYTES + GRAD_BYTES} bytes = {bare / GIB:.0f} GiB, {bare / hw.gpus / GIB:.0f} per GPU")
    fixes = []
    if alternatives:
        c = alternatives[0]
        fixes.append(f"an optimizer with less state fits: {c.optimizer.describe()} ({c.describe(optimizer=False)}: "
                     f"{gib_text(c.memory.reserved)} GiB reserved per GPU; set {optimizer_keys(c.optimizer)}, or "
                     "leave --optimizer out to let the plan choose)")
    found = _one_per_gpu(args, hw, seq_len, [optimizer] + (list(PROPOSAL_ORDER) if free_optimizer else []),
                         global_batch) if global_batch is not None else None
    if found is not None:
        small, batch = found
        opt_flag = "" if small.optimizer == ADAMW else f" --optimizer {small.optimizer.name}"
        per = "GPU" if batch == hw.gpus else f"{hw.gpus // batch} GPUs (cp splits it)"
        fixes.append(f"one sequence per {per} fits these GPUs: --global-batch {batch}{opt_flag} "
                     f"({small.describe()}: {gib_text(small.memory.reserved)} GiB reserved per GPU; "
                     "accumulating micro-batches under fsdp holds every gradient unsharded)")
    return DuokaError(cause, "; or ".join(fixes + _more_gpus(model, hw, seq_len, per_gpu_batch, optimizer,
                                                             free_optimizer)))


def _more_gpus(model: ModelChoice, hw: Hardware, seq_len: int, per_gpu_batch: int, optimizer: OptimizerChoice,
               free_optimizer: bool) -> list[str]:
    """The fewest GPUs of this size that fit, and fewer with quantized AdamW state when the
    optimizer is the plan's to choose; else a shorter sequence."""
    args = model.args
    found = minimum_gpus(args, hw, seq_len, per_gpu_batch, optimizer)
    if found is None:
        return [(f"no layout fits even on {MAX_GPUS_SEARCHED} GPUs of {hw.gpu_memory_gib:g} GiB at seq {seq_len} "
                 f"with {per_gpu_batch} sequence(s) per GPU: use a shorter --seq or GPUs with more memory")]
    n, batch, trial, c = found
    nodes = f" ({trial.nodes} nodes of {trial.gpus_per_node})" if trial.nodes > 1 else ""
    opt_flag = "" if c.optimizer == ADAMW else f" --optimizer {c.optimizer.name}"
    fixes = [(f"use at least {n} GPUs of {hw.gpu_memory_gib:g} GiB{nodes}: there {c.describe()} needs "
              f"{gib_text(c.memory.reserved)} GiB per GPU at global batch {batch} (duoka plan --model "
              f"{model.label} --gpus {n}{f' --nodes {trial.nodes}' if trial.nodes > 1 else ''} --gpu-memory "
              f"{hw.gpu_memory_gib:g} --seq {seq_len} --global-batch {batch}{opt_flag})")]
    lighter = _fewer_gpus_with_less_state(args, hw, seq_len, per_gpu_batch, n) \
        if free_optimizer and optimizer == ADAMW else None
    if lighter is not None:
        m, c = lighter
        fixes.append(f"{m} GPUs of {hw.gpu_memory_gib:g} GiB with {c.optimizer.describe()} (AdamW's update, less "
                     f"state): {c.describe(optimizer=False)} needs {gib_text(c.memory.reserved)} GiB per GPU at "
                     f"global batch {m * per_gpu_batch} (--optimizer {c.optimizer.name})")
    return fixes + ["GPUs with more memory"]
