"""Does the balancer's measured speed follow the whole step's? One GPU, four runs of
Qwen2-0.5B (compile, micro-batch 8, global batch 32): plain; with the balance timer on;
slowed by `--debug.slow_ranks=0:0.5`; sharing the GPU with a competing matmul loop. For the
last two, the ratio of the timer's speed to the timed-only run's should equal the ratio
of their tokens/s: that is what lets the balancer pick the right shares on 2 GPUs.

    PYTHONPATH=$PWD python bench/balance_one_gpu.py --out $OUT/balance_one_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from balance_gpu import COMPETITOR, throughput, train

from duoka.bench.training import stop_process_groups_on_signal

TIMER = ["--parallel.balance=static", "--parallel.balance_weights=1"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="qwen2-0.5b")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--last", type=int, default=12)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    a = ap.parse_args()
    only = set(a.only.split(",")) if a.only else None
    stop_process_groups_on_signal()
    work = Path(tempfile.mkdtemp(prefix="duoka-balance1-"))
    result: dict = {"model": a.model, "steps": a.steps, "timed_last": a.last, "cases": {}}
    for name, extra, competitor in (("plain", [], False), ("timer", TIMER, False),
                                    ("timer_slow_option", [*TIMER, "--debug.slow_ranks=0:0.5"], False),
                                    ("timer_competitor", TIMER, True)):
        if only is not None and name not in only:
            continue
        comp = None
        if competitor:
            comp = subprocess.Popen([sys.executable, "-c", COMPETITOR.format(seconds=300)])
            time.sleep(5)
        try:
            recs = train(work / name, a.model, 1, extra, a.steps, "0", 8, 4, 2048, ["--training.compile=true"])
        finally:
            if comp is not None:
                comp.kill()
                comp.wait(timeout=60)  # gone from the GPU before the next case starts
        tail = recs[-a.last:]
        speeds = [r["balance"]["speed"][0] for r in tail if r.get("balance")]
        result["cases"][name] = {"tokens_per_s": throughput(recs, a.last),
                                 "timer_speed": statistics.median(speeds) if speeds else None,
                                 "step_time_s": [r["step_time_s"] for r in recs],
                                 "phase_s": [r.get("phase_s") for r in recs]}
        print(name, json.dumps({k: v for k, v in result["cases"][name].items() if k in ("tokens_per_s", "timer_speed")}),
              flush=True)
        Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    c = result["cases"]
    base = c.get("timer")
    for name in ("timer_slow_option", "timer_competitor"):
        if base is None or name not in c:
            continue
        result[name] = {"whole_step_ratio": c[name]["tokens_per_s"] / base["tokens_per_s"],
                        "timer_ratio": c[name]["timer_speed"] / base["timer_speed"]}
    if base is not None and "plain" in c:
        result["timer_overhead"] = 1 - base["tokens_per_s"] / c["plain"]["tokens_per_s"]
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "cases"}))


if __name__ == "__main__":
    main()
