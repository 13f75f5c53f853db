"""`duoka plan`'s terminal output: the plan as rich tables (the ranked layouts, the
optimizers that fit, the first layout's memory), why the first is first, the notes and the
config. `--json` prints Plan.to_dict instead (duoka.plan.result)."""

from __future__ import annotations

from duoka.plan.moe import active_params, is_moe
from duoka.plan.optimizer_costs import ADAMW
from duoka.plan.result import Plan, gib_text


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
                      "full" if c.activation_checkpointing else "-", gib_text(c.memory.allocated),
                      gib_text(c.memory.reserved), f"{c.time.total_s / fastest:.2f}",
                      f"{c.time.tokens_per_s_per_gpu:,.0f}", style="bold green" if i == 1 else None)
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
                      "full" if c.activation_checkpointing else "-", gib_text(c.memory.allocated),
                      gib_text(c.memory.reserved), gib_text(c.memory.host) if c.memory.host else "-",
                      f"{c.time.tokens_per_s_per_gpu:,.0f}", style="bold green" if c is plan.alternatives[0] else None)
    return table


def render(plan: Plan, console, top: int = 10) -> None:
    """The plan as rich tables: ranked layouts, the first one's memory, why, the config."""
    from rich.table import Table

    hw, best = plan.hardware, plan.best
    args = plan.model.args
    detected = f" (detected: {', '.join(plan.hardware.detected)})" if hw.detected else ""
    optimizer = f"; optimizer {plan.optimizer.describe()}" if plan.optimizer != ADAMW else ""
    active = f", {active_params(args) / 1e9:.2f}B active" if is_moe(args) else ""
    console.print(f"[bold]{plan.model.label}[/] ({args.num_params() / 1e9:.2f}B parameters{active}) on {hw.describe()}"
                  f"{detected}; seq {plan.seq_len}, global batch {plan.global_batch}{optimizer}; {plan.considered} "
                  f"combinations estimated, {len(plan.ranked)} layouts fit in {gib_text(hw.usable_bytes)} GiB usable")
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
              "optimizer_step": "optimizer step's temporaries",
              "context": ("cp: repeated KV heads, all-to-all buffers" if best.layout.cp_method == "ulysses"
                          else "cp: gathered keys/values, attention mask and bias")}
    for key, value in best.memory.parts().items():
        if key not in ("optimizer_step", "context") or value:
            mem.add_row(labels[key], gib_text(value))
    mem.add_row("[bold]peak allocated[/] (torch max_memory_allocated)", f"[bold]{gib_text(best.memory.allocated)}[/]")
    mem.add_row("reserved (+ fragmentation, CUDA context, NCCL)", gib_text(best.memory.reserved))
    if best.memory.host:
        mem.add_row("host memory (offloaded state, pinned weights and gradients)", gib_text(best.memory.host))
    console.print(mem)
    console.print(f"[bold]why first:[/] {plan.why}")
    for note in plan.notes:
        console.print(f"[dim]note: {note}[/]")
    console.print("[bold]config[/] (write it with --out FILE):")
    console.print(plan.config_toml(), markup=False, highlight=False, soft_wrap=True)
