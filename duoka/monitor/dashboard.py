"""`duoka monitor`: a live terminal view of a run (following its metrics.jsonl) and of this
machine's GPUs, labelled with the training ranks that use them."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Group
from rich.table import Table
from rich.text import Text

from duoka.errors import DuokaError
from duoka.monitor.gpu import load_nvml, read_all
from duoka.state_files import read_jsonl


def read_records(path: Path) -> list[dict]:
    """Whole lines of metrics.jsonl (a line being written right now, or a torn one, is skipped)."""
    return read_jsonl(path)[0]


def _gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.1f}"


def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def run_view(records: list[dict], title: str):
    """The renderable for a run: headline figures, one row per rank, alerts."""
    if not records:
        return Text(f"{title}: no step finished yet", style="dim")
    r = records[-1]
    mfu = "-" if r.get("mfu") is None else f"{r['mfu']:.1%}"
    head = Text.assemble(
        (f"{title}  ", "bold"),  # loss and norm are null when NaN or infinite
        f"step {r['step']}  loss {_num(r['loss'], '{:.4f}')}  grad norm {_num(r['grad_norm'], '{:.3f}')}  ",
        f"lr {r['lr']:.2e}  {r['tokens_per_s']:,.0f} tok/s ({r['tokens_per_s_per_gpu']:,.0f}/GPU)  MFU {mfu}  ",
        f"step {r['step_time_s'] * 1e3:.0f} ms  data wait {r['data_time_s'] * 1e3:.1f} ms")
    phases = r.get("phase_s", {})
    breakdown = Text("step breakdown: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in phases.items()),
                     style="dim") if phases else Text("")
    table = Table(show_edge=False, header_style="bold")
    for col in ("rank", "loss", "step ms", "data ms", "peak GiB", "GPU", "util", "SM active", "mem GiB", "temp C",
                "power W", "SM MHz", "throttle", "share", "speed"):
        table.add_column(col, justify="left" if col in ("throttle",) else "right")
    per_rank, gpus = r.get("per_rank", {}), {g["rank"]: g for g in r.get("gpus", [])}
    balance = r.get("balance") or {}
    n = len(per_rank.get("step_time_s", []))
    for rank in range(n):
        g = gpus.get(rank, {})
        loss = per_rank["loss"][rank]
        peak = per_rank.get("peak_mem_gib", [None] * n)[rank]
        table.add_row(
            str(rank), _num(loss, "{:.4f}"), _num(per_rank["step_time_s"][rank] * 1e3, "{:.0f}"),
            _num(per_rank["data_time_s"][rank] * 1e3), _num(peak),
            _num(g.get("index"), "{}"), _num(g.get("utilization_pct"), "{}%"), _num(g.get("sm_active_pct"), "{:.0f}%"),
            _gib(g.get("memory_used_bytes")),
            _num(g.get("temperature_c"), "{}"), _num(g.get("power_w"), "{:.0f}"), _num(g.get("sm_clock_mhz"), "{}"),
            Text(", ".join(g.get("throttled", [])) or "-", style="red" if g.get("throttled") else ""),
            _num((balance.get("shares") or [None] * n)[rank], "{}"),
            _num((balance.get("speed") or [None] * n)[rank], "{:.1f}"))
    alerts = [Text(f"alert ({a['kind']}): {a['message']}", style="bold yellow") for a in r.get("alerts", [])]
    return Group(head, breakdown, table, *alerts)


def gpu_view(samples, rank_of: dict[int, int]):
    """This machine's GPUs (NVML order, like nvidia-smi), with the training rank on each."""
    table = Table(title="GPUs (NVML / nvidia-smi order)", show_edge=False, header_style="bold")
    for col in ("GPU", "name", "rank", "util", "memory GiB", "temp C", "power W", "SM MHz", "clock events"):
        table.add_column(col, justify="left" if col in ("name", "clock events") else "right")
    for s in samples:
        limit = "" if s.power_limit_w is None else f" / {s.power_limit_w:.0f}"
        table.add_row(str(s.index), s.name, str(rank_of.get(s.index, "-")), _num(s.utilization_pct, "{}%"),
                      f"{_gib(s.memory_used_bytes)} / {_gib(s.memory_total_bytes)}", _num(s.temperature_c, "{}"),
                      _num(s.power_w, "{:.0f}") + limit, _num(s.sm_clock_mhz, "{}"),
                      Text(", ".join(s.clock_reasons) or "-", style="red" if s.throttled else ""))
    return table


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
