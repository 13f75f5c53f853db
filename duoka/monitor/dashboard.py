"""`duoka monitor`: a live terminal view of a run (following its metrics.jsonl) and of this
machine's GPUs, labelled with the training ranks that use them. Its tables fit the width
they are drawn at (the terminal's; 80 columns when piped): see FittedTable."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from duoka.errors import DuokaError
from duoka.monitor.gpu import load_nvml, read_all
from duoka.state_files import read_jsonl

# Where the text means "no reading" (a CPU run's GPU columns, an unbalanced run's shares).
NONE = "-"
# rich's measure of an unconstrained table: wide enough for any row of readings.
UNBOUNDED = 10_000


def read_records(path: Path) -> list[dict]:
    """Whole lines of metrics.jsonl (a line being written right now, or a torn one, is skipped)."""
    return read_jsonl(path)[0]


def _gib(x) -> str:
    return NONE if x is None else f"{x / 2**30:.1f}"


def _num(x, fmt="{:.1f}") -> str:
    return NONE if x is None else fmt.format(x)


@dataclass(frozen=True)
class Col:
    header: str  # as the table shows it where the width allows
    short: str  # in a narrow terminal
    keep: int  # the column's rank when some must go: the lowest goes first
    justify: str = "right"


class FittedTable:
    """A table drawn at the width it is given, one line per row, every header whole (rich
    would otherwise squeeze 15 columns into 80 by cutting headers to `r…`): columns with no
    reading in any row are left out; where the rest is too wide, short headers without
    vertical rules; where that is too wide too, the columns of least use go, named below."""

    def __init__(self, columns: list[Col], rows: list[list], title: str | None = None):
        shown = [i for i, c in enumerate(columns)
                 if i == 0 or any(str(row[i]) != NONE for row in rows)]
        self.columns = [columns[i] for i in shown]
        self.rows = [[row[i] for i in shown] for row in rows]
        self.title = title

    def _table(self, keep: list[int], compact: bool) -> Table:
        table = Table(title=self.title, title_justify="left", header_style="bold", show_edge=False,
                      box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD, padding=(0, 1, 0, 0) if compact else (0, 1))
        for i in keep:
            c = self.columns[i]
            table.add_column(c.short if compact else c.header, justify=c.justify, no_wrap=True)
        for row in self.rows:
            table.add_row(*(row[i] for i in keep))
        return table

    def __rich_console__(self, console, options):
        def fits(table: Table) -> bool:
            return console.measure(table, options=options.update(max_width=UNBOUNDED)).maximum <= options.max_width

        keep = list(range(len(self.columns)))
        table = self._table(keep, compact=False)
        if fits(table):
            yield table
            return
        by_use = sorted(keep[1:], key=lambda i: self.columns[i].keep)
        while not fits(table := self._table(keep, compact=True)) and len(keep) > 2:
            keep.remove(by_use.pop(0))
        yield table
        shorts = [f"{self.columns[i].short}: {self.columns[i].header}" for i in keep
                  if self.columns[i].short != self.columns[i].header]
        left_out = [self.columns[i].header for i in range(len(self.columns)) if i not in keep]
        notes = (["; ".join(shorts)] if shorts else []) + \
            ([f"left out at {options.max_width} columns: {', '.join(left_out)} (a wider terminal shows them)"]
             if left_out else [])
        for note in notes:
            yield Text(note, style="dim", overflow="fold")


RANK_COLUMNS = [Col("rank", "rank", 100), Col("loss", "loss", 90), Col("step ms", "step", 85),
                Col("data ms", "data", 50), Col("peak GiB", "peak", 70), Col("GPU", "GPU", 45),
                Col("util", "util", 80), Col("SM active", "SM", 40), Col("mem GiB", "mem", 75),
                Col("temp C", "temp", 35), Col("power W", "W", 30), Col("SM MHz", "MHz", 20),
                Col("throttle", "throttle", 65, "left"), Col("share", "share", 60), Col("speed", "speed", 55)]
GPU_COLUMNS = [Col("GPU", "GPU", 100), Col("name", "name", 40, "left"), Col("rank", "rank", 90),
               Col("util", "util", 80), Col("memory GiB", "mem GiB", 85), Col("temp C", "temp", 50),
               Col("power W", "W", 60), Col("SM MHz", "MHz", 30), Col("clock events", "clock", 70, "left")]


def run_view(records: list[dict], title: str):
    """The renderable for a run: headline figures, one row per rank, alerts."""
    if not records:
        return Text(f"{title}: no step finished yet", style="dim")
    r = records[-1]
    mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
    # The title (a run folder's path, any length) on a line of its own and the figures in two lines
    # of under 80 columns: a wrap never parts a label from its value ("step" from "7").
    head = Text.assemble(
        (f"{title}\n", "bold"),  # loss and norm are null when NaN or infinite
        f"step {r['step']}  loss {_num(r['loss'], '{:.4f}')}  grad norm {_num(r['grad_norm'], '{:.3f}')}  ",
        f"lr {r['lr']:.2e}  MFU {mfu}\n",
        f"{r['tokens_per_s']:,.0f} tok/s ({r['tokens_per_s_per_gpu']:,.0f}/GPU)  ",
        f"step {r['step_time_s'] * 1e3:.0f} ms  data wait {r['data_time_s'] * 1e3:.1f} ms")
    phases = r.get("phase_s", {})
    breakdown = Text("step breakdown: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in phases.items()),
                     style="dim") if phases else Text("")
    per_rank, gpus = r.get("per_rank", {}), {g["rank"]: g for g in r.get("gpus", [])}
    balance = r.get("balance") or {}
    n = len(per_rank.get("step_time_s", []))
    rows = []
    for rank in range(n):
        g = gpus.get(rank, {})
        loss = per_rank["loss"][rank]
        peak = per_rank.get("peak_mem_gib", [None] * n)[rank]
        rows.append([
            str(rank), _num(loss, "{:.4f}"), _num(per_rank["step_time_s"][rank] * 1e3, "{:.0f}"),
            _num(per_rank["data_time_s"][rank] * 1e3), _num(peak),
            _num(g.get("index"), "{}"), _num(g.get("utilization_pct"), "{}%"), _num(g.get("sm_active_pct"), "{:.0f}%"),
            _gib(g.get("memory_used_bytes")),
            _num(g.get("temperature_c"), "{}"), _num(g.get("power_w"), "{:.0f}"), _num(g.get("sm_clock_mhz"), "{}"),
            Text(", ".join(g.get("throttled", [])) or NONE, style="red" if g.get("throttled") else ""),
            _num((balance.get("shares") or [None] * n)[rank], "{}"),
            _num((balance.get("speed") or [None] * n)[rank], "{:.1f}")])
    alerts = [Text(f"alert ({a['kind']}): {a['message']}", style="bold yellow") for a in r.get("alerts", [])]
    return Group(head, breakdown, FittedTable(RANK_COLUMNS, rows), *alerts)


def gpu_view(samples, rank_of: dict[int, int]):
    """This machine's GPUs (NVML order, like nvidia-smi), with the training rank on each."""
    rows = []
    for s in samples:
        limit = "" if s.power_limit_w is None else f" / {s.power_limit_w:.0f}"
        rows.append([str(s.index), s.name, str(rank_of.get(s.index, NONE)), _num(s.utilization_pct, "{}%"),
                     f"{_gib(s.memory_used_bytes)} / {_gib(s.memory_total_bytes)}", _num(s.temperature_c, "{}"),
                     _num(s.power_w, "{:.0f}") + limit, _num(s.sm_clock_mhz, "{}"),
                     Text(", ".join(s.clock_reasons) or NONE, style="red" if s.throttled else "")])
    return FittedTable(GPU_COLUMNS, rows, title="GPUs (NVML / nvidia-smi order)")


def ranks_by_gpu(run_dir: Path | None) -> dict[int, int]:
    """NVML index -> training rank, from the run's latest record (empty without a run)."""
    if run_dir is None or not (run_dir / "metrics.jsonl").exists():
        return {}
    records = read_records(run_dir / "metrics.jsonl")
    return {g["index"]: g["rank"] for g in (records[-1].get("gpus", []) if records else [])}


def monitor(run_dir: Path | None, gpus: bool, once: bool, interval: float, console) -> None:
    from rich.live import Live

    metrics = None if run_dir is None else run_dir / "metrics.jsonl"
    if run_dir is not None and not run_dir.is_dir():
        raise DuokaError(f"{run_dir} is not a run directory", "pass the job.output_dir of a duoka train run")
    nvml = load_nvml() if gpus else None
    if gpus and nvml is None:
        raise DuokaError("no NVIDIA driver answers on this machine (NVML)", "run duoka monitor --gpus on a GPU "
                         "machine; `duoka monitor RUN_DIR` works anywhere")

    def frame():
        parts = []
        if metrics is not None:
            parts.append(run_view(read_records(metrics) if metrics.exists() else [], str(run_dir)))
        if nvml is not None:
            parts.append(gpu_view(read_all(nvml), ranks_by_gpu(run_dir)))
        return Group(*parts)

    if once:
        console.print(frame())
        return
    with Live(frame(), console=console, refresh_per_second=4) as live:
        try:
            while True:
                time.sleep(interval)
                live.update(frame())
        except KeyboardInterrupt:
            pass
