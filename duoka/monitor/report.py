"""`duoka report RUN_DIR`: one self-contained HTML file with the run's plots (loss,
tokens/s, MFU, the step breakdown, per-GPU utilisation and memory, balance shares) and
its alerts. Charts are inline SVG drawn here, so the page opens from disk in any browser
with no server, no script and no network."""

from __future__ import annotations

import html
import json
import math
from pathlib import Path

from duoka.errors import DuokaError
from duoka.monitor.dashboard import read_records

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf"]
# The chart's size and its margins: room on the left for tick labels and the y axis's title,
# below for the x axis's ticks and title.
W, H, PAD_L, PAD_R, PAD_T, PAD_B = 560, 240, 78, 12, 14, 44
TICK = 5  # tick mark length, px
TICKS = 5  # about this many labelled ticks per axis


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-2:
        return f"{v:.3g}"
    return f"{v:.4g}"


def nice_ticks(lo: float, hi: float, count: int = TICKS, whole: bool = False, cover: bool = False) -> list[float]:
    """Round values about `count` of them, 1, 2, 2.5 or 5 times a power of ten apart (whole: a
    whole number apart, for steps): those within [lo, hi], or with `cover` from the last at
    or below lo to the first at or above hi (an axis that starts and ends on a tick)."""
    raw = (hi - lo) / max(count - 1, 1)
    power = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    if whole:
        step = max(1.0, float(round(step)))
    first = (math.floor if cover else math.ceil)(lo / step + (1e-9 if cover else -1e-9)) * step
    last = (math.ceil if cover else math.floor)(hi / step + (-1e-9 if cover else 1e-9)) * step
    return [first + i * step for i in range(round((last - first) / step) + 1)]


def svg_chart(title: str, series: dict[str, list[tuple[float, float]]], unit: str = "", x_title: str = "step") -> str:
    """A line chart of named (x, y) series, with ticks and a title on both axes (y's: the unit,
    else the chart's title); points with y None are left out."""
    series = {k: [(x, y) for x, y in pts if y is not None] for k, pts in series.items()}
    series = {k: v for k, v in series.items() if v}
    if not series:
        return ""
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y0, y1 = y0 - (abs(y0) * 0.05 or 1), y1 + (abs(y1) * 0.05 or 1)
    if x1 == x0:
        x1 = x0 + 1
    y_ticks = nice_ticks(y0, y1, cover=True)
    y0, y1 = y_ticks[0], y_ticks[-1]

    def px(x):
        return PAD_L + (x - x0) / (x1 - x0) * (W - PAD_L - PAD_R)

    def py(y):
        return PAD_T + (1 - (y - y0) / (y1 - y0)) * (H - PAD_T - PAD_B)

    bottom = H - PAD_B
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" role="img" '
             f'aria-label="{html.escape(title)}">',
             f'<rect x="{PAD_L}" y="{PAD_T}" width="{W - PAD_L - PAD_R}" height="{bottom - PAD_T}" '
             'fill="#fff" stroke="#bbb"/>']
    for y in y_ticks:
        parts.append(f'<line class="grid" x1="{PAD_L}" x2="{W - PAD_R}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
                     'stroke="#eee"/>')
        parts.append(f'<line class="tick" x1="{PAD_L - TICK}" x2="{PAD_L}" y1="{py(y):.1f}" y2="{py(y):.1f}" '
                     'stroke="#555"/>')
        parts.append(f'<text class="y-tick" x="{PAD_L - TICK - 3}" y="{py(y) + 4:.1f}" text-anchor="end" '
                     f'font-size="11">{_fmt(y)}</text>')
    for x in nice_ticks(x0, x1, whole=x_title == "step"):
        parts.append(f'<line class="tick" x1="{px(x):.1f}" x2="{px(x):.1f}" y1="{bottom}" y2="{bottom + TICK}" '
                     'stroke="#555"/>')
        parts.append(f'<text class="x-tick" x="{px(x):.1f}" y="{bottom + TICK + 12}" text-anchor="middle" '
                     f'font-size="11">{_fmt(x)}</text>')
    parts.append(f'<text class="x-title" x="{(PAD_L + W - PAD_R) / 2:.1f}" y="{H - 6}" text-anchor="middle" '
                 f'font-size="12">{html.escape(x_title)}</text>')
    mid = (PAD_T + bottom) / 2
    parts.append(f'<text class="y-title" x="14" y="{mid:.1f}" transform="rotate(-90 14 {mid:.1f})" '
                 f'text-anchor="middle" font-size="12">{html.escape(unit or title)}</text>')
    for i, (name, pts) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.6" points="{points}">'
                     f'<title>{html.escape(name)}</title></polyline>')
        parts.append(f'<text x="{PAD_L + 8 + 120 * (i % 4)}" y="{PAD_T + 14 + 14 * (i // 4)}" font-size="11" '
                     f'fill="{color}">{html.escape(name)}</text>')
    parts.append("</svg>")
    caption = f"{html.escape(title)}" + (f" ({html.escape(unit)})" if unit else "")
    return f'<figure><figcaption>{caption}</figcaption>{"".join(parts)}</figure>'


def charts(records: list[dict]) -> list[str]:
    steps = [r["step"] for r in records]

    def line(key, scale=1.0):
        return [(s, None if r.get(key) is None else r[key] * scale) for s, r in zip(steps, records)]

    out = [svg_chart("Loss", {"loss": line("loss"), "max over ranks": line("loss_max_rank")}),
           svg_chart("Throughput", {"tokens/s per GPU": line("tokens_per_s_per_gpu")}, "tokens/s"),
           svg_chart("MFU", {"MFU": line("mfu", 100.0)}, "%")]
    phases = sorted({k for r in records for k in r.get("phase_s", {})})
    # Step 1 compiles and warms the allocator (seconds against milliseconds): drawn with
    # the later steps, it flattens them all to the axis.
    later = list(zip(steps, records))[1:] if len(records) > 2 else list(zip(steps, records))
    out.append(svg_chart("Step breakdown (rank 0, from step 2)" if len(records) > 2 else "Step breakdown (rank 0)",
                         {p: [(s, r.get("phase_s", {}).get(p, 0.0) * 1e3) for s, r in later] for p in phases}, "ms"))
    ranks = sorted({g["rank"] for r in records for g in r.get("gpus", [])})

    def per_gpu(key, scale=1.0):
        return {f"rank {k}": [(s, next((g[key] * scale for g in r.get("gpus", [])
                                         if g["rank"] == k and g.get(key) is not None), None))
                              for s, r in zip(steps, records)] for k in ranks}

    out.append(svg_chart("GPU utilisation", per_gpu("utilization_pct"), "%"))
    if any(g.get("sm_active_pct") is not None for r in records for g in r.get("gpus", [])):
        out.append(svg_chart("SM activity (NVML GPM)", per_gpu("sm_active_pct"), "%"))
    out.append(svg_chart("GPU memory used", per_gpu("memory_used_bytes", 1 / 2**30), "GiB"))
    peak = [r.get("per_rank", {}).get("peak_mem_gib") for r in records]
    if any(peak):
        n = max(len(p) for p in peak if p)
        out.append(svg_chart("Peak allocated memory per rank", {
            f"rank {k}": [(s, p[k] if p and k < len(p) else None) for s, p in zip(steps, peak)] for k in range(n)},
            "GiB"))
    shares = [r.get("balance", {}).get("shares") if r.get("balance") else None for r in records]
    if any(shares):
        n = max(len(x) for x in shares if x)
        out.append(svg_chart("Load-balance shares", {
            f"rank {k}": [(s, x[k] if x else None) for s, x in zip(steps, shares)] for k in range(n)}, "samples"))
    if any(r.get("expert_load") for r in records):
        out.append(svg_chart("Expert load (MoE layers)", {
            "max imbalance": [(s, r["expert_load"]["max_imbalance"] if r.get("expert_load") else None)
                              for s, r in zip(steps, records)],
            "min effective experts": [(s, r["expert_load"]["min_effective_experts"] if r.get("expert_load") else None)
                                      for s, r in zip(steps, records)]}))
    return [c for c in out if c]


def expert_load_summary(records: list[dict]) -> str:
    """A MoE run's expert load at its last step and at its worst (fewest effective experts); "" when dense."""
    loaded = [r for r in records if r.get("expert_load")]
    if not loaded:
        return ""

    def line(r: dict) -> str:
        load = r["expert_load"]
        worst = min(range(len(load["layers"])), key=load["effective_experts"].__getitem__)
        return (f"step {r['step']}: max imbalance {load['max_imbalance']:.2f} (1 = even), fewest effective experts "
                f"{load['min_effective_experts']:.2f} (layer {load['layers'][worst]})")

    worst = min(loaded, key=lambda r: r["expert_load"]["min_effective_experts"])
    return (f"Expert load over {len(loaded[-1]['expert_load']['layers'])} MoE layers: final {line(loaded[-1])}; "
            f"worst {line(worst)}.")


def render(run_dir: Path) -> str:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise DuokaError(f"{metrics} does not exist", "pass the job.output_dir of a duoka train run")
    records = read_records(metrics)
    if not records:
        raise DuokaError(f"{metrics} has no finished step yet", "wait for the first step, then run it again")
    last = records[-1]
    alerts = {}
    for r in records:
        for a in r.get("alerts", []):
            alerts.setdefault(a["kind"], (r["step"], a["message"]))
    config = (run_dir / "config.toml").read_text() if (run_dir / "config.toml").exists() else ""
    mfu = "-" if last.get("mfu") is None else f"{last['mfu']:.1%}"
    loss = "-" if last["loss"] is None else f"{last['loss']:.4f}"  # null: NaN or infinite
    summary = (f"{len(records)} steps recorded, last step {last['step']}: loss {loss}, "
               f"{last['tokens_per_s']:,.0f} tokens/s ({last['tokens_per_s_per_gpu']:,.0f} per GPU), MFU {mfu}, "
               f"{last['tokens']:,} tokens in all.")
    moe = expert_load_summary(records)
    alert_html = "".join(f"<li><b>{html.escape(k)}</b> (first at step {s}): {html.escape(m)}</li>"
                         for k, (s, m) in alerts.items()) or "<li>none</li>"
    last_json = json.dumps(last).replace("</", "<\\/")  # JSON in a script element: no "</" may close it
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>duoka report: {html.escape(run_dir.name)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
.grid {{ display: flex; flex-wrap: wrap; gap: 12px; }}
figure {{ margin: 0; }} figcaption {{ font-weight: 600; margin: 4px 0; }}
pre {{ background: #f6f6f6; padding: 8px; overflow-x: auto; font-size: 12px; }}
</style></head><body>
<h1>duoka run report</h1>
<p>{html.escape(str(run_dir))}</p>
<p>{html.escape(summary)}</p>
{f"<p>{html.escape(moe)}</p>" if moe else ""}
<h2>Alerts</h2><ul>{alert_html}</ul>
<h2>Plots</h2><div class="grid">{"".join(charts(records))}</div>
<h2>Configuration</h2><pre>{html.escape(config)}</pre>
<script type="application/json" id="last-record">{last_json}</script>
</body></html>
"""


def write_report(run_dir: Path, out: Path | None = None) -> Path:
    out = out or run_dir / "report.html"
    tmp = out.with_suffix(".html.partial")
    tmp.write_text(render(run_dir), encoding="utf-8")
    tmp.replace(out)  # never a half-written report
    return out
