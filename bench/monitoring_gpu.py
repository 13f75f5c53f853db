"""Monitoring on GPUs (issue 8): one training run with everything on, and the overhead of
monitoring on tokens/s.

    python bench/monitoring_gpu.py --out-dir $OUT/monitoring [--model qwen2-0.5b] [--pairs 3]

1. A run with TensorBoard, the Prometheus endpoint, NVML readings every 0.5 s and alerts.
   While it trains, its endpoint is scraped over HTTP and `duoka monitor RUN --once` and
   `duoka monitor --gpus --once` are captured; afterwards `duoka report RUN` renders.
   Written: scrape.txt, live_view.txt, gpus.txt, report.html, metrics.jsonl, train.log.
2. Overhead: `duoka bench` cases alternating monitoring on (as above) and off
   (no TensorBoard, no endpoint, no alerts, NVML read once an hour), in pairs so drift
   in the GPUs' clocks falls on both sides. Written: overhead.json.

Reproduces bench/results/monitoring/ (its README), which docs/monitoring.md ("Measured on
2 x H200") and docs/images/ cite; device kind nvidia-h200-x2, from the repository root:

    PYTHONPATH=$PWD python bench/monitoring_gpu.py --out-dir $OUT/monitoring --steps 30 --pairs 2 --timed-steps 12
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from duoka.bench.training import run_duoka  # noqa: E402

PORT = 9464
MONITORING_ON = ["metrics.tensorboard=true", f"metrics.prometheus_port={PORT}", "metrics.gpu_interval_s=0.5",
                 "metrics.alerts=true"]
MONITORING_OFF = ["metrics.tensorboard=false", "metrics.prometheus_port=0", "metrics.gpu_interval_s=3600",
                  "metrics.alerts=false"]


def cli(*args: str, width: int = 180) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": str(width)}
    proc = subprocess.run([sys.executable, "-m", "duoka.cli", *args], capture_output=True, text=True, env=env,
                          timeout=120)
    return f"$ duoka {' '.join(args)}\n{proc.stdout}{proc.stderr}"


def everything_on(out: Path, model: str, nproc: int, steps: int, micro_batch: int, seq: int, layout_flags: list[str]) -> dict:
    run = Path(tempfile.mkdtemp(prefix="duoka-monitoring-")) / "run"
    cmd = [sys.executable, "-m", "duoka.cli", "train", f"--job.output_dir={run}", f"--model.flavor={model}",
           "--data.path=random", f"--training.seq_len={seq}", f"--training.micro_batch_size={micro_batch}",
           f"--training.global_batch_size={2 * micro_batch * nproc}", f"--training.steps={steps}",
           *layout_flags, "--checkpoint.enabled=false", "--checkpoint.export_final=false",
           f"--nproc-per-node={nproc}", *[f"--{s}" for s in MONITORING_ON]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = open(out / "train.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    metrics, scraped = run / "metrics.jsonl", None
    deadline = time.time() + 400
    # Scrape once the run is well into its steps (compilation done, readings flowing).
    while proc.poll() is None and time.time() < deadline:
        lines = metrics.read_text().count("\n") if metrics.exists() else 0
        if scraped is None and lines >= steps // 2:
            scraped = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=10).read().decode()
            (out / "scrape.txt").write_text(scraped)
            (out / "live_view.txt").write_text(cli("monitor", str(run), "--once"))
            (out / "gpus.txt").write_text(cli("monitor", "--gpus", "--once", str(run)))
        time.sleep(0.5)
    proc.wait(timeout=max(1, deadline - time.time()))
    log.close()
    if proc.returncode != 0:
        raise SystemExit(f"training failed (exit {proc.returncode}): {out / 'train.log'}")
    if scraped is None:
        raise SystemExit("the run ended before it could be scraped; raise --steps")
    (out / "report_cli.txt").write_text(cli("report", str(run)))
    shutil.copy(run / "report.html", out / "report.html")
    shutil.copy(metrics, out / "metrics.jsonl")
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    return {"steps": len(records), "scrape_lines": sum(1 for x in scraped.splitlines() if x.startswith("duoka_")),
            "sm_active_pct_last": [g.get("sm_active_pct") for g in records[-1].get("gpus", [])],
            "alerts": sorted({a["kind"] for r in records for a in r.get("alerts", [])})}


def overhead(model: str, nproc: int, pairs: int, micro_batch: int, steps: int, seq: int, layout: str) -> dict:
    on, off = [], []
    for i in range(pairs):
        # Alternate which side goes first, so a trend over the pairs does not favour one.
        order = [("on", MONITORING_ON), ("off", MONITORING_OFF)]
        for name, settings in (order if i % 2 == 0 else order[::-1]):
            r = run_duoka(model, layout, seq, micro_batch, None, steps, 3, nproc, 600, settings)
            (on if name == "on" else off).append(r["tokens_per_s_per_gpu"])
            print(f"pair {i} monitoring {name}: {r['tokens_per_s_per_gpu']:,.0f} tok/s/GPU", flush=True)
    ratios = [a / b for a, b in zip(on, off)]
    return {"model": model, "layout": layout, "seq": seq, "micro_batch": micro_batch, "gpus": nproc, "timed_steps": steps,
            "on_settings": MONITORING_ON, "off_settings": MONITORING_OFF, "on_tokens_per_s_per_gpu": on,
            "off_tokens_per_s_per_gpu": off, "on_over_off_per_pair": ratios,
            "overhead_pct_median": 100 * (1 - statistics.median(ratios))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--eager", action="store_true", help="no torch.compile (a quick check of the script on CPU)")
    ap.add_argument("--steps", type=int, default=40, help="steps of the everything-on run")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--timed-steps", type=int, default=15, help="timed steps per overhead case")
    a = ap.parse_args()
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    layout = "ddp" if a.eager else "ddp+compile"
    flags = ["--parallel.dp_mode=ddp", f"--training.compile={str(not a.eager).lower()}"]
    summary = {"run": everything_on(out, a.model, a.nproc, a.steps, a.micro_batch, a.seq, flags)}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary), flush=True)
    if a.pairs:
        summary["overhead"] = overhead(a.model, a.nproc, a.pairs, a.micro_batch, a.timed_steps, a.seq, layout)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        print(json.dumps(summary["overhead"]), flush=True)


if __name__ == "__main__":
    main()
