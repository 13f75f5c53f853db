"""`duoka plan --scaling`: the plan's step time and tokens/s per GPU from one node to the
whole job, so a user sees where per-GPU efficiency falls and what causes it.

Each row plans the model on that many GPUs (whole nodes of the job's size) with the same
ranking and cost model as `duoka plan` (duoka.plan.ranking, duoka.plan.step_time, links
from duoka.plan.network) and keeps its first layout, or the first of one family
(`--family`). Weak scaling, the default, keeps the batch per GPU fixed (the global batch
grows with the GPUs: the work of each GPU is the same, so any loss of tokens/s per GPU is
communication or pipeline idling); strong scaling keeps the global batch fixed (each GPU's
share shrinks, as in Megatron-LM's strong-scaling runs). Efficiency is tokens/s per GPU
relative to the first row (one node, or the fewest GPUs the model fits on).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from duoka.errors import DuokaError
from duoka.plan.hardware import Hardware, hardware_notes
from duoka.plan.layouts import FAMILY_ORDER
from duoka.plan.memory import GIB
from duoka.plan.model_choice import ModelChoice
from duoka.plan.moe import active_params, is_moe
from duoka.plan.optimizer_costs import ADAMW, OptimizerChoice
from duoka.plan.ranking import DEFAULT_SEQ, default_global_batch, evaluate, rank
from duoka.plan.result import Candidate

DEFAULT_SCALING_GPUS = 1024  # the table's last row when --gpus is not given
DEFAULT_GPUS_PER_NODE = 8  # an HGX/DGX server, when --nodes does not say otherwise
FAMILIES = FAMILY_ORDER[1:]  # "single" is one GPU, no row of a scaling table


@dataclass
class ScalingRow:
    gpus: int
    nodes: int
    global_batch: int
    best: Candidate | None  # None: nothing (of the family) fits, or the batch does not split
    why_not: str = ""

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.best.time.tokens_per_s_per_gpu if self.best else 0.0


@dataclass
class Scaling:
    model: ModelChoice
    hardware: Hardware  # the largest row's
    seq_len: int
    mode: str  # weak | strong
    family: str | None
    rows: list[ScalingRow]
    notes: list[str] = field(default_factory=list)

    @property
    def reference(self) -> ScalingRow | None:
        return next((r for r in self.rows if r.best), None)

    def efficiency(self, row: ScalingRow) -> float | None:
        ref = self.reference
        if row.best is None or ref is None:
            return None
        return row.tokens_per_s_per_gpu / ref.tokens_per_s_per_gpu

    def why(self) -> str:
        """One line: how the last planned row compares with the first, and the overhead that
        grew the most between them (seconds per token per GPU)."""
        planned = [r for r in self.rows if r.best]
        if len(planned) < 2:
            return ""
        first, last = planned[0], planned[-1]
        eff = self.efficiency(last)

        def per_token(row: ScalingRow) -> dict[str, float]:
            """Overheads in seconds per token per GPU; exposed dp traffic split into its
            latency and its bandwidth in the proportion of the whole traffic."""
            t = row.best.time
            tokens = row.global_batch * self.seq_len / row.gpus
            out = {k: v / tokens for k, v in t.overheads().items()}
            lat = t.dp_latency_s / t.data_parallel_s if t.data_parallel_s else 0.0
            dp = out.pop("dp comm")
            out["dp latency"], out["dp bandwidth"] = dp * lat, dp * (1 - lat)
            return out

        a, b = per_token(first), per_token(last)
        grew, delta = max(((k, b[k] - a[k]) for k in a), key=lambda kv: kv[1])
        text = (f"at {last.gpus:,} GPUs, {eff:.0%} of the tokens/s per GPU of {first.gpus:,} "
                f"({last.best.layout.describe()} against {first.best.layout.describe()})")
        if delta > 0 and eff < 0.995:
            share_a = a[grew] * first.global_batch * self.seq_len / first.gpus / first.best.time.total_s
            share_b = b[grew] * last.global_batch * self.seq_len / last.gpus / last.best.time.total_s
            name = {"dp latency": "data-parallel latency (ring steps grow with the ranks of a group)",
                    "dp bandwidth": "data-parallel traffic" + (" over the network" if last.best.time.dp_across_nodes
                                                               else "")}.get(grew, grew)
            text += f"; what grew most: exposed {name}, from {share_a:.1%} to {share_b:.1%} of the step"
        elif eff >= 1.005:
            text += ("; more GPUs shard the state further: a shorter optimizer step per GPU, and room for a "
                     "faster micro-batch or layout")
        return text

    def to_dict(self) -> dict:
        rows = []
        for r in self.rows:
            d = {"gpus": r.gpus, "nodes": r.nodes, "global_batch": r.global_batch}
            if r.best:
                name, share = r.best.time.limit()
                d.update(r.best.to_dict())
                d.update(efficiency=round(self.efficiency(r), 4), largest_overhead=name,
                         largest_overhead_share=round(share, 4))
            else:
                d["why_not"] = r.why_not
            rows.append(d)
        hw = self.hardware
        return {"model": self.model.label, "mode": self.mode, "family": self.family, "seq_len": self.seq_len,
                "gpus_per_node": hw.gpus_per_node, "gpu_memory_gib": hw.gpu_memory_gib,
                "links": hw.describe_network(), "why": self.why(), "notes": self.notes, "rows": rows}


def scaling_counts(gpus_per_node: int, largest: int) -> list[int]:
    """One node, doubling up to `largest` (always the last row)."""
    counts, n = [], min(gpus_per_node, largest)
    while n < largest:
        counts.append(n)
        n *= 2
    return counts + [largest]


def scaling_hardware(hw: Hardware, gpus: int | None, nodes: int | None) -> Hardware:
    """The job the table grows to: --gpus (default DEFAULT_SCALING_GPUS) over --nodes
    (default: nodes of DEFAULT_GPUS_PER_NODE)."""
    gpus = gpus or DEFAULT_SCALING_GPUS
    nodes = nodes or max(1, gpus // DEFAULT_GPUS_PER_NODE)
    return replace(hw, gpus=gpus, nodes=nodes, detected=tuple(d for d in hw.detected if d != "gpus"))


def plan_scaling(model: ModelChoice, hw: Hardware, seq_len: int | None = None, global_batch: int | None = None,
                 mode: str = "weak", family: str | None = None, counts: list[int] | None = None,
                 optimizer: OptimizerChoice = ADAMW) -> Scaling:
    """Rows from one node of `hw` to all of it. `global_batch` is the batch of the largest
    row (weak scaling divides it per GPU for the others; default duoka plan's,
    ranking.default_global_batch); under strong scaling every row trains that batch. Every
    row trains with `optimizer` (AdamW by default; an offloaded one runs on one GPU only)."""
    if mode not in ("weak", "strong"):
        raise DuokaError(f"--scaling {mode} is unknown", "use --scaling weak (batch per GPU fixed) or --scaling strong "
                                                         "(global batch fixed)")
    if family is not None and family not in FAMILIES:
        raise DuokaError(f"--family {family} is unknown", f"use one of {', '.join(FAMILIES)}")
    if optimizer.offloaded:
        raise DuokaError("--offload cpu runs on one GPU (torchao's CPUOffloadOptimizer), and --scaling plans many",
                         "drop --offload, or plan one GPU without --scaling")
    args = model.args
    seq_len = seq_len or min(DEFAULT_SEQ, args.context_len)
    if seq_len > args.context_len:
        raise DuokaError(f"--seq {seq_len} exceeds the model's {args.context_len} positions",
                         f"use --seq {args.context_len} or less, or --model FOLDER whose config.json scales the "
                         "positions (rope_scaling yarn: Qwen's factor 4 over 32,768 reaches 131,072)")
    if global_batch is not None and global_batch < 1:
        raise DuokaError(f"--global-batch {global_batch} must be >= 1")
    largest, gpn = hw.gpus, hw.gpus_per_node
    # duoka plan's default: 8 sequences per GPU, or their tokens for sequences long enough for cp
    batch = global_batch or default_global_batch(args, hw, seq_len)[0]
    per_gpu = batch / largest
    notes = []
    if mode == "weak":
        notes.append(f"weak scaling: {per_gpu:g} sequence(s) of {seq_len} per GPU per step at every size, the "
                     "global batch growing with the GPUs (set --global-batch for the largest row)")
    else:
        notes.append(f"strong scaling: global batch {batch} sequences of {seq_len} at every size")
    if optimizer != ADAMW:
        notes.append(f"optimizer {optimizer.describe()} at every size")
    notes += hardware_notes(hw)
    rows = []
    for n in counts or scaling_counts(gpn, largest):
        trial = replace(hw, gpus=n, nodes=max(1, n // gpn) if n % gpn == 0 else 1, detected=())
        b = batch if mode == "strong" else max(1, round(per_gpu * n))
        candidates = evaluate(args, trial, seq_len, b, optimizer=optimizer)
        if family is not None:
            candidates = [c for c in candidates if c.family == family]
        ranked = rank(candidates)
        if ranked:
            rows.append(ScalingRow(n, trial.nodes, b, ranked[0]))
        elif not candidates:
            rows.append(ScalingRow(n, trial.nodes, b, None, f"batch {b} splits over no {family or ''} layout"))
        else:
            rows.append(ScalingRow(n, trial.nodes, b, None, f"no {family + ' ' if family else ''}layout fits "
                                                            f"{trial.usable_bytes / GIB:.0f} GiB"))
    if not any(r.best for r in rows):
        raise DuokaError(f"{model.label} fits in no {family + ' ' if family else ''}layout on any of "
                         f"{', '.join(str(r.gpus) for r in rows)} GPUs of {hw.gpu_memory_gib:g} GiB at seq {seq_len}",
                         f"duoka plan --model {model.label} --gpus {largest} names the smallest GPU count that "
                         "works; or drop --family")
    return Scaling(model, hw, seq_len, mode, family, rows, notes)


def render_scaling(result: Scaling, console) -> None:
    """The table, one line per GPU count, 80 columns wide at most."""
    from rich import box
    from rich.table import Table

    hw = result.hardware
    args = result.model.args
    fam = f", {result.family} layouts only" if result.family else ""
    active = f", {active_params(args) / 1e9:.2f}B active" if is_moe(args) else ""
    console.print(f"[bold]{result.model.label}[/] ({args.num_params() / 1e9:.2f}B parameters{active}): {result.mode} "
                  f"scaling on GPUs of {hw.gpu_memory_gib:g} GiB, {hw.gpus_per_node} per node, {hw.interconnect} "
                  f"inside{f', {hw.network} between' if hw.nodes > 1 else ''}{fam}")
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))
    for i, header in enumerate(("GPUs", "layout", "mb", "step s", "tok/s", "MFU", "eff.", "largest overhead")):
        table.add_column(header, justify="left" if i in (1, 7) else "right", no_wrap=True)
    for row in result.rows:
        c = row.best
        if c is None:
            table.add_row(f"{row.gpus:,}", f"[dim]{row.why_not}[/]", "", "", "", "", "", "")
            continue
        name, share = c.time.limit()
        table.add_row(f"{row.gpus:,}", c.layout.describe(compact=True),
                      f"{c.micro_batch}{'ac' if c.activation_checkpointing else ''}", f"{c.time.total_s:.2f}",
                      f"{c.time.tokens_per_s_per_gpu:,.0f}", f"{c.time.mfu:.0%}", f"{result.efficiency(row):.0%}",
                      f"{name} {share:.0%}")
    console.print(table)
    console.print("[dim]mb: micro-batch (ac: activation checkpointing); step s: optimizer step; tok/s: per GPU; "
                  "eff.: tokens/s per GPU relative to the first row; largest overhead: the biggest cost beyond "
                  "the matmuls, as a share of the step[/]")
    why = result.why()
    if why:
        console.print(f"[bold]why:[/] {why}")
    for note in result.notes:
        console.print(f"[dim]note: {note}[/]")
